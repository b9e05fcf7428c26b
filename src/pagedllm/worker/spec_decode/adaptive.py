"""When to stop proposing: a per-sequence back-off on poor acceptance.

A verify step costs more than a plain decode step (1 + k query tokens instead of 1), so drafts
that are mostly rejected make a sequence slower. Each sequence keeps a moving average of the
tokens accepted per proposal; when it falls below ``min_accepted`` the sequence stops
proposing for a number of steps that doubles with every failed probe (up to ``max_skip``),
and a probe that is accepted resets it. A sequence whose text starts copying again (a quote,
a code block) is found again within ``max_skip`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _SeqState:
    mean_accepted: float  # moving average of accepted drafts per proposal
    skip: int = 0  # steps left without proposing
    backoff: int = 1  # the next skip length


class AdaptiveGate:
    def __init__(
        self, min_accepted: float = 0.5, max_skip: int = 64, smoothing: float = 0.5
    ) -> None:
        self.min_accepted = min_accepted
        self.max_skip = max_skip
        self.smoothing = smoothing  # weight of the newest proposal in the average
        self._states: dict[int, _SeqState] = {}

    def allow(self, seq_id: int) -> bool:
        """Whether seq_id may propose this step (counts a skipped step)."""
        state = self._states.get(seq_id)
        if state is None or state.skip == 0:
            return True
        state.skip -= 1
        return False

    def observe(self, seq_id: int, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        state = self._states.get(seq_id)
        if state is None:
            # A first proposal counts fully, so a sequence that never matches stops at once.
            state = self._states[seq_id] = _SeqState(float(num_accepted))
        else:
            a = self.smoothing
            state.mean_accepted = a * num_accepted + (1 - a) * state.mean_accepted
        if state.mean_accepted >= self.min_accepted:
            state.backoff = 1
            return
        state.skip = state.backoff
        state.backoff = min(2 * state.backoff, self.max_skip)
        # after the pause the probe is judged on its own, not on the old average
        state.mean_accepted = self.min_accepted

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
