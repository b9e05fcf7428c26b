"""StructuredOutputsParams: what a request constrains its output to, with vLLM's names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The fields of which exactly one must be set.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


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
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(KINDS)}; got {set_kinds or 'none'}."
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
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

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

    def cache_key(self) -> str:
        """A stable text naming this constraint, for the compiled-grammar cache."""
        value = getattr(self, self.kind)
        body = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        flags = f"{int(self.disable_any_whitespace)}{int(self.disable_additional_properties)}"
        return f"{self.kind}:{flags}:{body}"
