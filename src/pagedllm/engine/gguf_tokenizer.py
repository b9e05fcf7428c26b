"""The tokenizer a GGUF file describes, built as a ``tokenizers.Tokenizer``.

A GGUF file has no tokenizer.json: it stores the vocabulary under ``tokenizer.ggml.*``
(tokens, their types and scores, BPE merges, the special token ids, whether to add BOS/EOS)
and the chat template under ``tokenizer.chat_template``. Two vocabularies are rebuilt here:

- ``gpt2``: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet, the merges are
  stored, and ``tokenizer.ggml.pre`` names the pre-tokenizer split the merges were learned on.
- ``llama``: SentencePiece-style BPE over ``▁``-marked pieces with byte fallback (``<0x41>``).
  Files often store no merges; they follow from the vocabulary: a pair merges when both
  halves and their concatenation are tokens, earlier the higher the concatenation's score.

Control tokens become special added tokens, user-defined ones plain added tokens (both are
matched whole in the text), as transformers' GGUF tokenizer does; the result is wrapped in a
:class:`~pagedllm.engine.fast_tokenizer.FastTokenizer` like a folder's tokenizer.json.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

from pagedllm.engine.fast_tokenizer import FastTokenizer
from pagedllm.gguf_metadata import GGUFFile, open_gguf

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType values
_GPT2_SPLIT = None  # ByteLevel's own regex (GPT-2's)
# tokenizer.ggml.pre -> the split regex of its pre-tokenizer (where it is not GPT-2's)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "gpt-2": _GPT2_SPLIT,
    "default": _GPT2_SPLIT,
    "smollm": _GPT2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's printable spelling of each byte value (index = byte)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled = {b: chr(b) for b in printable}
    extra = iter(range(256, 512))
    return tuple(spelled.get(b) or chr(next(extra)) for b in range(256))


def load_gguf_tokenizer(path: str | Path) -> FastTokenizer:
    """The tokenizer and chat template stored in a GGUF file."""
    file = open_gguf(path)
    kind = file.value("tokenizer.ggml.model")
    tokens: list[str] = file.value("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"GGUF file {file.path.name!r} stores no tokenizer vocabulary.")
    types: list[int] = file.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(file, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(file, tokens)
    else:
        raise ValueError(
            f"GGUF file {file.path.name!r} has a {kind!r} tokenizer; pagedllm builds 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece BPE) ones: pass --tokenizer a folder."
        )
    specials = {
        name: tokens[i] if (i := file.value(key)) is not None and 0 <= i < len(tokens) else None
        for name, key in _SPECIAL_IDS.items()
    }
    _add_tokens(tok, tokens, types, specials, byte_level=kind == "gpt2")
    add_bos = bool(file.value("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(file.value("tokenizer.ggml.add_eos_token", False))
    _post_processor(tok, specials, add_bos, add_eos)
    template = file.value("tokenizer.chat_template")
    return FastTokenizer.from_tokenizer(tok, str(file.path), specials, template)


def _merges(file: GGUFFile) -> list[tuple[str, str]] | None:
    stored = file.value("tokenizer.ggml.merges")
    if not stored:
        return None
    return [tuple(m.split(" ", 1)) for m in stored]  # type: ignore[misc]


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    alphabet = _byte_alphabet()
    letters = set(alphabet)
    # A token outside the byte alphabet (a mislabelled added token) is spelled byte by byte.
    spelled = [
        t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens
    ]
    merges = _merges(file)
    if merges is None:
        raise ValueError(f"GGUF file {file.path.name!r}: a 'gpt2' vocabulary without merges.")
    vocab = {t: i for i, t in enumerate(spelled)}
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    pre = file.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        logger.warning("GGUF pre-tokenizer %r is not known here; splitting as GPT-2 does", pre)
    split = PRE_TOKENIZER_SPLITS.get(pre, _GPT2_SPLIT)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, the splits of higher-scoring tokens first (then longer left halves first)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-score, -len(left), -len(right), ids[piece], left, right))
    found.sort()  # ties (same score and lengths) keep the vocabulary's order
    return [(left, right) for *_, left, right in found]


def _sentencepiece_bpe(file: GGUFFile, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    merges = _merges(file)
    if merges is None:
        scores = file.value("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = sentencepiece_merges(tokens, scores)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = file.value("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix = bool(file.value("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_tokens(
    tok: Any,
    tokens: list[str],
    types: list[int],
    specials: dict[str, str | None],
    byte_level: bool,
) -> None:
    """Control tokens and the named specials as special added tokens, user-defined tokens as
    plain ones: each is matched whole in the text instead of being cut into pieces."""
    from tokenizers import AddedToken

    letters = set(_byte_alphabet()) if byte_level else None
    control = [t for t, k in zip(tokens, types, strict=False) if k == _CONTROL]
    # in a byte-level vocabulary a "control" token outside the alphabet is a mislabel
    control = [t for t in control if letters is None or set(t) <= letters]
    named = [t for t in specials.values() if t is not None]
    special = list(dict.fromkeys([*control, *named]))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, k in zip(tokens, types, strict=False) if k == _USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _post_processor(
    tok: Any, specials: dict[str, str | None], add_bos: bool, add_eos: bool
) -> None:
    """BOS/EOS around every encoded text, as the file's add_bos/add_eos flags say."""
    from tokenizers import processors

    bos, eos = specials["bos_token"], specials["eos_token"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        return
    first = [f"{bos}:0"] if add_bos else []
    last = [f"{eos}:0"] if add_eos else []
    pair_b = ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(
        single=[*first, "$A:0", *last],
        pair=[*first, "$A:0", *last, *pair_b],
        special_tokens=[(t, tok.token_to_id(t)) for t in dict.fromkeys(used)],
    )
