#!/usr/bin/env python3
"""Score a demo-model folder on the held-out documents of tools/train_demo_model.py.

Models with different tokenizers can be compared on the same text: besides the
per-token perplexity and top-1 next-token accuracy (which depend on the tokenizer),
the script reports bits per UTF-8 byte, which does not. Every document is scored on
its own as ``<s> text </s>``, in windows of at most --window tokens that overlap by one
token, so that every token after ``<s>`` is predicted exactly once.

The held-out split is the training script's: documents whose SHA-1 is divisible by 20.
It is reported for all held-out documents and separately for the documentation
(pydoc topics and docstrings) and the stdlib source files.

With --pin N the scores of the first N held-out documentation pages are written to
MODEL/eval.json as well (with the Python version whose standard library made the corpus):
tests/engine/test_demo_model.py checks the shipped model against them.

examples:
  python tools/eval_demo_model.py models/pagedllm-demo
  python tools/eval_demo_model.py models/pagedllm-demo --json /tmp/demo-eval.json
  python tools/eval_demo_model.py models/pagedllm-demo --pin 12
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]


def _train_script() -> ModuleType:
    """Import tools/train_demo_model.py for its corpus and split (tools/ is no package),
    once."""
    if "train_demo_model" in sys.modules:
        return sys.modules["train_demo_model"]
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", ROOT / "tools" / "train_demo_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_demo_model"] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Score:
    """Summed next-token statistics over a set of documents."""

    docs: int = 0
    bytes: int = 0
    tokens: int = 0
    nats: float = 0.0
    hits: int = 0

    def add(self, other: Score) -> None:
        """Accumulate another score into this one."""
        self.docs += other.docs
        self.bytes += other.bytes
        self.tokens += other.tokens
        self.nats += other.nats
        self.hits += other.hits

    def summary(self) -> dict[str, float]:
        """Perplexity, top-1 accuracy and bits per byte, with the counts behind them."""
        return asdict(self) | {
            "perplexity": math.exp(self.nats / self.tokens),
            "top1_accuracy": self.hits / self.tokens,
            "bits_per_byte": self.nats / math.log(2) / self.bytes,
        }


def _windows(ids: list[int], window: int) -> list[list[int]]:
    """Split a token list into windows of <= window tokens overlapping by one token."""
    step = window - 1
    return [ids[i : i + window] for i in range(0, max(1, len(ids) - 1), step)]


@torch.no_grad()
def score_document(model: torch.nn.Module, ids: list[int], window: int) -> Score:
    """Summed loss and top-1 hits over every predicted token of one document."""
    score = Score(docs=1)
    for chunk in _windows(ids, window):
        x = torch.tensor([chunk])
        logits = model(input_ids=x).logits[0, :-1].float()
        target = x[0, 1:]
        score.nats += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        score.hits += int((logits.argmax(-1) == target).sum())
        score.tokens += target.numel()
    return score


def evaluate_folder(model_dir: Path, docs: list[str], window: int) -> dict[str, dict]:
    """Scores of one model folder on all documents, the docs part and the source part."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    parts = {"all": Score(), "documentation": Score(), "source": Score()}
    for doc in docs:
        ids = [bos, *tok.encode(doc, add_special_tokens=False).ids, eos]
        score = score_document(model, ids, window)
        score.bytes = len(doc.encode("utf-8"))
        parts["all"].add(score)
        parts["source" if _train_script().is_source(doc) else "documentation"].add(score)
    return {name: s.summary() for name, s in parts.items() if s.docs}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("models", nargs="+", type=Path, help="model folders to score")
    p.add_argument("--window", type=int, default=512, help="tokens per scoring window (512)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1)")
    p.add_argument("--json", type=Path, help="also write the results to this file")
    p.add_argument(
        "--pin",
        type=int,
        metavar="N",
        help="write MODEL/eval.json: these scores and those of the first N held-out "
        "documentation pages",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tdm = _train_script()
    _, heldout = tdm.split_corpus(tdm.build_corpus())
    results = {str(m): evaluate_folder(m, heldout, args.window) for m in args.models}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    if args.pin:
        pages = pinned_pages(heldout, args.pin)
        for m in args.models:
            pinned = evaluate_folder(m, pages, args.window)["documentation"]
            record = {
                "heldout": results[str(m)],
                "pinned": {"python": platform.python_version(), "pages": args.pin, **pinned},
            }
            (m / "eval.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


def pinned_pages(heldout: list[str], n: int) -> list[str]:
    """The first n held-out documentation pages (the tests' fixed sample)."""
    return [doc for doc in heldout if not _train_script().is_source(doc)][:n]


if __name__ == "__main__":
    raise SystemExit(main())
