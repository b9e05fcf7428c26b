"""Reasoning parsers: split a model's ``<think>...</think>`` text from its answer, chosen by
``--reasoning-parser`` (vLLM's names, ``deepseek_r1`` and ``qwen3``).

The reasoning goes to ``reasoning_content``, the rest to ``content`` (and to the tool parser).
An output constraint (response_format, tools) applies after the reasoning: the grammar is
the reasoning block followed by the constraint (``constrain_after``), so a model thinks in
free text and then answers in the schema. ``thinking_token_budget`` bounds the reasoning
block in tokens; once spent, the grammar closes it.

* ``deepseek_r1``: the chat template opens the block (``<think>\\n`` ends the prompt), so the
  output is reasoning up to ``</think>``; a ``<think>`` the model writes itself is dropped.
* ``qwen3``: the output is reasoning only when it starts with ``<think>`` or the prompt ends
  with it; with ``enable_thinking: false`` Qwen3's template writes an empty block into the
  prompt, and the output is all content.
Reasoning cut short by max_tokens (no ``</think>``) is all reasoning and no content.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.structural import Format

START, END = "<think>", "</think>"
# The blank line templates put between the block and the answer (kept out of content).
GAP_PATTERN = r"\n{0,2}"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str  # reasoning text so far
    content: str | None  # answer text so far; None while the reasoning lasts

    @property
    def ended(self) -> bool:
        return self.content is not None


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of text that could be the start of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits one choice's output; ``prompt`` is the rendered prompt it continues."""

    opens_in_template = False  # the template always opens the block

    def __init__(self, prompt: str) -> None:
        tail = prompt.rstrip()
        self.disabled = tail.endswith(END)  # an empty block in the prompt: no thinking
        self.in_prompt = tail.endswith(START) or (self.opens_in_template and not self.disabled)

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        """Reasoning and content of the output so far (finished: no more comes). While
        streaming, a partial ``<think>`` / ``</think>`` is held back."""
        if self.disabled:
            return ReasoningSplit("", text)
        body = text
        stripped = text.lstrip()
        if not finished and START.startswith(stripped):
            return ReasoningSplit("", None)  # nothing yet, or maybe "<think>" coming
        if stripped.startswith(START):
            body = stripped[len(START) :]
        elif not self.in_prompt:
            return ReasoningSplit("", text)
        end = body.find(END)
        if end < 0:
            keep = len(body) if finished else len(body) - _partial_marker(body, END)
            return ReasoningSplit(body[:keep].lstrip("\n"), None)
        return ReasoningSplit(body[:end].lstrip("\n"), body[end + len(END) :].lstrip("\n"))

    def reasoning_format(self, budget: int | None) -> Format | None:
        """The grammar of the reasoning block (None: the output has none)."""
        if self.disabled:
            return None
        thought: Format = {"type": "any_text"}
        if budget is not None:
            thought["max_tokens"] = budget
        if self.in_prompt:
            return {"type": "tag", "begin": "", "content": thought, "end": END}
        # The model opens the block itself, or answers at once.
        return {
            "type": "optional",
            "content": {"type": "tag", "begin": START, "content": thought, "end": END},
        }

    def constrain_after(self, constraint: Format | None, budget: int | None) -> Format | None:
        """The grammar of a whole output: reasoning, then the constraint (None: free text
        whose reasoning is unbounded)."""
        block = self.reasoning_format(budget)
        if block is None or (constraint is None and budget is None):
            return constraint
        rest = constraint if constraint is not None else {"type": "any_text"}
        gap = {"type": "regex", "pattern": GAP_PATTERN}
        return {"type": "sequence", "elements": [block, gap, rest]}


class DeepSeekR1ReasoningParser(ReasoningParser):
    opens_in_template = True


class Qwen3ReasoningParser(ReasoningParser):
    opens_in_template = False


_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in _PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(reasoning_parser_names())}, got {name!r}."
        )
    return _PARSERS[name]
