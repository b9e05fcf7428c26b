"""The GPU timings: decode attention against torch SDPA, decode throughput against
transformers, and what CUDA graphs buy. One run on one CUDA GPU, a few minutes:

    python benchmarks/gpu_check.py [--out DIR] [--quick]

tools/gpu_check.sh runs it after the CUDA tests (tests/cuda). Sections, each timed on the same
GPU in this process:

  attention   one decode step's attention (bf16, one query token per sequence): the Triton
              kernel over a paged cache (blocks of 16, shuffled) against
              torch.nn.functional.scaled_dot_product_attention on contiguous K/V of the same
              lengths (GQA through enable_gqa), median of CUDA-event timings; and the K/V
              bytes each reads a microsecond
  throughput  random-weight bf16 models of SmolLM2-135M's and a 1B Llama's shapes, saved by
              transformers and loaded by both: one sequence decoding 256 tokens after a
              128-token prompt, and 64 such prompts decoding 128 tokens each (the whole
              generate call, prefill included); pagedllm with CUDA graphs and with
              enforce_eager, transformers' generate (dynamic cache, eager, warmed up, the same
              64 prompts as one static batch: equal lengths, no padding)

  profile     a graphed one-sequence decode step of the SmolLM2-shaped model: wall time, the
              forward within it, a torch.profiler table (gpu_check_profile.txt)

Writes gpu_check.json and gpu_check.md into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

MODELS = {
    "smollm2-135m-shape": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    ),
    "llama-1b-shape": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
    ),
}  # fmt: skip
ATTENTION_CASES = [  # (name, sequences, keys each, query heads, KV heads, head_dim)
    ("llama-8b b1 L1024", 1, 1024, 32, 8, 128),
    ("llama-8b b1 L8192", 1, 8192, 32, 8, 128),
    ("llama-8b b8 L2048", 8, 2048, 32, 8, 128),
    ("llama-8b b32 L2048", 32, 2048, 32, 8, 128),
    ("llama-8b b64 L4096", 64, 4096, 32, 8, 128),
    ("llama-8b b128 L1024", 128, 1024, 32, 8, 128),
    ("smollm2 b1 L512", 1, 512, 9, 3, 64),
    ("smollm2 b64 L512", 64, 512, 9, 3, 64),
]


def cuda_time_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median of reps CUDA-event timings of fn() (after warmup calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_time_ms(fn) -> float:
    """cuda_time_ms of fn captured as a CUDA graph: the GPU's time without the host's
    launches (how the engine's decode steps run them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return cuda_time_ms(graph.replay)


def attention_section(quick: bool) -> list[dict]:
    import torch.nn.functional as F

    from pagedllm.attention import triton_kernels
    from pagedllm.attention.metadata import VarlenBatch

    dev, dtype, block = torch.device("cuda"), torch.bfloat16, 16
    rows = []
    for name, seqs, keys, heads, kv_heads, dim in ATTENTION_CASES[: 4 if quick else None]:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(seqs, heads, dim, device=dev, dtype=dtype, generator=g)
        k = torch.randn(seqs, kv_heads, keys, dim, device=dev, dtype=dtype, generator=g)
        v = torch.randn_like(k)
        blocks_each = keys // block
        perm = torch.randperm(seqs * blocks_each, device=dev, generator=g)
        table = perm.view(seqs, blocks_each).to(torch.int32)
        # the paged cache holds the same keys: block table[s, j] <- keys j*16.. of sequence s
        k_cache = torch.empty(seqs * blocks_each, block, kv_heads, dim, device=dev, dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        paged = (seqs, blocks_each, block, kv_heads, dim)
        k_cache[table.long()] = k.permute(0, 2, 1, 3).reshape(paged)
        v_cache[table.long()] = v.permute(0, 2, 1, 3).reshape(paged)
        batch = VarlenBatch(
            torch.arange(seqs + 1, device=dev, dtype=torch.int32),
            torch.full((seqs,), keys, device=dev, dtype=torch.int32),
            None, table, 1, keys,
        )  # fmt: skip
        scale = dim**-0.5

        def ours(q=q, k_cache=k_cache, v_cache=v_cache, batch=batch, scale=scale):
            return triton_kernels.varlen_attention(q, k_cache, v_cache, batch, scale, -1, 0)[0]

        def sdpa(q=q, k=k, v=v, scale=scale):
            return F.scaled_dot_product_attention(
                q.unsqueeze(2), k, v, scale=scale, enable_gqa=True
            ).squeeze(2)

        got, want = ours(), sdpa()
        err = (got.float() - want.float()).abs().max().item()
        t_ours, t_sdpa = graph_time_ms(ours), graph_time_ms(sdpa)
        kv_bytes = 2 * seqs * keys * kv_heads * dim * 2
        rows.append(
            dict(
                case=name, triton_us=t_ours * 1e3, sdpa_us=t_sdpa * 1e3,
                speedup=t_sdpa / t_ours, max_abs_diff=err,
                triton_gbs=kv_bytes / t_ours / 1e6, sdpa_gbs=kv_bytes / t_sdpa / 1e6,
                triton_eager_us=cuda_time_ms(ours) * 1e3, sdpa_eager_us=cuda_time_ms(sdpa) * 1e3,
            )
        )  # fmt: skip
        print(f"attention {name}: {rows[-1]}", flush=True)
    return rows


def build_random_model(folder: Path, shape: dict) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def pagedllm_rates(
    folder: Path, prompts: list[list[int]], eager: bool, fused_ops: bool = False
) -> dict:
    """fused_ops: the Triton norm / SwiGLU / rotary kernels in place of the torch ops
    (PAGEDLLM_CUDA_FUSED_OPS=1, read when the engine is configured)."""
    from pagedllm import LLM, SamplingParams

    os.environ["PAGEDLLM_CUDA_FUSED_OPS"] = "1" if fused_ops else "0"
    start = time.perf_counter()
    llm = LLM(
        str(folder), dtype="bfloat16", device="cuda", enforce_eager=eager, max_num_seqs=64,
        max_model_len=1024, gpu_memory_utilization=0.5, skip_tokenizer_init=True,
    )  # fmt: skip
    startup = time.perf_counter() - start
    runner = llm.llm_engine.executor.runner

    def run(batch: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        torch.cuda.synchronize()
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return len(batch) * tokens / (time.perf_counter() - t0)

    run(prompts[:2], 8)  # warm-up: Triton compiles, cuBLAS picks
    one = run(prompts[:1], 256)
    many = run(prompts, 128)
    graphs = runner.graphs
    result = dict(
        startup_s=startup, batch1_tok_s=one, batch64_tok_s=many,
        graph_replays=0 if graphs is None else graphs.replays,
        capture_s=None if graphs is None else graphs.capture_seconds,
    )  # fmt: skip
    return result


def hf_rates(folder: Path, prompts: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda()

    def run(batch: list[list[int]], tokens: int) -> float:
        ids = torch.tensor(batch, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
            min_new_tokens=tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + tokens
        return len(batch) * tokens / (time.perf_counter() - t0)

    run(prompts[:2], 8)
    return dict(batch1_tok_s=run(prompts[:1], 256), batch64_tok_s=run(prompts, 128))


def throughput_section(quick: bool) -> list[dict]:
    import random

    rows = []
    for name, shape in list(MODELS.items())[: 1 if quick else None]:
        rng = random.Random(0)
        prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(128)] for _ in range(64)]
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_random_model(Path(tmp), shape)
            row: dict = dict(model=name)
            for key, fn in (
                ("graphs", lambda f=folder, p=prompts: pagedllm_rates(f, p, eager=False)),
                (
                    "graphs_triton_ops",
                    lambda f=folder, p=prompts: pagedllm_rates(f, p, False, fused_ops=True),
                ),
                ("eager", lambda f=folder, p=prompts: pagedllm_rates(f, p, eager=True)),
                ("hf", lambda f=folder, p=prompts: hf_rates(f, p)),
            ):
                try:
                    row[key] = fn()
                except Exception:  # noqa: BLE001 - one failed part must not hide the others
                    row[key] = dict(error=traceback.format_exc(limit=4))
                gc.collect()  # the engine or model of this part, before the next loads
                torch.cuda.empty_cache()
                print(f"throughput {name} {key}: {row[key]}", flush=True)
            rows.append(row)
    os.environ.pop("PAGEDLLM_CUDA_FUSED_OPS", None)
    return rows


def profile_section(quick: bool, out: Path) -> dict:
    """Where a graphed one-sequence decode step of the SmolLM2-shaped model goes: its wall
    time alone, the model's forward (the replay, synchronised) within it, and a
    torch.profiler table of 50 steps (written to gpu_check_profile.txt)."""
    from torch.profiler import ProfilerActivity, profile

    from pagedllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_random_model(Path(tmp), MODELS["smollm2-135m-shape"])
        llm = LLM(
            str(folder), dtype="bfloat16", device="cuda", max_num_seqs=64, max_model_len=1024,
            gpu_memory_utilization=0.5, skip_tokenizer_init=True,
        )  # fmt: skip
        engine, runner = llm.llm_engine, llm.llm_engine.executor.runner
        params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
        engine.add_request("p", {"prompt_token_ids": list(range(3, 131))}, params)
        for _ in range(20):
            engine.step()
        forward_s = []
        inner = runner.forward

        def timed_forward(*args, **kwargs):
            t0 = time.perf_counter()
            hidden = inner(*args, **kwargs)
            torch.cuda.synchronize()
            forward_s.append(time.perf_counter() - t0)
            return hidden

        runner.forward = timed_forward
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            engine.step()
        step_ms = (time.perf_counter() - t0) / 200 * 1e3
        runner.forward = inner
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                engine.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        gpu_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 50 / 1e3
        result = dict(
            step_ms=step_ms, forward_ms=sum(forward_s) / len(forward_s) * 1e3,
            profiled_gpu_ms_per_step=gpu_ms, graph_replays=runner.graphs.replays,
        )  # fmt: skip
        (out / "gpu_check_profile.txt").write_text(f"{result}\n\n{table}\n")
        print(f"profile: {result}", flush=True)
        return result


def markdown(report: dict) -> str:
    lines = [
        "# GPU check",
        "",
        f"{report['gpu']}, {report['sms']} SMs; torch {report['torch']}, triton "
        f"{report['triton']}, Python {report['python']}.",
        "",
        "## Decode attention (bf16, one query a sequence): Triton paged vs torch SDPA",
        "",
        "Replayed as CUDA graphs (GPU time, as the engine's decode steps run), and called",
        "eagerly (the host's launches included).",
        "",
        "| case | Triton us | SDPA us | SDPA / Triton | Triton GB/s | SDPA GB/s "
        "| eager: Triton us | eager: SDPA us | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.get("attention", []):
        lines.append(
            f"| {r['case']} | {r['triton_us']:.1f} | {r['sdpa_us']:.1f} | {r['speedup']:.2f}x "
            f"| {r['triton_gbs']:.0f} | {r['sdpa_gbs']:.0f} | {r['triton_eager_us']:.1f} "
            f"| {r['sdpa_eager_us']:.1f} | {r['max_abs_diff']:.1e} |"
        )
    lines += [
        "",
        "## Decode throughput (bf16, random weights), output tok/s",
        "",
        "pagedllm: CUDA graphs for decode; the same with the Triton norm / SwiGLU / rotary",
        "kernels (PAGEDLLM_CUDA_FUSED_OPS=1); every step eager (enforce_eager).",
        "",
        "| model | run | 1 sequence | 64 sequences | capture s | graph replays |",
        "|---|---|---|---|---|---|",
    ]

    def rate(part: dict, key: str) -> str:
        return f"{part[key]:.0f}" if key in part else "error"

    names = dict(
        graphs="pagedllm, graphs", graphs_triton_ops="pagedllm, graphs, Triton ops",
        eager="pagedllm, eager", hf="transformers generate",
    )  # fmt: skip
    for r in report.get("throughput", []):
        for key, label in names.items():
            part = r.get(key, {})
            capture = part.get("capture_s")
            lines.append(
                f"| {r['model']} | {label} | {rate(part, 'batch1_tok_s')} "
                f"| {rate(part, 'batch64_tok_s')} | {'-' if capture is None else f'{capture:.2f}'} "
                f"| {part.get('graph_replays', '-')} |"
            )
    if "profile" in report:
        p = report["profile"]
        lines += [
            "",
            "## One graphed decode step (SmolLM2 shape, one sequence)",
            "",
            f"Step {p['step_ms']:.2f} ms wall, of which the model's forward (replay, "
            f"synchronised) {p['forward_ms']:.2f} ms; the profiler's GPU time "
            f"{p['profiled_gpu_ms_per_step']:.2f} ms a step (gpu_check_profile.txt).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="fewer cases, one model")
    parser.add_argument("--sections", nargs="+", default=["attention", "throughput", "profile"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU")
    import triton

    props = torch.cuda.get_device_properties(0)
    report: dict = dict(
        gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, python=platform.python_version(),
    )  # fmt: skip
    sections = dict(
        attention=attention_section,
        throughput=throughput_section,
        profile=lambda quick: profile_section(quick, args.out),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.sections:
        try:
            report[name] = sections[name](args.quick)
        except Exception:  # noqa: BLE001 - report what failed, run the rest
            report[f"{name}_error"] = traceback.format_exc()
            print(report[f"{name}_error"], flush=True)
        # after every section: a run cut short (a lost machine, a timeout) keeps what it had
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
