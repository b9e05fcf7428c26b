"""The sampler's filters and penalties against direct references; sampled frequencies."""

from __future__ import annotations

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
