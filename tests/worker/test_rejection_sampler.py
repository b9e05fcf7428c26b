"""The accept / reject step against a direct per-row reference, and its distribution."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.sequence import Sequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.spec_decode.rejection_sampler import RejectionSampler, rejection_sample


def reference_row(p, q, drafts, greedy_logits, greedy, u, noise):
    """Speculative sampling for one sequence, written out step by step."""
    out = []
    for j, d in enumerate(drafts):
        if greedy:
            best = int(greedy_logits[j].argmax())
            if d != best:
                return out + [best]
        else:
            qd = 1.0 if q is None else float(q[j, d])
            if not float(u[j]) * qd < float(p[j, d]):
                point = torch.zeros_like(p[j])
                point[d] = 1.0
                residual = (p[j] - (point if q is None else q[j])).clamp_min(0.0)
                return out + [int((residual / noise[j]).argmax())]
        out.append(d)
    j = len(drafts)
    last = greedy_logits[j].argmax() if greedy else (p[j] / noise[j]).argmax()
    return out + [int(last)]


@pytest.mark.parametrize("with_q", [False, True])
def test_matches_direct_reference(with_q: bool) -> None:
    g = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 3, 6
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2
    probs = logits.softmax(-1)
    q = torch.randn(batch, k, vocab, generator=g).softmax(-1) if with_q else None
    # drafts: often the target's argmax, so that runs of acceptances happen
    drafts = torch.where(
        torch.rand(batch, k, generator=g) < 0.6,
        logits[:, :k].argmax(-1),
        torch.randint(0, vocab, (batch, k), generator=g),
    )
    num_drafts = torch.randint(0, k + 1, (batch,), generator=g)
    greedy = torch.rand(batch, generator=g) < 0.3
    u = torch.rand(batch, k, generator=g)
    noise = torch.empty(batch, k + 1, vocab).exponential_(generator=g)
    tokens, accepted = rejection_sample(logits, probs, drafts, num_drafts, q, greedy, u, noise)
    for b in range(batch):
        n = int(num_drafts[b])
        expected = reference_row(
            probs[b],
            None if q is None else q[b],
            drafts[b, :n].tolist(),
            logits[b],
            bool(greedy[b]),
            u[b],
            noise[b],
        )
        assert tokens[b, : len(expected)].tolist() == expected
        assert (tokens[b, len(expected) :] == -1).all()
        assert int(accepted[b]) == len(expected) - 1
    assert int(accepted.sum()) > 0 and int((accepted < num_drafts).sum()) > 0


@pytest.mark.parametrize("with_q", [False, True])
def test_keeps_target_distribution(with_q: bool) -> None:
    """Sampled many times, the first token follows p_0 and, after an accepted first draft,
    the second follows p_1: exactly the target's distribution (here a context-free one)."""
    g = torch.Generator().manual_seed(1)
    n, k, vocab = 200_000, 2, 5
    p_rows = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.3, 0.3, 0.3, 0.05], [0.2] * 5])
    logits = p_rows.log()[None].expand(n, -1, -1)
    probs = p_rows[None].expand(n, -1, -1)
    if with_q:
        q_rows = torch.tensor([[0.1, 0.1, 0.6, 0.1, 0.1], [0.4, 0.1, 0.1, 0.1, 0.3]])
        q = q_rows[None].expand(n, -1, -1)
        drafts = torch.multinomial(q_rows, n, replacement=True, generator=g).T  # [n, k]
    else:
        q = None
        drafts = torch.tensor([[2, 1]]).expand(n, -1)  # a fixed guess, right or wrong
    u = torch.rand(n, k, generator=g)
    noise = torch.empty(n, k + 1, vocab).exponential_(generator=g)
    greedy = torch.zeros(n, dtype=torch.bool)
    tokens, accepted = rejection_sample(
        logits, probs, drafts, torch.full((n,), k), q, greedy, u, noise
    )
    first = torch.bincount(tokens[:, 0], minlength=vocab).float() / n
    assert torch.allclose(first, p_rows[0], atol=0.006), first
    after_first = tokens[accepted >= 1, 1]
    second = torch.bincount(after_first, minlength=vocab).float() / after_first.numel()
    assert after_first.numel() > 10_000
    assert torch.allclose(second, p_rows[1], atol=0.01), second
    after_both = tokens[accepted == 2, 2]
    third = torch.bincount(after_both, minlength=vocab).float() / after_both.numel()
    assert torch.allclose(third, p_rows[2], atol=0.02), third


def _seq(seq_id: int, params: SamplingParams) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, [3, 4, 5], params, eos_token_id=None)


def test_sampler_greedy_rows_and_variable_drafts() -> None:
    vocab = 7
    logits = torch.full((6, vocab), -5.0)
    # seq 0: drafts [1, 2]; target argmax 1, 4, 6 -> accepts 1, then emits 4
    # seq 1: no drafts; argmax 3 -> emits 3
    # seq 2: drafts [5]; argmax 5, 0 -> accepts 5, bonus 0
    for row, tok in enumerate([1, 4, 6, 3, 5, 0]):
        logits[row, tok] = 5.0
    seqs = [_seq(i, SamplingParams(temperature=0.0)) for i in range(3)]
    sampler = RejectionSampler(torch.device("cpu"), lambda s: torch.Generator())
    out = sampler(logits, seqs, [[1, 2], [], [5]])
    assert out.token_ids == [[1, 4], [3], [5, 0]]
    assert out.num_accepted == [1, 0, 1]


def test_sampler_seeded_rows_repeat() -> None:
    vocab = 11
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    drafts = [[int(logits[0].argmax()), int(logits[1].argmax()), 2]]

    def run() -> list[list[int]]:
        gens: dict[int, torch.Generator] = {}

        def gen_for(seq: Sequence) -> torch.Generator:
            return gens.setdefault(seq.seq_id, torch.Generator().manual_seed(1234))

        sampler = RejectionSampler(torch.device("cpu"), gen_for)
        seq = _seq(0, SamplingParams(temperature=0.8, seed=1234))
        return [sampler(logits, [seq], drafts).token_ids[0] for _ in range(5)]

    assert run() == run()
