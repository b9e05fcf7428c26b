"""Incremental detokenization equals a full decode, for multi-byte text and spaces."""

from __future__ import annotations

from transformers import AutoTokenizer

from pagedllm.engine.detokenizer import IncrementalDetokenizer


def test_incremental_equals_full_decode(model_factory):
    tok = AutoTokenizer.from_pretrained(str(model_factory("llama")))
    text = " naïve café — 日本語 ✓ emoji 🙂 The quick  brown\nfox"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # no half characters ever emitted


def test_single_byte_tokens_of_a_multibyte_char_wait_for_completion(model_factory):
    tok = AutoTokenizer.from_pretrained(str(model_factory("llama")))
    ids = tok.encode("🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == "🙂"
    if len(ids) > 1:
        assert deltas[0] == ""
