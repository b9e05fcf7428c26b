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
    assert len(ids) > 1  # the premise: the character is split over byte tokens
    assert "".join(deltas) == "🙂"
    assert all(d == "" for d in deltas[:-1])  # nothing until the last byte completes it


class _SpacedAddedTokens:
    """A real tokenizer whose decode spaces out added tokens, as a slow (Python)
    Hugging Face tokenizer does by default."""

    def __init__(self, tok):
        self.tok = tok
        self.all_special_ids = tok.all_special_ids
        self.added = {i: t for t, i in tok.get_added_vocab().items()}

    def get_added_vocab(self):
        return self.tok.get_added_vocab()

    def decode(self, ids, skip_special_tokens=False):
        parts, run = [], []
        for i in ids:
            if i in self.added:
                if run:
                    parts.append(self.tok.decode(run))
                run = []
                if not (skip_special_tokens and i in self.all_special_ids):
                    parts.append(self.added[i])
            else:
                run.append(i)
        if run:
            parts.append(self.tok.decode(run))
        return " ".join(parts)


def _detokenize(tok, ids, spaces: bool) -> str:
    detok = IncrementalDetokenizer(tok, [], False, spaces_between_special_tokens=spaces)
    return "".join([detok.add(t) for t in ids] + [detok.flush()])


def test_spaces_between_special_tokens(model_factory):
    real = AutoTokenizer.from_pretrained(str(model_factory("llama")))
    tok = _SpacedAddedTokens(real)
    eos = real.eos_token_id
    ids = real.encode("hi there", add_special_tokens=False) + [eos]
    ids += real.encode("again", add_special_tokens=False)
    eos_text = real.convert_ids_to_tokens(eos)
    spaced, joined = _detokenize(tok, ids, True), _detokenize(tok, ids, False)
    assert f" {eos_text} " in spaced  # the tokenizer's own spacing is kept by default
    assert joined == spaced.replace(f" {eos_text} ", eos_text)  # the same text, unspaced
    assert f" {eos_text}" not in joined and f"{eos_text}again" in joined
