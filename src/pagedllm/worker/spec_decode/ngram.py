"""Prompt-lookup (n-gram) proposer: guess that the text continues as it did after the last
earlier occurrence of its own suffix. Costs no model; pays off when the output copies the
input (code edits, extraction, summaries that quote)."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Finds the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens)
    that occurred before in the sequence and proposes the k tokens that followed its latest
    occurrence. The latest occurrence is used because a copy in progress continues there."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})."
            )
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """k draft tokens after the longest suffix match, none without a match."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        num = tokens.shape[0]
        if k <= 0 or num < self.min_n + 1:
            return []
        # Candidate match ends: earlier positions holding the last token. A match may overlap
        # the suffix (a run "a a a" predicts "a") but ends before the last token, so that at
        # least one token follows it. One vectorised pass per extra n-gram length.
        ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])
        if ends.size == 0:
            return []
        length = np.ones(ends.shape[0], dtype=np.int64)
        alive = np.ones(ends.shape[0], dtype=bool)
        for j in range(1, min(self.max_n, num - 1)):
            prev = ends - j
            alive &= prev >= 0
            alive &= tokens[np.maximum(prev, 0)] == tokens[num - 1 - j]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return []
        start = int(ends[np.flatnonzero(length == best)[-1]]) + 1
        proposal = tokens[start : start + k].tolist()
        # A match close to the end runs out of history; the text is assumed to go on repeating
        # with the match's period (a loop "x y x y" predicts "x y x y ..." for any k).
        period = num - start
        while len(proposal) < k:
            proposal.append(proposal[len(proposal) - period])
        return proposal
