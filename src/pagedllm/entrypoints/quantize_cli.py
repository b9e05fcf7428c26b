"""``pagedllm quantize`` writes an int8 checkpoint; ``pagedllm quantize-eval`` compares int8
with full precision on a text (perplexity, top-1 accuracy and agreement, weight memory)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.config import (
    QUANT_METHOD,
    EngineArgs,
    QuantConfig,
    architecture_of,
    load_hf_config,
)
from pagedllm.entrypoints.cli import SUBCOMMANDS, add_engine_args, engine_args_from


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
    targets = DynamicQuantConfig.from_config(config).targets(model)
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


def _copy_metadata(src: Path, dst: Path, config: QuantConfig, weight_map: dict[str, str]) -> None:
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


def compare(full: TextScores, int8: TextScores) -> dict[str, float]:
    """The figures of the quantization bar: int8 against full precision on the same text."""
    agree = sum(a == b for a, b in zip(full.top1, int8.top1)) / len(full.top1)
    report = {
        "tokens": float(len(full.targets)),
        "ppl_full": full.perplexity,
        "ppl_int8": int8.perplexity,
        "acc_full": full.accuracy,
        "acc_int8": int8.accuracy,
        "accuracy_retention": int8.accuracy / full.accuracy if full.accuracy else float("nan"),
        "top1_agreement": agree,
    }
    if full.weight_bytes and int8.weight_bytes:
        report["weight_bytes_full"] = float(full.weight_bytes)
        report["weight_bytes_int8"] = float(int8.weight_bytes)
        report["weight_ratio"] = int8.weight_bytes / full.weight_bytes
    return report


def evaluate(args: EngineArgs, ids: list[int], window: int, max_tokens: int | None) -> dict:
    """Score a token stream with the model in full precision and in int8 (args' quant_*)."""
    windows = text_windows(ids, window, max_tokens)
    full = score_text(dataclasses.replace(args, quantization=None), windows)
    int8 = score_text(dataclasses.replace(args, quantization="int8"), windows)
    return compare(full, int8)


def format_report(report: dict[str, float]) -> str:
    lines = [f"tokens scored: {int(report['tokens'])}", "", "| | full precision | int8 |"]
    lines.append("|---|---|---|")
    lines.append(f"| perplexity | {report['ppl_full']:.3f} | {report['ppl_int8']:.3f} |")
    lines.append(f"| top-1 accuracy | {report['acc_full']:.4f} | {report['acc_int8']:.4f} |")
    if "weight_ratio" in report:
        full_mb, int8_mb = report["weight_bytes_full"] / 1e6, report["weight_bytes_int8"] / 1e6
        lines.append(f"| weight memory (MB) | {full_mb:.1f} | {int8_mb:.1f} |")
    lines.append("")
    lines.append(f"accuracy retention (int8 / full): {report['accuracy_retention']:.4f}")
    lines.append(f"top-1 agreement: {report['top1_agreement']:.4f}")
    if "weight_ratio" in report:
        lines.append(f"weight memory ratio (int8 / full): {report['weight_ratio']:.3f}")
    return "\n".join(lines)


def _default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _eval(ns: argparse.Namespace) -> int:
    from pagedllm.engine.tokenizer import load_tokenizer

    args = engine_args_from(ns)
    text = _default_text() if ns.text is None else Path(ns.text).read_text(encoding="utf-8")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    ids = tokenizer.encode(text, add_special_tokens=True)
    report = evaluate(args, ids, ns.window, ns.max_tokens)
    print(json.dumps(report) if ns.json else format_report(report))
    return 0


def _quantize(ns: argparse.Namespace) -> int:
    args = engine_args_from(ns)
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
        "accuracy in full precision and int8, their top-1 agreement and the weight memory.",
    )
    p.add_argument("--text", help="UTF-8 text file (default: Python's pydoc topics)")
    p.add_argument("--window", type=int, default=256, help="tokens per scored window")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    add_engine_args(p)
    p.set_defaults(func=_eval)
    return p
