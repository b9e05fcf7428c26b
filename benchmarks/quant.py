"""int8 quantization: matmul kernels, engine decode throughput and weight memory (125M
benchmark model, bf16), and accuracy on the demo model's held-out text.

    python benchmarks/quant.py kernels            # per-layer matmul times at 32 / 256 rows
    python benchmarks/quant.py engine             # decode tok/s at batch 32, weight memory
    python benchmarks/quant.py engine --profile   # + where an int8 decode step spends its time
    python benchmarks/quant.py accuracy           # perplexity / top-1 on held-out text
    python benchmarks/quant.py weight-only        # int8 / int4 weight-only GEMV and GEMM
    python benchmarks/quant.py sensitivity --model F  # int8 sensitivity of a model's layers
    python benchmarks/quant.py decode --model F   # batch-1 decode tok/s per method
    python benchmarks/quant.py                    # kernels, engine and accuracy

Every figure is a ratio against a baseline measured in the same run; engines are timed in
interleaved rounds so that load from other processes hits them alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import build_bench_model, default_model_dir, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (name, in_features, out_features) of the 125M model's matmuls
SHAPES = [
    ("qkv_proj", 768, 1280),
    ("o_proj", 768, 768),
    ("gate_up_proj", 768, 4096),
    ("down_proj", 2048, 768),
    ("lm_head", 768, 32000),
]


def _race(fns: dict[str, Callable[[], object]], rounds: int = 5) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in samples.items()}


# ---- kernels ---------------------------------------------------------------------------------
def _kernel_row(name: str, k: int, n: int, m: int) -> str:
    from pagedllm.layers.linear import ReplicatedLinear
    from pagedllm.layers.quantization import DynamicQuantConfig

    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    layers = {}
    for mode, active in (("w8a8", True), ("weight_only", False)):
        layers[mode] = ReplicatedLinear(k, n, dtype=torch.bfloat16)
        layers[mode].weight.data.copy_(w)
        DynamicQuantConfig(enable_activation=active).apply(layers[mode])
    x = torch.randn(m, k, dtype=torch.bfloat16)
    xf, wf = x.float(), w.float()
    xq, qw = (torch.randint(-127, 128, shape, dtype=torch.int8) for shape in ((m, k), (n, k)))
    with torch.inference_mode():
        t = _race(
            {
                "bf16": lambda: F.linear(x, w),
                "fp32": lambda: F.linear(xf, wf),
                "w8a8": lambda: layers["w8a8"](x),
                "wo": lambda: layers["weight_only"](x),
                "int_mm": lambda: torch._int_mm(xq, qw.t()),
            }
        )
    ms = {key: f"{v * 1e3:.2f}" for key, v in t.items()}
    return (
        f"| {name} ({k} -> {n}) | {m} | {ms['bf16']} | {ms['fp32']} | {ms['w8a8']} "
        f"| {ms['wo']} | {ms['int_mm']} | {t['bf16'] / t['w8a8']:.2f}x |"
    )


def bench_kernels(rows: list[int]) -> str:
    lines = [
        "| layer (K -> N) | rows | bf16 F.linear ms | fp32 F.linear ms | int8 w8a8 ms "
        "| int8 weight-only ms | torch._int_mm ms | w8a8 speed-up vs bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, k, n in SHAPES:
        for m in rows if name != "lm_head" else [r for r in rows if r <= 256]:
            lines.append(_kernel_row(name, k, n, m))
    return "\n".join(lines)


# ---- engine decode throughput ----------------------------------------------------------------
ENGINES = {
    "bf16": dict(dtype="bfloat16"),
    "int8 (w8a8)": dict(dtype="bfloat16", quantization="int8"),
    "int8 weight-only": dict(dtype="bfloat16", quantization="int8", quant_activation=False),
    "int4 weight-only": dict(dtype="bfloat16", quantization="int4"),
    "fp32": dict(dtype="float32"),
}


def _start_decoding(model: Path, kwargs: dict, batch: int, prompt_len: int, tokens: int):  # noqa: ANN202
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    args = EngineArgs(model=str(model), kv_cache_memory_bytes=256 << 20, **kwargs)
    engine = LLMEngine.from_engine_args(args, skip_tokenizer_init=True)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    for i in range(batch):
        prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.scheduler_stats().num_waiting:  # prefill; every sequence then decodes
        engine.step()
    engine.step()
    return engine


def bench_engine(model: Path, batch: int, steps: int, rounds: int, profile: bool) -> str:
    from pagedllm.layers.quantization import weight_bytes

    engines = {
        name: _start_decoding(model, kw, batch, 16, rounds * steps + 4)
        for name, kw in ENGINES.items()
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / steps)
    step = {name: statistics.median(t) for name, t in times.items()}
    memory = {n: weight_bytes(e.executor.local_runner.model) for n, e in engines.items()}
    lines = [
        f"decode at batch {batch}: {rounds} interleaved rounds of {steps} steps, median step",
        "",
        "| engine | step ms | decode tok/s | vs bf16 | weight MB | weight vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for name in engines:
        lines.append(
            f"| {name} | {step[name] * 1e3:.1f} | {batch / step[name]:.1f} "
            f"| {step['bf16'] / step[name]:.2f}x | {memory[name] / 1e6:.1f} "
            f"| {memory[name] / memory['bf16']:.3f}x |"
        )
    if profile:
        lines += ["", _profile_step(engines["int8 (w8a8)"]), "", _profile_step(engines["bf16"])]
    for engine in engines.values():
        engine.shutdown()
    return "\n".join(lines)


def _profile_step(engine) -> str:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return "```\n" + table + "```"


# ---- accuracy --------------------------------------------------------------------------------
def heldout_ids(model: Path) -> list[int]:
    """The demo model's held-out documents, packed as in training (<s> doc </s> ...)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import train_demo_model as demo
    from transformers import AutoTokenizer

    _, heldout = demo.split_corpus(demo.build_corpus())
    return demo.pack_documents(AutoTokenizer.from_pretrained(str(model)), heldout).tolist()


def bench_accuracy(model: Path, dtype: str, window: int, max_tokens: int | None) -> str:
    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.quantize_cli import METHODS, evaluate, format_report

    args = EngineArgs(model=str(model), dtype=dtype, kv_cache_memory_bytes=256 << 20)
    report = evaluate(args, heldout_ids(model), window, max_tokens, METHODS)
    return f"model {model.name}, dtype {dtype}, windows of {window} tokens\n\n" + format_report(
        report
    )


# ---- weight-only kernels -------------------------------------------------------------------
def bench_weight_only(rows: list[int]) -> str:
    """Times of one product per kernel: the C++ weight-only int8 / int4 kernel (group 64)
    against the C++ W8A8 kernel and fp32 F.linear, on SmolLM2's gate_up shape."""
    from pagedllm.layers import cpu_int8, weight_only
    from pagedllm.layers.quantization import quantize_weight

    k, n = 576, 3072
    w = torch.randn(n, k) * 0.02
    p8, p4 = weight_only.quantize(w, 8, 64), weight_only.quantize(w, 4, 64)
    q, scale = quantize_weight(w)
    cpu_int8.load()
    packed, rowsum = cpu_int8.pack(q)
    lines = [
        f"SmolLM2 gate_up ({k} -> {n}), isa {weight_only.isa()}; microseconds per call",
        "",
        "| rows | fp32 F.linear | W8A8 (cpu_int8) | int8 weight-only | int4 weight-only |",
        "|---|---|---|---|---|",
    ]
    for m in rows:
        x = torch.randn(m, k)
        t = _race(
            {
                "fp32": lambda x=x: F.linear(x, w),
                "w8a8": lambda x=x: cpu_int8.linear(x, packed, rowsum, scale, 127),
                "w8": lambda x=x: weight_only.linear(x, p8, None),
                "w4": lambda x=x: weight_only.linear(x, p4, None),
            },
            rounds=50,
        )
        lines.append(f"| {m} | " + " | ".join(f"{t[key] * 1e6:.0f}" for key in t) + " |")
    return "\n".join(lines)


# ---- per-layer sensitivity -------------------------------------------------------------------
def _fake_int8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Symmetric int8 round trip along dim (the kernels' rounding: |q| <= 127)."""
    step = (x.abs().amax(dim, keepdim=True) / 127).clamp_min(1e-30)
    return (x / step).round().clamp(-127, 127) * step


def bench_sensitivity(model_dir: Path, tokens: int, layers: bool) -> str:
    """KL divergence from fp32 and top-1 agreement when one kind of linear layer (or one
    decoder layer) is int8: W8A8 with per-token inputs, the same after SmoothQuant (alpha
    0.5, ranges from 1024 calibration tokens), or weight-only. Fake quantization in
    transformers with the kernels' arithmetic; scored on the pydoc half quantize-eval reads,
    calibrated on the other half."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.entrypoints.quantize_cli import _default_text
    from pagedllm.layers.quantization import calibration_text

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    linears.pop("lm_head", None)
    weights = {n: m.weight.data.clone() for n, m in linears.items()}
    windows = lambda ids: [ids[i : i + 256] for i in range(0, len(ids) - 1, 256)]  # noqa: E731
    scored = windows(tok(_default_text())["input_ids"][:tokens])
    calib = windows(tok(calibration_text())["input_ids"][:1024])

    @torch.no_grad()
    def run(ws: list[list[int]]) -> list[torch.Tensor]:
        return [model(torch.tensor([w])).logits[0].log_softmax(-1) for w in ws]

    ranges: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, a, n=n: ranges.__setitem__(
                n,
                torch.maximum(ranges.get(n, a[0].new_zeros(())), a[0].abs().flatten(0, 1).amax(0)),
            )
        )
        for n, m in linears.items()
    ]
    run(calib)
    for h in hooks:
        h.remove()
    base = run(scored)

    def measure(plan: dict[str, str]) -> tuple[float, float]:
        handles = []
        for n, m in linears.items():
            m.weight.data.copy_(weights[n])
            mode = plan.get(n)
            if mode is None:
                continue
            s = torch.ones(m.weight.shape[1])
            if mode == "smooth":
                w_range = weights[n].abs().amax(0).clamp_min(1e-5)
                s = (ranges[n].clamp_min(1e-5).sqrt() / w_range.sqrt()).clamp(1e-2, 1e2)
            m.weight.data.copy_(_fake_int8(weights[n] * s, 1) / (s if mode == "wo" else 1))
            if mode != "wo":
                handles.append(
                    m.register_forward_pre_hook(lambda mod, a, s=s: (_fake_int8(a[0] / s, -1),))
                )
        out = run(scored)
        for h in handles:
            h.remove()
        count = sum(b.shape[0] for b in base)
        kl = sum((b.exp() * (b - o)).sum().item() for b, o in zip(base, out)) / count
        agree = sum((b.argmax(-1) == o.argmax(-1)).sum().item() for b, o in zip(base, out))
        return kl, agree / count

    kinds = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
             "gate_up": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fmt: skip
    lines = [
        f"model {model_dir.name}, {sum(len(w) for w in scored)} scored tokens; KL from fp32 "
        "(nats/token) and top-1 agreement",
        "",
        "| int8 layers | W8A8 | W8A8 + SmoothQuant | weight-only |",
        "|---|---|---|---|",
    ]
    for kind, suffixes in kinds.items():
        cells = []
        for mode in ("w8a8", "smooth", "wo"):
            kl, agree = measure({n: mode for n in linears if n.endswith(suffixes)})
            cells.append(f"{kl:.5f} / {agree:.4f}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    default = {n: "wo" if n.endswith("down_proj") else "smooth" for n in linears}
    for label, plan in (
        ("every linear W8A8", {n: "w8a8" for n in linears}),
        ("every linear W8A8 + SmoothQuant", {n: "smooth" for n in linears}),
        ("default: SmoothQuant, down_proj weight-only", default),
        ("every linear weight-only", {n: "wo" for n in linears}),
    ):
        kl, agree = measure(plan)
        lines.append(f"| {label} | {kl:.5f} / {agree:.4f} | | |")
    if layers:
        lines += ["", "| decoder layer (default scheme) | KL | agreement |", "|---|---|---|"]
        count = getattr(model.config, "num_hidden_layers", 0)
        for i in range(count):
            plan = {n: mode for n, mode in default.items() if f".layers.{i}." in n}
            kl, agree = measure(plan)
            lines.append(f"| {i} | {kl:.5f} | {agree:.4f} |")
    return "\n".join(lines)


# ---- batch-1 decode per method ---------------------------------------------------------------
def bench_decode(model_dir: Path, tokens: int = 64) -> str:
    """Out tok/s of one 16-token prompt decoding ``tokens`` tokens (best of 3) per method:
    fp32, the default int8, every linear W8A8 + SmoothQuant (the fused decoder's case), int4."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.quantization import DynamicQuantConfig

    kw = dict(dtype="float32", kv_cache_memory_bytes=1 << 26, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 116))}
    lines = ["| setting | out tok/s |", "|---|---:|"]
    for label, quantization in (
        ("fp32", None), ("int8 (default)", "int8"), ("int8, every linear W8A8", "w8a8"),
        ("int4", "int4"),
    ):  # fmt: skip
        llm = LLM(
            str(model_dir), quantization=None if quantization == "w8a8" else quantization, **kw
        )
        if quantization == "w8a8":
            DynamicQuantConfig(weight_only_layers=()).apply(
                llm.llm_engine.executor.local_runner.model
            )
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        best = min(
            _timed(lambda llm=llm: llm.generate([prompt], params, use_tqdm=False)) for _ in range(3)
        )
        lines.append(f"| {label} | {tokens / best:.1f} |")
        llm.llm_engine.shutdown()
    return "\n".join(lines)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", default=["kernels", "engine", "accuracy"])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None, help="125M model folder")
    parser.add_argument("--demo-model", type=Path, default=ROOT / "models" / "pagedllm-demo")
    parser.add_argument("--accuracy-dtype", default="float32")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared machine)")
    parser.add_argument("--model", type=Path, default=None, help="sensitivity: a model folder")
    parser.add_argument("--tokens", type=int, default=1024, help="sensitivity: tokens scored")
    parser.add_argument("--layers", action="store_true", help="sensitivity: each decoder layer")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    print(f"machine: {machine()}\n")
    if "kernels" in ns.parts:
        print(bench_kernels(ns.rows), "\n", flush=True)
    if "engine" in ns.parts:
        model = build_bench_model(ns.model_dir or default_model_dir())
        print(bench_engine(model, ns.batch, ns.steps, ns.rounds, ns.profile), "\n", flush=True)
    if "accuracy" in ns.parts:
        print(bench_accuracy(ns.demo_model, ns.accuracy_dtype, ns.window, ns.max_tokens))
    if "weight-only" in ns.parts:
        print(bench_weight_only([1, 4, 8, 16]), "\n", flush=True)
    if "decode" in ns.parts:
        if ns.model is None:
            parser.error("decode needs --model FOLDER")
        print(bench_decode(ns.model), flush=True)
    if "sensitivity" in ns.parts:
        if ns.model is None:
            parser.error("sensitivity needs --model FOLDER (a transformers checkpoint)")
        print(bench_sensitivity(ns.model, ns.tokens, ns.layers), flush=True)


if __name__ == "__main__":
    main()
