"""The per-sequence back-off of speculative proposals."""

from __future__ import annotations

from pagedllm.worker.spec_decode.adaptive import AdaptiveGate


def proposing_steps(gate: AdaptiveGate, seq_id: int, steps: int, accepted: int) -> int:
    """Run `steps` steps in which every proposal of seq_id gets `accepted` tokens accepted."""
    proposed = 0
    for _ in range(steps):
        if gate.allow(seq_id):
            proposed += 1
            gate.observe(seq_id, 4, accepted)
    return proposed


def test_good_acceptance_always_proposes() -> None:
    gate = AdaptiveGate()
    assert proposing_steps(gate, 0, 100, accepted=3) == 100


def test_rejected_proposals_back_off_exponentially() -> None:
    gate = AdaptiveGate(max_skip=64)
    # probes at steps 0, 2, 5, 10, 19, 36, 69: pauses 1, 2, 4, 8, 16, 32, then 64
    assert proposing_steps(gate, 0, 100, accepted=0) == 7


def test_recovers_after_a_good_probe_and_sequences_are_independent() -> None:
    gate = AdaptiveGate()
    proposing_steps(gate, 0, 40, accepted=0)
    assert proposing_steps(gate, 1, 40, accepted=4) == 40
    proposing_steps(gate, 0, 70, accepted=4)  # the next probe succeeds: no more pauses
    assert proposing_steps(gate, 0, 20, accepted=4) == 20
    gate.release(0)
    assert gate.allow(0)


def test_no_proposal_is_not_a_rejection() -> None:
    gate = AdaptiveGate()
    for _ in range(10):
        assert gate.allow(0)
        gate.observe(0, 0, 0)
