"""A model folder's tokenizer.json and chat template, without transformers.

:class:`FastTokenizer` reads tokenizer.json with the ``tokenizers`` library (the Rust
tokenizer transformers' fast tokenizers wrap), the special tokens and flags from
tokenizer_config.json / special_tokens_map.json, and renders the chat template with
``jinja2`` in a sandbox, the way transformers does. It offers the part of a
``PreTrainedTokenizerFast``'s interface the engine and server use (encode, decode,
apply_chat_template, the special token ids, len()); :meth:`hf_tokenizer` builds the
transformers object for the optional paths that need one.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

# tokenizer_class values whose behaviour is tokenizer.json's own: the transformers class
# adds nothing on top of the Rust tokenizer (no legacy prefix-space or bos/eos rewriting).
PLAIN_CLASSES = frozenset(
    {
        "PreTrainedTokenizerFast",
        "GPT2Tokenizer",
        "GPT2TokenizerFast",
        "Qwen2Tokenizer",
        "Qwen2TokenizerFast",
        "TokenizersBackend",
    }
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json or the config's."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def is_plain(folder: str | Path) -> bool:
    """Whether FastTokenizer reproduces this folder's transformers tokenizer exactly."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").exists():
        return False
    config = _read_json(folder / "tokenizer_config.json")
    # add_bos_token / add_eos_token make transformers rewrite the post-processor, in ways
    # that differ between its versions: such folders go through transformers.
    rewrites = "add_bos_token" in config or "add_eos_token" in config
    return (
        config.get("tokenizer_class", "PreTrainedTokenizerFast") in PLAIN_CLASSES and not rewrites
    )


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """A chat template compiled in jinja2's sandbox, with transformers' extras."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], undefined=jinja2.Undefined
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class FastTokenizer:
    """tokenizer.json + chat template of a model folder (see the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.name_or_path = str(folder)
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        for name in _SPECIAL_NAMES:
            text = _token_text(config.get(name)) or _token_text(special_map.get(name))
            setattr(self, name, text)
        self.chat_template = read_chat_template(folder, config)
        # transformers ignores clean_up_tokenization_spaces for BPE models (it corrupts them)
        clean = bool(config.get("clean_up_tokenization_spaces"))
        bpe_too = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
        is_bpe = type(self._tok.model).__name__ == "BPE"
        self.clean_up_tokenization_spaces = clean and (bpe_too or not is_bpe)
        self.model_max_length = int(config.get("model_max_length") or 10**30)
        self._hf_from_object = False

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        name_or_path: str,
        special_tokens: dict[str, str | None],
        chat_template: str | None,
    ) -> FastTokenizer:
        """A tokenizer built in memory (a GGUF file's vocabulary), not read from a folder."""
        self = cls.__new__(cls)
        self.name_or_path = name_or_path
        self._tok = tokenizer
        for name in _SPECIAL_NAMES:
            setattr(self, name, special_tokens.get(name))
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = False
        self.model_max_length = 10**30
        self._hf_from_object = True
        return self

    # ---------------------------------------------------------------- token ids

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def all_special_tokens(self) -> list[str]:
        named = [getattr(self, n) for n in _SPECIAL_NAMES]
        added = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        return list(dict.fromkeys(t for t in [*named, *added] if t is not None))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._tok.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (as transformers counts it)."""
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    # ------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def batch_decode(self, batch: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    # ----------------------------------------------------------- chat template

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the conversation like transformers' apply_chat_template (one conversation)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("the tokenizer has no chat template.")
        specials = {name: getattr(self, name) for name in _SPECIAL_NAMES}
        text = _compile_template(template).render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **(specials | kwargs),
        )
        if continue_final_message:
            final = conversation[-1]["content"]
            if isinstance(final, str) and final.strip() in text:
                text = text[: text.rindex(final.strip()) + len(final.strip())]
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -------------------------------------------------------------- transformers

    def hf_tokenizer(self) -> Any:
        """transformers' tokenizer for the same vocabulary (imports transformers)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if self._hf_from_object:
            specials = {n: getattr(self, n) for n in _SPECIAL_NAMES if getattr(self, n)}
            return PreTrainedTokenizerFast(
                tokenizer_object=self._tok, chat_template=self.chat_template, **specials
            )
        return AutoTokenizer.from_pretrained(self.name_or_path, local_files_only=True)


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
