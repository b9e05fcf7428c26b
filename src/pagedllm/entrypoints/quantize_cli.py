"""``pagedllm quantize`` writes an int8 checkpoint; ``pagedllm quantize-eval`` compares each
quantization method (int8, int4) with full precision on a text (perplexity, top-1 accuracy,
its retention and agreement, weight memory)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedllm.config import (
    QUANT_METHOD,
    EngineArgs,
    QuantConfig,
    architecture_of,
    load_hf_config,
)
from pagedllm.entrypoints.cli import SUBCOMMANDS, add_engine_args, engine_args_from

if TYPE_CHECKING:
    from pagedllm.layers.quantization import DynamicQuantConfig


# ---- quantize: a full-precision folder -> an int8 folder ------------------------------------
def quantize_checkpoint(src: str | Path, dst: str | Path, config: QuantConfig) -> list[str]:
    """Write an int8 copy of a model folder; returns the checkpoint tensors quantized.

    Works tensor by tensor on the checkpoint's own (unfused) names, one shard file at a time,
    so the result loads sharded under any tensor_parallel_size. Each quantized ``X.weight``
    becomes int8 with an fp32 ``X.weight_scale``; config.json records the options.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagedllm.layers.quantization import DynamicQuantConfig, quantize_weight
    from pagedllm.models.loader import resolve_name
    from pagedllm.models.registry import get_model_class
    from pagedllm.models.sources import safetensors_files

    src, dst = Path(src), Path(dst)
    hf_config = load_hf_config(str(src))
    with torch.device("meta"):  # the module structure only, to name and select the layers
        model = get_model_class(architecture_of(hf_config))(hf_config, torch.float32)
    config = DynamicQuantConfig.from_config(config)  # its defaults resolved
    targets = config.targets(model)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    quantized: list[str] = []
    for path in safetensors_files(src):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                module, _, leaf = resolve_name(model, name)[0].rpartition(".")
                if leaf == "weight" and module in targets:
                    tensor, tensors[name + "_scale"] = quantize_weight(tensor, config.granularity)
                    quantized.append(name)
                tensors[name] = tensor.contiguous()
        save_file(tensors, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    _copy_metadata(src, dst, config, weight_map)
    return quantized


def _copy_metadata(
    src: Path, dst: Path, config: DynamicQuantConfig, weight_map: dict[str, str]
) -> None:
    """Tokenizer and other files as they are; config.json and the index updated."""
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy2(item, dst / item.name)
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "quant_dtype": config.quant_dtype,
        "granularity": config.granularity,
        "exclude_layers": list(config.exclude_layers),
        "quantize_embeddings": config.embeddings,
    }
    (dst / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    index = dst / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = weight_map
        index.write_text(json.dumps(data, indent=2) + "\n")


# ---- quantize-eval: teacher-forced scores of a text -----------------------------------------
@dataclass
class TextScores:
    """A model's teacher-forced predictions over a text, one entry per scored position."""

    logprobs: list[float]  # log p(the text's next token)
    top1: list[int]  # the model's most likely next token
    targets: list[int]  # the text's next token
    weight_bytes: int | None  # the engine's weights (single-process engines), else None

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))

    @property
    def accuracy(self) -> float:
        return sum(t == p for t, p in zip(self.targets, self.top1)) / len(self.targets)


def text_windows(ids: list[int], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """Consecutive windows of a token stream; each position after a window's first is scored."""
    ids = ids[:max_tokens] if max_tokens else ids
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window)]


def score_text(args: EngineArgs, windows: list[list[int]]) -> TextScores:
    """Run an engine over the windows (prompt logprobs) and collect its next-token scores."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.layers.quantization import weight_bytes
    from pagedllm.sampling_params import SamplingParams

    args = dataclasses.replace(args, enable_prefix_caching=False)
    llm = LLM.from_engine_args(args, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    prompts = [{"prompt_token_ids": w} for w in windows]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.llm_engine.executor.local_runner
    scores = TextScores([], [], [], weight_bytes(runner.model))
    for out, window in zip(outputs, windows):
        assert out.prompt_logprobs is not None
        for pos in range(1, len(window)):
            entry = out.prompt_logprobs[pos]  # {token: Logprob(logprob, rank)}
            assert entry is not None
            scores.logprobs.append(entry[window[pos]].logprob)
            scores.top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            scores.targets.append(window[pos])
    llm.llm_engine.shutdown()
    return scores


METHODS = ("int8", "int4")


def compare(full: TextScores, quant: TextScores, method: str = "int8") -> dict[str, float]:
    """The figures of the quantization bar: a method against full precision on the same text.
    int8's keys carry no suffix beyond ``_int8`` (the seed's names); other methods' carry
    ``_<method>`` on each."""
    agree = sum(a == b for a, b in zip(full.top1, quant.top1)) / len(full.top1)
    tail = "" if method == "int8" else f"_{method}"
    report = {
        "tokens": float(len(full.targets)),
        "ppl_full": full.perplexity,
        f"ppl_{method}": quant.perplexity,
        "acc_full": full.accuracy,
        f"acc_{method}": quant.accuracy,
        f"accuracy_retention{tail}": (
            quant.accuracy / full.accuracy if full.accuracy else float("nan")
        ),
        f"top1_agreement{tail}": agree,
    }
    if full.weight_bytes and quant.weight_bytes:
        report["weight_bytes_full"] = float(full.weight_bytes)
        report[f"weight_bytes_{method}"] = float(quant.weight_bytes)
        report[f"weight_ratio{tail}"] = quant.weight_bytes / full.weight_bytes
    return report


def evaluate(
    args: EngineArgs,
    ids: list[int],
    window: int,
    max_tokens: int | None,
    methods: tuple[str, ...] = ("int8",),
) -> dict:
    """Score a token stream with the model in full precision and in each method (args'
    quant_* options apply to int8)."""
    windows = text_windows(ids, window, max_tokens)
    full = score_text(dataclasses.replace(args, quantization=None), windows)
    report: dict = {"methods": list(methods)}
    for method in methods:
        scores = score_text(dataclasses.replace(args, quantization=method), windows)
        report.update(compare(full, scores, method))
    return report


def format_report(report: dict) -> str:
    methods = report.get("methods", ["int8"])

    def key(base: str, method: str) -> str:
        return base if method == "int8" else f"{base}_{method}"

    lines = [f"tokens scored: {int(report['tokens'])}", ""]
    lines.append("| | full precision | " + " | ".join(methods) + " |")
    lines.append("|---|---|" + "---|" * len(methods))
    rows = [
        ("perplexity", lambda m: report[f"ppl_{m}"], report["ppl_full"], "{:.3f}"),
        ("top-1 accuracy", lambda m: report[f"acc_{m}"], report["acc_full"], "{:.4f}"),
        ("accuracy retention", lambda m: report[key("accuracy_retention", m)], 1.0, "{:.4f}"),
        ("top-1 agreement", lambda m: report[key("top1_agreement", m)], 1.0, "{:.4f}"),
    ]
    if "weight_bytes_full" in report:
        rows.append(
            ("weight memory (MB)", lambda m: report[f"weight_bytes_{m}"] / 1e6,
             report["weight_bytes_full"] / 1e6, "{:.1f}")
        )  # fmt: skip
    for label, value, full, fmt in rows:
        cells = [fmt.format(value(m)) for m in methods]
        lines.append(f"| {label} | {fmt.format(full)} | " + " | ".join(cells) + " |")
    lines.append("")
    for m in methods:
        lines.append(
            f"{m}: accuracy retention {report[key('accuracy_retention', m)]:.4f}, "
            f"top-1 agreement {report[key('top1_agreement', m)]:.4f}, perplexity "
            f"{report[f'ppl_{m}']:.3f} (full {report['ppl_full']:.3f})"
            + (f", weight memory ratio {report[key('weight_ratio', m)]:.3f}"
               if key("weight_ratio", m) in report else "")
        )  # fmt: skip
    return "\n".join(lines)


def _default_text() -> str:
    """pydoc's topics, the half the int8 calibration pass does not read."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)[1::2])


def _eval(ns: argparse.Namespace) -> int:
    from pagedllm.engine.tokenizer import load_tokenizer

    args = engine_args_from(ns)
    text = _default_text() if ns.text is None else Path(ns.text).read_text(encoding="utf-8")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    ids = tokenizer.encode(text, add_special_tokens=True)
    report = evaluate(args, ids, ns.window, ns.max_tokens, tuple(ns.methods))
    print(json.dumps(report) if ns.json else format_report(report))
    return 0


def _quantize(ns: argparse.Namespace) -> int:
    args = engine_args_from(ns)
    if args.quantization == "int4":
        raise ValueError("quantize writes int8 checkpoints; int4 is quantized at load time.")
    names = quantize_checkpoint(args.model, ns.output, args.requested_quant_config())
    print(f"quantized {len(names)} weights to int8; wrote {ns.output}", file=sys.stderr)
    return 0


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    if name == "quantize":
        p = subparsers.add_parser(
            name,
            help=SUBCOMMANDS[name][1],
            description="Write an int8 copy of a model folder (int8 weights + fp32 scales); "
            "the engine loads it without quantizing again.",
        )
        p.add_argument("output", help="folder to write")
        add_engine_args(p, model_positional=False)
        p.set_defaults(func=_quantize)
        return p
    p = subparsers.add_parser(
        name,
        help=SUBCOMMANDS[name][1],
        description="Teacher-forced next-token scores of a text: perplexity and top-1 "
        "accuracy in full precision and each quantization method, its accuracy retention, "
        "top-1 agreement and weight memory.",
    )
    p.add_argument("--text", help="UTF-8 text file (default: Python's pydoc topics)")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(METHODS),
        help="quantization methods to compare with full precision (default: all)",
    )  # fmt: skip
    add_engine_args(p)
    p.set_defaults(func=_eval)
    return p
