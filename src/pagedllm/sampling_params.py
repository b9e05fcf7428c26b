"""Sampling parameters for text generation, with vLLM's names and defaults, and the
structured-output constraint they may carry (plain data: the grammar engine that reads it,
pagedllm.structured_output, imports this module, never the other way round)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import IntEnum
from numbers import Integral, Real
from typing import Any

# Largest number of top logprobs a request may ask for (per generated / prompt token).
MAX_LOGPROBS = 20


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request carries (vLLM's names and values).

    CUMULATIVE: after every step, everything generated so far (the default).
    DELTA: after every step, only what that step added: its tokens, text and logprobs (the
    prompt logprobs in the first output only).
    FINAL_ONLY: nothing until the request ends, then all of it, as CUMULATIVE's last output
    (``LLM.generate``: a step then builds no output for the requests still running)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _check_int(name: str, value: object, *, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def _check_float(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    if value != value or not (lo < value if lo_open else lo <= value) or value > hi:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value}.")


# The fields of which exactly one must be set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (see vLLM's StructuredOutputsParams).

    json: a JSON schema (dict or JSON text); regex: a regular expression the whole output
    matches; choice: the output is one of these strings; grammar: an EBNF grammar (GBNF
    style, rule ``root`` first); json_object: any JSON object; structural_tag: xgrammar's
    structural tag (JSON text), used for tool calls.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    disable_additional_properties: bool = False  # objects without extra keys

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", list(self.choice))
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {set_kinds or 'none'}."
            )
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (object or text), "
                f"got {type(self.json).__name__}."
            )
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(
                        f"structured_outputs.choice must hold non-empty strings, got {c!r}."
                    )
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object must be a boolean.")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def schema_dict(self) -> dict[str, Any]:
        """The JSON schema as a dict; ValueError when the text is not JSON."""
        if isinstance(self.json, dict):
            return self.json
        try:
            schema = json.loads(self.json or "")
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from e
        if not isinstance(schema, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON object (a schema).")
        return schema


@dataclass
class SamplingParams:
    """How to sample the tokens of one request (see vLLM's SamplingParams)."""

    n: int = 1  # number of output sequences for the prompt
    presence_penalty: float = 0.0  # > 0 favours new tokens, < 0 repeats
    frequency_penalty: float = 0.0  # scaled by how often a token has appeared
    repetition_penalty: float = 1.0  # multiplicative, on prompt and output tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 or -1 keeps every token
    min_p: float = 0.0  # drop tokens below min_p x the top probability
    seed: int | None = None  # per-request random seed
    stop: str | list[str] | None = None  # strings that end the output
    stop_token_ids: list[int] | None = None  # tokens that end the output
    ignore_eos: bool = False  # keep going past the EOS token
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # tokens to generate before EOS / stop tokens may end
    logprobs: int | None = None  # top logprobs per output token (plus the sampled one)
    prompt_logprobs: int | None = None  # top logprobs per prompt token
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # False: added tokens join the text unspaced
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each output carries
    output_text_buffer_length: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, list | tuple | None):
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}."
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.output_kind, bool) and self.output_kind in set(RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)  # an int off a wire
        else:
            kinds = ", ".join(k.name for k in RequestOutputKind)
            raise ValueError(
                f"output_kind must be a RequestOutputKind ({kinds}), got {self.output_kind!r}."
            )
        self._verify()
        if self.stop and not self.include_stop_str_in_output:
            # Hold back enough characters that a partly generated stop string never streams.
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    def _verify(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), lo_open=True)
        _check_float("temperature", self.temperature, 0.0, float("inf"))
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, minimum=0)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}.")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be a StructuredOutputsParams.")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}.")

    def clone_for_child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n parallel samples: n=1 and a distinct seed."""
        child = SamplingParams(
            **{
                k: getattr(self, k)
                for k in self.__dataclass_fields__
                if k != "output_text_buffer_length"
            }
        )
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child
