"""Incremental detokenization that is right for multi-byte UTF-8 and SentencePiece spaces.

Each step decodes a short window of tokens twice, with and without the newest ones, and
emits the difference. The window starts a few tokens back so that a token whose text
depends on its left neighbour (a SentencePiece word start, a byte split across tokens)
is decoded in context. A window whose text ends in U+FFFD is an unfinished UTF-8 character:
nothing is emitted until the next token completes it.

``spaces_between_special_tokens=False`` (vLLM's option) joins added tokens (``<s>``, chat
markers ...) to the text around them without the space a slow tokenizer puts there: the
ordinary tokens between them are decoded run by run and the pieces concatenated.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._added: dict[int, str] = {}  # added token id -> its text, for the unspaced join
        if not spaces_between_special_tokens:
            skipped = set(tokenizer.all_special_ids) if skip_special_tokens else set()
            vocab = tokenizer.get_added_vocab()
            self._added = {i: text for text, i in vocab.items() if i not in skipped}
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # text before this index is already emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if not self._added or not any(i in self._added for i in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            if i not in self._added:
                run.append(i)
                continue
            if run:
                pieces.append(
                    self.tokenizer.decode(run, skip_special_tokens=self.skip_special_tokens)
                )
                run = []
            pieces.append(self._added[i])
        if run:
            pieces.append(self.tokenizer.decode(run, skip_special_tokens=self.skip_special_tokens))
        return "".join(pieces)

    def add(self, token_id: int, final: bool = False) -> str:
        """Append a token; returns the newly completed text (may be empty)."""
        self.ids.append(token_id)
        return self._emit(final)

    def flush(self) -> str:
        """Emit whatever is pending, even an unfinished character (the sequence ended)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
