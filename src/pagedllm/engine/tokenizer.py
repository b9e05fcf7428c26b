"""Tokenizer loading and EOS ids of the model.

A GGUF file's vocabulary is built into the same FastTokenizer (engine/gguf_tokenizer.py). A
folder with a tokenizer.json that transformers uses as it is loads as a FastTokenizer
(``tokenizers`` + ``jinja2``: no transformers import, which costs seconds at start-up);
other folders (slow sentencepiece tokenizers, classes that rewrite the post-processor) go
through transformers' AutoTokenizer when it is installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str) -> Any:
    from pagedllm.engine.fast_tokenizer import FastTokenizer, is_plain
    from pagedllm.gguf_metadata import is_gguf

    try:
        if is_gguf(path):
            from pagedllm.engine.gguf_tokenizer import load_gguf_tokenizer

            return load_gguf_tokenizer(path)
        if is_plain(path):
            return FastTokenizer(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except ImportError as e:
        raise ValueError(
            f"the tokenizer in {path!r} needs transformers ({e}); install it, or pass "
            "tokenizer=... a folder with a tokenizer.json."
        ) from e
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(
            f"cannot load a tokenizer from {path!r} ({e}); pass tokenizer=... or use "
            "skip_tokenizer_init with token-id prompts."
        ) from e


def stop_token_ids_from_generation_config(model: str) -> set[int]:
    """EOS ids that generation_config.json lists, which stop generation like EOS does (for a
    GGUF file: its end-of-turn and end-of-message tokens, llama.cpp's other stop tokens)."""
    from pagedllm.gguf_metadata import is_gguf, open_gguf

    if is_gguf(model):
        file = open_gguf(model)
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = (file.value(f"tokenizer.ggml.{key}") for key in keys)
        return {int(i) for i in ids if i is not None}
    path = Path(model) / "generation_config.json"
    if not path.exists():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of text; ValueError for a string that is not valid Unicode (a lone surrogate,
    which JSON's \\ud800 escapes allow) instead of the tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"prompt is not valid UTF-8 text: {e.reason} at character {e.start}."
        ) from e
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
