"""The grammar engine behind structured outputs: xgrammar.

Why xgrammar (benchmarks/grammar_engines.py has the figures): it precomputes, per grammar
state, which tokens are always / never allowed, so a mask costs a few microseconds per token
on this CPU for a 32000-token vocabulary; it reads Hugging Face byte-level BPE vocabularies
directly (tokens that split a UTF-8 character work); it covers JSON schema, regex, EBNF and
structural tags (tool calls) in one compiler with a cache; and its matchers roll back, which
recompute and speculative decoding need.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from pagedllm.sampling_params import StructuredOutputsParams

# JSON whitespace allowed between two tokens of a document: free whitespace lets a weak
# model loop on spaces and newlines forever, and 16 still fits indented output.
MAX_JSON_WHITESPACE = 16

_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[time] file.cc:NN: " of C++ errors


def _error_text(e: Exception) -> str:
    return _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))


def check_json_schema(schema: dict[str, Any] | bool) -> None:
    """ValueError naming the problem when schema is not a valid JSON schema (draft 2020-12)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "the root"
        raise ValueError(
            f"structured_outputs.json is not a valid JSON schema at {where}: {e.message}."
        ) from e


# A character a JSON string holds unescaped, as a regex: printable ASCII but '"' and '\\', or
# one of the code point ranges whose UTF-8 forms share their lead bytes' rules. xgrammar
# (0.2.9) turns a range that crosses those lines (a negated class included) into bytes that
# admit overlong and surrogate forms: a random model sampled E0 90 90, which decodes to three
# U+FFFD, and its 12-character name came out 14 long.
_UTF8_LINES = ((0x80, 0x7FF), (0x800, 0xFFF), (0x1000, 0xD7FF), (0xE000, 0xFFFF),
               (0x10000, 0x3FFFF), (0x40000, 0xFFFFF), (0x100000, 0x10FFFF))  # fmt: skip
JSON_STRING_CHAR = (
    "(?:[ !#-\\[\\]-\\u007f]|" + "|".join(f"[{chr(lo)}-{chr(hi)}]" for lo, hi in _UTF8_LINES) + ")"
)


def bounded_strings_as_patterns(node: Any) -> Any:
    """A copy of a schema whose length-bounded strings are written as patterns.

    xgrammar (0.2.9) turns minLength / maxLength into a character class that admits raw
    control characters, which JSON forbids in strings; the same bounds as a pattern of
    legal characters (JSON_STRING_CHAR) produce only valid documents (escapes aside, which
    the bound counts ambiguously anyway).
    """
    if isinstance(node, list):
        return [bounded_strings_as_patterns(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded_strings_as_patterns(v) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format"} & out.keys():
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{JSON_STRING_CHAR}{{{lo},{'' if hi is None else int(hi)}}}$"
    return out


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose root is exactly one of the strings (JSON escapes are EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammar:
    """One sequence's matcher: which tokens may come next, and the tokens accepted so far."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        ok = self._matcher.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        return self._matcher


class XGrammarBackend:
    """Compiles constraints for one tokenizer (with a cache) and makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        # xgrammar reads a transformers tokenizer (its vocabulary and how it encodes bytes);
        # the engine's own tokenizer gives one for the same folder on first constrained use
        hf = tokenizer.hf_tokenizer() if hasattr(tokenizer, "hf_tokenizer") else tokenizer
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar; ValueError naming the field for a bad constraint."""
        kind = params.kind
        if kind == "json":
            schema = params.schema_dict()
            check_json_schema(schema)
        try:
            return self._compile(params)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_error_text(e)}") from e

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        c = self.compiler
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = params.schema_dict() if kind == "json" else {"type": "object"}
            schema = bounded_strings_as_patterns(schema)
            if params.disable_any_whitespace:
                return c.compile_json_schema(json.dumps(schema), any_whitespace=False)
            return c.compile_json_schema(
                json.dumps(schema),
                any_whitespace=True,
                max_whitespace_cnt=MAX_JSON_WHITESPACE,
            )
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(params.choice or []))
        if kind == "grammar":
            return c.compile_grammar(params.grammar)
        return c.compile_structural_tag(params.structural_tag)

    def matcher(self, compiled: xgr.CompiledGrammar) -> Grammar:
        return Grammar(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in the given rows (in place).

    logits [num_rows, vocab] float32; bitmask [num_rows, words], bit j of word w = token
    32 * w + j allowed. Rows not listed are left alone (unconstrained sequences).
    """
    if logits.device != bitmask.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    # On the CPU name the C++ kernel: "auto" measured several times slower here.
    backend = "cpu" if logits.device.type == "cpu" else "auto"
    xgr.apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=logits.shape[-1], indices=rows, backend=backend
    )
