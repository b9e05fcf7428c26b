"""The accept / reject step of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

For each sequence the target model scored 1 + k positions: the one after the last accepted
token and one after each of the k draft tokens. Draft token j is accepted with probability
min(1, p_j(x) / q_j(x)) (p: target, q: draft distribution; an n-gram draft is a point mass,
q(x) = 1), as long as every draft before it was accepted. At the first rejection the token is
drawn from the residual max(0, p_j - q_j) renormalised; when all k are accepted a bonus token
is drawn from p_k. Every emitted token is then distributed exactly as the target model alone
would have sampled it. Greedy rows accept while the draft equals the target's argmax and emit
the argmax at the first mismatch, so greedy output equals non-speculative decoding.

Everything is batched over [batch, k + 1] and synchronises with the host once, at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.core.sequence import Sequence
from pagedllm.worker.sampler import apply_top_k_top_p_min_p


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]  # per sequence: the accepted drafts, then one recovered/bonus
    num_accepted: list[int]  # per sequence: how many drafts were accepted


def rejection_sample(
    target_logits: torch.Tensor,
    target_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batched accept / reject step.

    target_logits [B, K+1, V]: greedy rows take their argmax (as the plain sampler does).
    target_probs [B, K+1, V]: the target's sampling distribution (None when all are greedy).
    draft_ids [B, K] (padding: any id), num_drafts [B]: row b has num_drafts[b] real drafts.
    draft_probs [B, K, V]: the draft distribution q; None for point-mass (n-gram) drafts.
    is_greedy [B]; uniforms [B, K] in [0, 1); noise [B, K+1, V] Exp(1) draws for the
    recovered / bonus token (argmax(p / E) samples from p). Both None when all are greedy.
    Returns (tokens [B, K+1] with -1 after the last emitted token, num_accepted [B]).
    """
    batch, width, _ = target_logits.shape
    k = width - 1
    device = target_logits.device
    positions = torch.arange(width, device=device)
    valid = positions[None, :k] < num_drafts[:, None]  # [B, K]
    greedy_tokens = target_logits.argmax(dim=-1)  # [B, K+1]
    accept = draft_ids == greedy_tokens[:, :k]
    final = greedy_tokens  # [B, K+1]: the token emitted if the run stops at this position
    if target_probs is not None:
        assert uniforms is not None and noise is not None
        p_draft = target_probs[:, :k].gather(2, draft_ids[..., None])[..., 0]  # [B, K]
        q_draft = (
            torch.ones_like(p_draft)
            if draft_probs is None
            else draft_probs.gather(2, draft_ids[..., None])[..., 0]
        )
        accept_random = uniforms * q_draft < p_draft  # u < p / q without dividing by zero
        accept = torch.where(is_greedy[:, None], accept, accept_random)
        residual = _residual(target_probs, draft_ids, draft_probs, valid)
        sampled = (residual / noise).argmax(dim=-1)  # [B, K+1]
        final = torch.where(is_greedy[:, None], greedy_tokens, sampled)
    accept &= valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]: the accepted prefix
    tokens = torch.where(
        positions[None, :k] < num_accepted[:, None], draft_ids, torch.full_like(draft_ids, -1)
    )
    tokens = torch.cat([tokens, torch.full_like(draft_ids[:, :1], -1)], dim=1)
    tokens.scatter_(1, num_accepted[:, None], final.gather(1, num_accepted[:, None]))
    return tokens, num_accepted


def _residual(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    valid: torch.Tensor,
) -> torch.Tensor:
    """max(0, p - q) at draft positions, p itself at the bonus position and past the drafts
    (unnormalised: the exponential race does not need it). [B, K+1, V]"""
    k = draft_ids.shape[1]
    residual = target_probs.clone()
    draft_part = residual[:, :k]
    if draft_probs is None:
        point = torch.zeros_like(draft_part).scatter_(2, draft_ids[..., None], 1.0)
        diff = (draft_part - point).clamp_min_(0.0)
    else:
        diff = (draft_part - draft_probs).clamp_min_(0.0)
    # p == q leaves nothing; rejection is then impossible, but guard against rounding.
    empty = diff.sum(dim=-1, keepdim=True) <= 0
    diff = torch.where(empty, draft_part, diff)
    residual[:, :k] = torch.where(valid[..., None], diff, draft_part)
    return residual


class RejectionSampler:
    """Turns the verify rows of a step into tokens, with the plain sampler's processing
    (temperature, top-k, top-p, min-p) and its per-sequence seeded generators."""

    def __init__(
        self, device: torch.device, generator_for: Callable[[Sequence], torch.Generator]
    ) -> None:
        self.device = device
        self.generator_for = generator_for

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: list[list[int]],
        draft_probs: torch.Tensor | None = None,
    ) -> RejectionOutput:
        """logits [sum(len(d) + 1), V] float32: for sequence i, len(drafts[i]) + 1 rows in a
        row. draft_probs [B, K, V] (q of each draft) or None for point-mass drafts."""
        batch, k = len(seqs), max(len(d) for d in drafts)
        dev = self.device
        counts = [len(d) + 1 for d in drafts]
        index = torch.tensor(_padded_rows(counts, k + 1), device=dev)  # [B, K+1]
        target_logits = logits[index]  # padding rows repeat a real row; they are never used
        draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], device=dev)
        num_drafts = torch.tensor([len(d) for d in drafts], device=dev)
        params = [s.sampling_params for s in seqs]
        is_greedy = torch.tensor([p.temperature == 0.0 for p in params], device=dev)
        probs = uniforms = noise = None
        if not all(p.temperature == 0.0 for p in params):
            temps = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
            scaled = (target_logits / temps[:, None, None]).flatten(0, 1)
            row_params = [p for p in params for _ in range(k + 1)]
            probs = apply_top_k_top_p_min_p(scaled, row_params).softmax(dim=-1)
            probs = probs.view(batch, k + 1, -1)
            uniforms, noise = self._random_draws(seqs, k, probs.shape[-1])
        tokens, accepted = rejection_sample(
            target_logits, probs, draft_ids, num_drafts, draft_probs, is_greedy, uniforms, noise
        )
        rows = tokens.tolist()
        num_accepted = accepted.tolist()
        return RejectionOutput([r[: n + 1] for r, n in zip(rows, num_accepted)], num_accepted)

    def _random_draws(
        self, seqs: list[Sequence], k: int, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        uniforms = torch.rand(len(seqs), k, device=self.device)
        noise = torch.empty(len(seqs), k + 1, vocab, device=self.device).exponential_()
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            if p.seed is not None and p.temperature > 0:
                gen = self.generator_for(seq)
                uniforms[row].uniform_(generator=gen)
                noise[row].exponential_(generator=gen)
        return uniforms, noise


def _padded_rows(counts: list[int], width: int) -> list[list[int]]:
    """Row indices of each sequence's verify rows, padded by repeating its last row."""
    out, start = [], 0
    for n in counts:
        out.append([start + min(j, n - 1) for j in range(width)])
        start += n
    return out
