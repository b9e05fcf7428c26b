"""Side by side in one run: this machine's peaks, pagedllm, HF transformers and llama.cpp.

1. Peaks: GEMM rate at the benchmark model's own linear shapes (fp32, bf16, int8; 1, 32 and
   256 rows; the fastest product torch or pagedllm has at each shape, prepacked oneDNN
   included) and memory bandwidth (read: a sum over 256 MiB; copy: read + write).
2. Batch workloads (benchmarks/throughput.py: uniform, mixed, shared-prefix; token-id prompts,
   greedy, ignore_eos): pagedllm fp32, bf16 and int8, HF transformers fp32 (best static batch,
   warmed up) and, with ``--llama-server PATH --gguf F ...``, llama.cpp's server (one slot per
   request, all requests sent at once) for every GGUF given.
3. One user: one request of 128 prompt + 128 output tokens, decode tok/s and time to first
   token, against ``llama-bench -p 128 -n 128`` (its tg128 and pp128) for every GGUF; the
   engines take turns for ``--batch1-rounds`` rounds and each keeps its best.

Prints output tok/s, ratios, pagedllm's matmul FLOP/s as a share of the GEMM peak and, at
batch 1, weight bytes/s as a share of the read bandwidth; writes JSON and the README chart.

    python benchmarks/compare.py --quick                   # ~15 min on 2 cores, no llama.cpp
    python benchmarks/compare.py --llama-server /work/llama-peer/bin/llama-server \\
        --gguf /work/llama-peer/gguf/llama-125m-{f32,f16,q8_0}.gguf        # full run
Build the llama.cpp peer and the GGUF files with tools/build_llama_cpp.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import BENCH_125M, build_bench_model, default_model_dir, machine  # noqa: E402
from serving import wait_healthy  # noqa: E402
from throughput import WORKLOADS, Request, make_workload, run_hf, run_pagedllm  # noqa: E402

PRECISIONS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},  # what dtype "auto" picks on a CPU with AVX-512 BF16
    "int8": {"dtype": "float32", "quantization": "int8"},
}


# ---- the model's shapes and costs ------------------------------------------------------------
def linear_shapes(c: dict = BENCH_125M) -> dict[str, tuple[int, int, int]]:
    """name -> (out features, in features, layers using it) of the benchmark model."""
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd, inter, layers = h // heads, c["intermediate_size"], c["num_hidden_layers"]
    return {
        "qkv": ((heads + 2 * kv) * hd, h, layers),
        "o": (h, heads * hd, layers),
        "gate_up": (2 * inter, h, layers),
        "down": (h, inter, layers),
        "lm_head": (c["vocab_size"], h, 1),
    }


def flops_per_token(include_head: bool) -> int:
    """Matmul FLOPs of one token through the decoder's linear layers (and the LM head)."""
    return sum(
        2 * n * k * times
        for name, (n, k, times) in linear_shapes().items()
        if include_head or name != "lm_head"
    )


def weight_bytes_per_token(bytes_per_weight: float) -> float:
    """Weights one decode step streams: every linear layer and the LM head (plus one
    embedding row, negligible)."""
    return bytes_per_weight * sum(n * k * t for n, k, t in linear_shapes().values())


# ---- peaks -----------------------------------------------------------------------------------
def _per_call(seconds: float, fn, *args: object) -> float:  # noqa: ANN001
    """Seconds per fn(*args) call, warmed up, repeated for at least `seconds`."""
    fn(*args)
    n, start = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < seconds:
        fn(*args)
        n += 1
    return (time.perf_counter() - start) / n


def _float_gemm(seconds: float, x: torch.Tensor, w: torch.Tensor) -> float:
    """Seconds per call of the fastest float product torch offers at this shape: F.linear
    (MKL or oneDNN) or oneDNN with the weight prepacked for it (what inductor's freezing
    uses), whichever wins; at one row also pagedllm's C++ GEMV."""
    from pagedllm.layers import cpu_fused

    best = _per_call(seconds, F.linear, x, w)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
    pointwise = torch.ops.mkldnn._linear_pointwise
    best = min(best, _per_call(seconds, pointwise, x, packed, None, "none", [], ""))
    if x.shape[0] == 1 and cpu_fused.load():
        best = min(best, _per_call(seconds, cpu_fused.gemv, x, w, None))
    return best


def gemm_peaks(rows: list[int], seconds: float) -> dict[str, dict[int, float]]:
    """GFLOP/s of the model's linear shapes (weighted by how often a token meets each) per
    dtype and row count. int8: the fastest int8 product available (oneDNN's u8 x s8 GEMM or,
    at few rows, pagedllm's C++ kernel), activations already quantized."""
    from pagedllm.layers import cpu_int8
    from pagedllm.layers.quantization import quantize_weight

    have_cpp = cpu_int8.load()
    peaks: dict[str, dict[int, float]] = {"fp32": {}, "bf16": {}, "int8": {}}
    for m in rows:
        spent = {k: 0.0 for k in peaks}
        flops = 0
        for n, k, times in linear_shapes().values():
            w = torch.randn(n, k) * 0.02
            x = torch.randn(m, k)
            flops += 2 * m * n * k * times
            spent["fp32"] += times * _float_gemm(seconds, x, w)
            spent["bf16"] += times * _float_gemm(seconds, x.bfloat16(), w.bfloat16())
            q, scale = quantize_weight(w)
            packed = torch.ops.onednn.qlinear_prepack(q, None)
            zp = torch.zeros(n, dtype=torch.long)
            xu = torch.randint(1, 128, (m, k), dtype=torch.uint8)
            best = _per_call(
                seconds, torch.ops.onednn.qlinear_pointwise,
                xu, 1.0, 64, packed, scale, zp, None, 1.0, 0, torch.float32, "none", [], "",
            )  # fmt: skip
            if have_cpp:
                cpacked, rowsum = cpu_int8.pack(q)
                cpp = _per_call(seconds, cpu_int8.linear, x, cpacked, rowsum, scale, 63)
                best = min(best, cpp)
            spent["int8"] += times * best
        for key in peaks:
            peaks[key][m] = flops / spent[key] / 1e9
    return peaks


def bandwidth(mib: int = 256) -> dict[str, float]:
    """GB/s: read (sum of a buffer far larger than the caches) and copy (bytes read + written)."""
    src = torch.ones(mib * 2**18)  # fp32
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = _per_call(1.0, torch.sum, src)
    copy = _per_call(1.0, dst.copy_, src)
    return {"read_gb_s": nbytes / read / 1e9, "copy_gb_s": 2 * nbytes / copy / 1e9}


# ---- pagedllm, one user ----------------------------------------------------------------------
def pagedllm_batch1(model: Path, precision: str, prompt_len: int, out_len: int) -> dict:
    """TTFT of a prompt_len prompt and decode tok/s over out_len tokens (one request)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model), skip_tokenizer_init=True, max_num_seqs=1, **PRECISIONS[precision])
    prompt = make_workload("uniform", seed=1)[0].prompt[:prompt_len]

    def run(n: int) -> float:
        llm.llm_engine.block_manager.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    run(8)  # warm-up
    ttft = min(run(1) for _ in range(3))
    total = min(run(out_len) for _ in range(2))
    return {"ttft_s": ttft, "decode_tok_s": (out_len - 1) / (total - ttft)}


# ---- llama.cpp -------------------------------------------------------------------------------
def gguf_format(path: Path) -> str:
    match = re.search(r"(f32|f16|bf16|q8_0|q4_0|q4_k_m)", path.name.lower())
    return match[1] if match else path.stem


def llama_bench(binary: Path, gguf: Path, threads: int, prompt_len: int, out_len: int) -> dict:
    """llama-bench's pp<prompt_len> and tg<out_len> (tok/s, mean of its repetitions)."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(prompt_len), "-n", str(out_len)]
    cmd += ["-t", str(threads), "-r", "3", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return {"ttft_s": prompt_len / pp, "decode_tok_s": tg}


@dataclass
class LlamaServer:
    """llama-server on one GGUF with a slot per request of the largest workload."""

    binary: Path
    gguf: Path
    threads: int
    slots: int
    ctx_per_slot: int = 1024
    proc: subprocess.Popen | None = None
    url: str = ""

    def __enter__(self) -> LlamaServer:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-t", str(self.threads), "-tb", str(self.threads), "-np", str(self.slots)]
        cmd += ["-c", str(self.slots * self.ctx_per_slot), "-b", "2048", "-ub", "512"]
        cmd += ["--log-disable"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, self.proc, timeout=300)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def run(self, reqs: list[Request]) -> float:
        """All requests at once; seconds until the last one finished."""
        return asyncio.run(_llama_all(self.url, reqs))


async def _llama_all(url: str, reqs: list[Request]) -> float:
    import httpx

    async def one(client: httpx.AsyncClient, r: Request) -> int:
        body = {"prompt": r.prompt, "n_predict": r.output_len, "ignore_eos": True,
                "temperature": 0.0, "cache_prompt": True, "stream": False}  # fmt: skip
        resp = await client.post(url + "/completion", json=body)
        resp.raise_for_status()
        return int(resp.json()["tokens_predicted"])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        await one(client, Request(reqs[0].prompt[:8], 4))  # warm-up
        start = time.perf_counter()
        done = await asyncio.gather(*(one(client, r) for r in reqs))
        elapsed = time.perf_counter() - start
    if list(done) != [r.output_len for r in reqs]:
        raise RuntimeError("llama-server generated other token counts than requested")
    return elapsed


# ---- the run ---------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or build_bench_model(default_model_dir())
    scale = 0.25 if args.quick else args.scale
    hf_sizes = args.hf_batch_sizes or ([8, 16] if args.quick else [8, 16, 32, 64])
    results: dict = {"machine": machine(), "cpu_flags": _cpu_flags(), "load": _load()}
    print(f"machine: {results['machine']}\nflags: {results['cpu_flags']}\nload: {results['load']}")
    start = time.perf_counter()

    results["peaks"] = {"gemm_gflops": gemm_peaks([1, 32, 256], args.peak_seconds),
                        **bandwidth()}  # fmt: skip
    print_peaks(results["peaks"])

    batch: dict = {}
    for name in args.workloads:
        reqs = make_workload(name, scale=scale)
        row = batch[name] = {
            "requests": len(reqs),
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "output_tokens": sum(r.output_len for r in reqs),
        }
        for prec in args.precisions:
            seconds, info = run_pagedllm(model, reqs, PRECISIONS[prec])
            row[f"pagedllm {prec}"] = seconds
            row[f"pagedllm {prec} prefix hits"] = info["prefix_hits"]
            print(f"[{name}] pagedllm {prec}: {row['output_tokens'] / seconds:.1f} out tok/s")
        hf = {bs: run_hf(model, reqs, bs, "float32", warmup=True) for bs in hf_sizes}
        best = min(hf, key=hf.get)
        row["HF fp32"], row["HF best batch"] = hf[best], best
        print(f"[{name}] HF fp32 best (batch {best}): {row['output_tokens'] / hf[best]:.1f}")
        for gguf in args.gguf:
            slots = max(len(make_workload(w, scale=scale)) for w in args.workloads)
            key = f"llama.cpp {gguf_format(gguf)}"
            with LlamaServer(args.llama_server, gguf, args.threads, slots) as server:
                row[key] = server.run(reqs)
            print(f"[{name}] {key}: {row['output_tokens'] / row[key]:.1f} out tok/s")
    results["batch"] = batch

    # One user: the engines take turns, round after round, and each keeps its best round.
    # A shared machine's memory bandwidth drifts over minutes; batch-1 decode is bound by
    # it, so runs minutes apart would compare the machine's moods, not the engines.
    rounds: dict[str, list[dict]] = {}
    for _ in range(args.batch1_rounds):
        for prec in args.precisions:
            run = pagedllm_batch1(model, prec, 128, 128)
            rounds.setdefault(f"pagedllm {prec}", []).append(run)
        for gguf in args.gguf if args.llama_bench else []:
            run = llama_bench(args.llama_bench, gguf, args.threads, 128, 128)
            rounds.setdefault(f"llama.cpp {gguf_format(gguf)}", []).append(run)
    results["batch1"] = {
        name: {
            "decode_tok_s": max(r["decode_tok_s"] for r in runs),
            "ttft_s": min(r["ttft_s"] for r in runs),
            "rounds_decode_tok_s": [r["decode_tok_s"] for r in runs],
        }
        for name, runs in rounds.items()
    }
    results["seconds"] = time.perf_counter() - start
    report(results, model)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, Path(args.plot))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the 125M bench model")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    ap.add_argument("--hf-batch-sizes", nargs="+", type=int, default=None)
    ap.add_argument("--scale", type=float, default=1.0, help="share of each workload's requests")
    ap.add_argument("--quick", action="store_true", help="--scale 0.25, HF batches 8 and 16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peak-seconds", type=float, default=0.2, help="per GEMM shape")
    ap.add_argument(
        "--batch1-rounds",
        type=int,
        default=3,
        help="one-user rounds, the engines taking turns; each keeps its best (3)",
    )
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--llama-bench", type=Path, default=None, help="default: beside the server")
    ap.add_argument("--gguf", type=Path, nargs="*", default=[])
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/compare.json"))
    ap.add_argument("--plot", default="docs/compare.png", help="chart PNG ('' for none)")
    args = ap.parse_args()
    if args.gguf and args.llama_server is None:
        ap.error("--gguf needs --llama-server")
    if args.llama_server and args.llama_bench is None:
        bench = args.llama_server.parent / "llama-bench"
        args.llama_bench = bench if bench.exists() else None
    return args


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), [])  # fmt: skip
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
            "avx512_bf16", "amx_int8", "amx_bf16")  # fmt: skip
    return " ".join(f for f in flags if f in keep)


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- output ----------------------------------------------------------------------------------
def print_peaks(peaks: dict) -> None:
    print("\nGEMM at the model's shapes, GFLOP/s:")
    for dtype, by_rows in peaks["gemm_gflops"].items():
        print(f"  {dtype:5s} " + "  ".join(f"{m:4d} rows {v:7.1f}" for m, v in by_rows.items()))
    print(f"memory: read {peaks['read_gb_s']:.1f} GB/s, copy {peaks['copy_gb_s']:.1f} GB/s")


def report(results: dict, model: Path) -> None:
    peaks = results["peaks"]
    print(f"\nmodel: {model}, run took {results['seconds'] / 60:.1f} min")
    for name, row in results["batch"].items():
        out = row["output_tokens"]
        engines = [k for k in row if k.startswith(("pagedllm", "HF", "llama")) and
                   isinstance(row[k], float) and "prefix" not in k]  # fmt: skip
        print(f"\n[{name}] {row['requests']} requests, {out} output tokens")
        for k in engines:
            print(f"  {k:22s} {out / row[k]:8.1f} out tok/s")
        for prec in PRECISIONS:
            key = f"pagedllm {prec}"
            if key not in row:
                continue
            for ref in [k for k in engines if not k.startswith("pagedllm")]:
                print(f"  {key} / {ref}: {row[ref] / row[key]:.2f}x")
            flops = _run_flops(row, prec)
            peak = peaks["gemm_gflops"][prec][256]
            rate = flops / row[key] / 1e9
            print(f"  {key} matmul {rate:.1f} GFLOP/s = {100 * rate / peak:.0f}% of the "
                  f"256-row GEMM rate ({peak:.1f})")  # fmt: skip
    print("\n[one user] 128 prompt + 128 output tokens")
    bytes_per = {"fp32": 4, "int8": 1, "f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}
    for name, r in results["batch1"].items():
        fmt = name.split()[-1]
        wbytes = weight_bytes_per_token(bytes_per.get(fmt, 4))
        bound = peaks["read_gb_s"] * 1e9 / wbytes
        tok_s, ttft_ms = r["decode_tok_s"], r["ttft_s"] * 1e3
        rounds = " / ".join(f"{x:.1f}" for x in r.get("rounds_decode_tok_s", []))
        print(f"  {name:22s} decode {tok_s:6.1f} tok/s  TTFT {ttft_ms:7.1f} ms  bandwidth "
              f"bound {bound:6.1f} tok/s ({100 * tok_s / bound:.0f}%)  "
              f"rounds {rounds}")  # fmt: skip


def _run_flops(row: dict, prec: str) -> float:
    """Matmul FLOPs pagedllm did: every prompt token not found in the prefix cache and every
    fed-back output token through the decoder, one LM-head row per output token."""
    computed = row["prompt_tokens"] - row.get(f"pagedllm {prec} prefix hits", 0)
    body = computed + row["output_tokens"] - row["requests"]
    head = flops_per_token(True) - flops_per_token(False)
    return body * flops_per_token(False) + row["output_tokens"] * head


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {n: {k: r["output_tokens"] / v for k, v in r.items()
                  if isinstance(v, float) and k.startswith(("pagedllm", "HF", "llama"))
                  and "prefix" not in k}
              for n, r in results["batch"].items()}  # fmt: skip
    # the one-user rounds time pagedllm against llama-bench only: HF has no bar there
    one_user = "one user (decode):\npagedllm vs llama-bench"
    groups[one_user] = {k: v["decode_tok_s"] for k, v in results["batch1"].items()}
    engines = sorted({e for g in groups.values() for e in g}, key=_engine_order)
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, engine in enumerate(engines):
        xs = [g + (i - (len(engines) - 1) / 2) * width for g in range(len(groups))]
        ys = [groups[n].get(engine, 0.0) for n in groups]
        ax.bar(xs, ys, width=width, label=engine)
        for x, n in zip(xs, groups):  # an absent bar says so instead of leaving a gap
            if engine not in groups[n]:
                ax.text(x, 5, "not timed", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"125M Llama on {results['machine'].split(',')[0]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"chart: {path}")


def _engine_order(name: str) -> tuple[int, str]:
    return ({"H": 0, "l": 1, "p": 2}[name[0]], name)


if __name__ == "__main__":
    main()
