"""Mask computation time per token of three grammar engines for one JSON schema.

Walks each engine through the tokens of a valid document (its canonical tokenization),
computing the full-vocabulary token mask before every token, as an engine step would. Run:

    nice -n 10 python benchmarks/grammar_engines.py [--tokenizer PATH ...]

Without --tokenizer it measures the bundled demo model's tokenizer (byte-level BPE, 4096)
and a 32000-token byte-level BPE built by common.build_stdlib_tokenizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import build_stdlib_tokenizer, machine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "tags"],
}
DOCUMENT = {
    "name": "Ada Lovelace — café ✓",
    "age": 36,
    "role": "admin",
    "tags": ["math", "engines", "notes"],
    "address": {"city": "London", "zip": "W1"},
    "score": 9.75,
}


def _walk(fill, accept, tokens: list[int]) -> list[float]:
    """Seconds per mask fill while accepting tokens one by one."""
    times = []
    for tok in tokens:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        if not accept(tok):
            raise RuntimeError(f"token {tok} rejected")
    return times


def bench_xgrammar(hf_tok, vocab: int, text: str, tokens: list[int]) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    t2 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = _walk(lambda: matcher.fill_next_token_bitmask(mask, 0), matcher.accept_token, tokens)
    return dict(setup=t1 - t0, compile=t2 - t1, times=times)


def bench_llguidance(hf_tok, vocab: int, text: str, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = _walk(
        lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0),
        matcher.consume_token,
        tokens,
    )
    return dict(setup=t1 - t0, compile=t2 - t1, times=times)


def bench_outlines(hf_tok, vocab: int, text: str, tokens: list[int]) -> dict:
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    # outlines-core wants each token's text; a byte-level BPE token is its byte-to-unicode
    # string, which this decodes back to bytes -> str (invalid UTF-8 pieces are dropped).
    decoder = {v: k for k, v in _bytes_to_unicode().items()}
    eos = hf_tok.eos_token_id
    table: dict[str, list[int]] = {}
    for piece, idx in hf_tok.get_vocab().items():
        if idx == eos or idx >= vocab:
            continue
        try:
            text_piece = bytes(decoder[c] for c in piece).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        table.setdefault(text_piece, []).append(idx)
    vocabulary = Vocabulary(eos, table)
    t1 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index = Index(regex, vocabulary)
    guide = Guide(index)
    t2 = time.perf_counter()
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def fill() -> None:
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    def accept(tok: int) -> bool:
        guide.advance(tok)
        return True

    times = _walk(fill, accept, tokens)
    return dict(setup=t1 - t0, compile=t2 - t1, times=times)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


ENGINES = {
    "xgrammar": bench_xgrammar,
    "llguidance": bench_llguidance,
    "outlines-core": bench_outlines,
}


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", action="append")
    args = parser.parse_args()
    paths = args.tokenizer or [
        "models/pagedllm-demo",
        str(build_stdlib_tokenizer(Path("bench_out/tokenizer-32k"))),
    ]
    print(machine())
    text = json.dumps(DOCUMENT, separators=(",", ":"), ensure_ascii=False)
    print("| tokenizer | engine | setup s | compile s | mask us/token (median) | p90 | max |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        hf_tok = AutoTokenizer.from_pretrained(path)
        vocab = len(hf_tok)
        tokens = hf_tok.encode(text, add_special_tokens=False)
        for name, fn in ENGINES.items():
            try:
                r = fn(hf_tok, vocab, text, tokens)
            except Exception as e:  # noqa: BLE001 - report the engine that fails
                print(f"| {Path(path).name} ({vocab}) | {name} | failed: {e} |")
                continue
            t = sorted(r["times"])
            med = statistics.median(t) * 1e6
            p90 = t[int(0.9 * (len(t) - 1))] * 1e6
            print(
                f"| {Path(path).name} ({vocab}) | {name} | {r['setup']:.2f} | "
                f"{r['compile']:.3f} | {med:.0f} | {p90:.0f} | {t[-1] * 1e6:.0f} |"
            )


if __name__ == "__main__":
    main()
