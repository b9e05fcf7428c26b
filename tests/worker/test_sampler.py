"""The sampler's filters and penalties against direct references; sampled frequencies."""

from __future__ import annotations

import pytest
import torch
from helpers.sequences import make_seq

from pagedllm import SamplingParams
from pagedllm.worker.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p_min_p(logits.clone(), [SamplingParams(top_k=2)])
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_k_top_p_min_p(probs.log(), [SamplingParams(top_p=0.75)])
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    out = apply_top_k_top_p_min_p(probs.log(), [SamplingParams(top_p=0.01)])
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_min_p_drops_tokens_below_share_of_top():
    probs = torch.tensor([[0.6, 0.3, 0.07, 0.03]])
    out = apply_top_k_top_p_min_p(probs.log(), [SamplingParams(min_p=0.1)])
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def test_penalties_match_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seq = make_seq(
        0, [0], [3, 3, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    got = apply_penalties(logits.clone(), [seq])
    # repetition on prompt+output tokens {0, 2, 3}; then frequency/presence on output {3: 2, 2: 1}
    want = torch.tensor([[1.0, -1.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25]])
    assert torch.allclose(got, want)


def _dense_penalties(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """The penalties as masks over the whole [rows, vocab] (the sampler's earlier form)."""
    params = [s.sampling_params for s in seqs]
    rows, vocab = logits.shape

    def padded(lists: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in lists)
        return torch.tensor([r + [vocab] * (width - len(r)) for r in lists])

    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool)
    seen.scatter_(1, padded([s.token_ids for s in seqs]), True)
    rp = torch.tensor([p.repetition_penalty for p in params])[:, None]
    penalised = torch.where(logits > 0, logits / rp, logits * rp)
    logits = torch.where(seen[:, :vocab], penalised, logits)
    counts = torch.zeros(rows, vocab + 1)
    ids = padded([s.output_token_ids for s in seqs])
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    fp = torch.tensor([p.frequency_penalty for p in params])[:, None]
    pp = torch.tensor([p.presence_penalty for p in params])[:, None]
    return logits - fp * counts - pp * (counts > 0).to(logits.dtype)


def test_penalties_at_the_held_tokens_give_the_dense_masks_bits():
    """apply_penalties, computed at the tokens each sequence holds, gives the bits of masks
    over the whole vocabulary: repeated tokens, rows without penalties, signed zeros,
    infinities and NaN among the penalised logits; the caller's logits stay as they were."""
    torch.manual_seed(0)
    vocab = 997
    logits = torch.randn(12, vocab) * 3
    logits[0, :5] = torch.tensor([0.0, -0.0, float("-inf"), float("inf"), float("nan")])
    seqs = []
    for i in range(12):
        prompt = torch.randint(vocab, (int(torch.randint(1, 40, ())),)).tolist()
        output = torch.randint(vocab, (int(torch.randint(0, 40, ())),)).tolist()
        if i == 0:
            prompt, output = [0, 1, 2], [3, 4, 0, 3]
        seqs.append(
            make_seq(
                i,
                prompt,
                output,
                repetition_penalty=1.0 if i % 3 == 0 else 1.0 + 0.1 * (i % 5),
                frequency_penalty=0.0 if i % 4 == 0 else 0.3 * (i % 3),
                presence_penalty=0.0 if i % 2 == 0 else 0.25,
            )
        )
    before = logits.clone()
    got, want = apply_penalties(logits, seqs), _dense_penalties(logits, seqs)
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # untouched
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.signbit(), want.signbit())
    assert not torch.equal(got.nan_to_num(), logits.nan_to_num())  # they did penalise


def test_sampling_frequencies_follow_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(4000, 4).contiguous()
    seqs = [make_seq(i, [0], [], temperature=1.0) for i in range(4000)]
    tokens = torch.tensor(Sampler(torch.device("cpu"))(logits, seqs).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_greedy_picks_the_same_tokens_with_the_fused_argmax():
    """With the fused CPU ops on, greedy rows take the C++ argmax: the same tokens as torch's
    (ties included: the first of equal maxima)."""
    from pagedllm.layers import cpu_fused

    torch.manual_seed(0)
    logits = torch.randn(48, 4099)
    logits[3, 10] = logits[3, 4000] = 20.0
    seqs = [make_seq(i, [0], [], temperature=0.0) for i in range(48)]
    plain = Sampler(torch.device("cpu"))
    fused = Sampler(torch.device("cpu"), cpu_fused_ops=True)
    assert fused._argmax is (cpu_fused.argmax if cpu_fused.load() else plain._argmax)
    want = logits.argmax(dim=-1).tolist()
    assert plain(logits.clone(), seqs).token_ids == want
    assert fused(logits.clone(), seqs).token_ids == want
    assert want[3] == 10


def _fused_sample(logits: torch.Tensor, uniform: torch.Tensor, **params: float) -> torch.Tensor:
    """cpu_fused.sample of every row of logits under one set of SamplingParams."""
    from pagedllm.layers import cpu_fused

    if not cpu_fused.load():
        pytest.skip("the C++ fused CPU ops did not build here")
    p = SamplingParams(**params)
    rows, vocab = logits.shape
    return cpu_fused.sample(
        logits,
        torch.full((rows,), p.temperature),
        torch.full((rows,), p.top_k if 0 < p.top_k < vocab else 0),
        torch.full((rows,), p.top_p),
        torch.full((rows,), p.min_p),
        uniform,
    )


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8},
        {"temperature": 1.0, "top_k": 7},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 40, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.05},
        {"temperature": 1.1, "top_p": 0.95, "min_p": 0.02},
        {"temperature": 4.0, "top_p": 0.97},  # a flat row: hundreds of tokens ranked
    ],
)
def test_fused_sampling_gives_each_kept_token_its_share_of_a_uniform_grid(params):
    """The C++ sampler against the torch filters: with u on an even grid of 20,000 points,
    each token's count is 20,000 times its probability under apply_top_k_top_p_min_p (within
    the grid's one point), so a token kept or dropped wrongly, or a wrong share, shows."""
    torch.manual_seed(3)
    vocab, grid = 512, 20_000
    row = torch.randn(vocab) * 2.0
    row[[5, 77, 300]] = float("-inf")  # banned tokens: a grammar's or min_tokens' mask
    uniform = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    tokens = _fused_sample(row.expand(grid, vocab).contiguous(), uniform, **params)
    scaled = row[None] / params["temperature"]
    filtered = apply_top_k_top_p_min_p(scaled, [SamplingParams(**params)])[0]
    want = filtered.double().softmax(dim=-1) * grid
    counts = torch.bincount(tokens, minlength=vocab).double()
    kept = torch.isfinite(filtered)
    assert kept[tokens].all()  # only tokens the filters keep
    assert (counts - want).abs().max() <= 1.5
    if params.get("top_p", 1.0) < 1.0 or params.get("top_k", 0):
        assert 0 < int(kept.sum()) < vocab - 3  # the filters cut this row
    if params["temperature"] == 4.0:
        assert int(kept.sum()) > 64  # past the sort of a few: the halving search ran


def test_fused_sampling_edge_rows():
    """Greedy rows take the argmax; a row of -inf gives 0 and a NaN row its first NaN, as
    torch's argmax does; a +inf takes every probability; u near 1 gives the last kept token
    in index order, u = 0 the first."""
    row = torch.tensor([0.0, 3.0, 3.0, -1.0, 2.0])
    cases = torch.stack(
        [
            row,
            torch.full((5,), float("-inf")),
            torch.tensor([0.0, float("nan"), 1.0, float("nan"), 0.0]),
            torch.tensor([0.0, 1.0, float("inf"), 2.0, float("inf")]),
        ]
    )
    uniform = torch.full((4,), 0.5, dtype=torch.float64)
    assert _fused_sample(cases, uniform, temperature=0.0).tolist() == [1, 0, 1, 2]
    assert _fused_sample(cases, uniform, temperature=1.0).tolist()[1:] == [0, 1, 2]
    ends = torch.tensor([0.0, 1.0 - 1e-12], dtype=torch.float64)
    two = row.expand(2, 5).contiguous()
    assert _fused_sample(two, ends, temperature=1.0, top_k=3).tolist() == [1, 4]
    assert _fused_sample(two, ends, temperature=1.0).tolist() == [0, 4]


def test_sampler_takes_the_fused_sampling_and_keeps_seeded_rows_apart_from_their_batch():
    """With the fused CPU ops on, sampled rows follow their distribution, greedy rows in the
    same batch take the argmax, and a seeded request draws the same token whatever its batch."""
    from pagedllm.layers import cpu_fused

    if not cpu_fused.load():
        pytest.skip("the C++ fused CPU ops did not build here")
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(4000, 4).contiguous()
    seqs = [make_seq(i, [0], [], temperature=1.0) for i in range(3999)]
    seqs.append(make_seq(3999, [0], [], temperature=0.0))
    sampler = Sampler(torch.device("cpu"), cpu_fused_ops=True)
    calls = []
    fused = cpu_fused.sample
    cpu_fused.sample = lambda *a: calls.append(1) or fused(*a)
    try:
        tokens = torch.tensor(sampler(logits, seqs).token_ids)
    finally:
        cpu_fused.sample = fused
    assert calls == [1]
    assert tokens[-1] == 0
    freq = torch.bincount(tokens[:-1], minlength=4).float() / 3999
    assert torch.allclose(freq, probs, atol=0.03)
    row = torch.randn(1, 1000)
    alone = Sampler(torch.device("cpu"), cpu_fused_ops=True)
    seeded = make_seq(7, [0], [], temperature=1.0, seed=123)
    first = alone(row.clone(), [seeded]).token_ids
    again = Sampler(torch.device("cpu"), cpu_fused_ops=True)
    others = [make_seq(i, [0], [], temperature=1.0) for i in range(5)]
    batch = torch.cat([torch.randn(5, 1000), row])
    assert (
        again(batch, [*others, make_seq(7, [0], [], temperature=1.0, seed=123)]).token_ids[-1]
        == first[0]
    )
