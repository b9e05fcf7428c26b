"""Prompt-lookup (n-gram) proposer: guess that the text continues as it did after the last
earlier occurrence of its own suffix. Costs no model; pays off when the output copies the
input (code edits, extraction, summaries that quote)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Finds the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens)
    that occurred before in the sequence and proposes the k tokens that followed its latest
    occurrence. The latest occurrence is used because a copy in progress continues there."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min ({min_n}) <= prompt_lookup_max ({max_n})")
        self.k = k
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to k draft tokens (fewer near the end of a match, none without a match)."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        num = tokens.shape[0]
        if k <= 0 or num < self.min_n + 1:
            return []
        # Matches may overlap the suffix (a run "a a a" predicts "a") but must end before the
        # last token, so that at least one token follows them.
        history = tokens[: num - 1]
        max_n = min(self.max_n, num - 1)
        best_start = -1
        for n in range(max_n, self.min_n - 1, -1):
            suffix = tokens[num - n :]
            if history.shape[0] < n:
                continue
            windows = sliding_window_view(history, n)  # [num - n, n], a view
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                best_start = int(hits[-1]) + n  # the token after the latest match
                break
        if best_start < 0:
            return []
        return tokens[best_start : best_start + k].tolist()
