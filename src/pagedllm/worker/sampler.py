"""Turns the last-position logits of each sequence into the next token (and logprobs).

Everything is batched over the sequences of a step; per-sequence parameters become
tensors. Seeded requests draw their noise from their own generator, so a seeded request
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.core.outputs import Logprob, TokenLogprobs
from pagedllm.core.sequence import Sequence
from pagedllm.layers import cpu_fused
from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sampled sequence, in batch order
    logprobs: list[TokenLogprobs | None]  # per sequence: top-k and the sampled token


class GrammarMask(Protocol):
    """A step's structured-output token mask (see structured_output.manager)."""

    def apply(self, logits: torch.Tensor) -> None:
        """Set disallowed tokens of the constrained rows of logits [rows, vocab] to -inf."""


def _entries(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """The flat index row * vocab + token of every token of each row."""
    tokens = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    return (row * vocab + tokens).to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens): new
    logits, the bits that masks over the whole [rows, vocab] give, computed at the tokens the
    sequences hold only (48 rows of 49,152 logits and 384 tokens each on a 2-core Zen 3: the
    repetition penalty 11 -> 2.7 ms, all three 18 -> 4.8 ms)."""
    params = [s.sampling_params for s in seqs]
    repetition = any(p.repetition_penalty != 1.0 for p in params)
    counted = any(p.frequency_penalty or p.presence_penalty for p in params)
    if not (repetition or counted):
        return logits
    vocab = logits.shape[-1]
    device = logits.device
    logits = logits.clone()  # the caller's stay as they were (the speculator reads them)
    flat = logits.view(-1)
    if repetition:
        at = _entries([s.token_ids for s in seqs], vocab, device)
        rp = torch.tensor([p.repetition_penalty for p in params], device=device)
        rp = rp[at // vocab]
        seen = flat[at]  # a token held twice is written twice, with the same value
        flat[at] = torch.where(seen > 0, seen / rp, seen * rp)
    if counted:
        at, counts = torch.unique(
            _entries([s.output_token_ids for s in seqs], vocab, device), return_counts=True
        )
        row = at // vocab
        fp = torch.tensor([p.frequency_penalty for p in params], device=device)[row]
        pp = torch.tensor([p.presence_penalty for p in params], device=device)[row]
        flat[at] = flat[at] - fp * counts.to(logits.dtype) - pp
    return logits


def mask_early_stops(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Before min_tokens, EOS and stop tokens cannot be sampled (a grammar, which allows
    EOS only once its output is complete, takes precedence)."""
    for row, seq in enumerate(seqs):
        p = seq.sampling_params
        if seq.num_output_tokens < p.min_tokens and p.structured_outputs is None:
            banned = list(p.stop_token_ids)
            if seq.eos_token_id is not None and not p.ignore_eos:
                banned.append(seq.eos_token_id)
            if banned:
                logits[row, banned] = float("-inf")
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=device)[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always the first token)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= torch.tensor(top_p, device=device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device)[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, cpu_fused_ops: bool = False) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> its seeded generator
        # greedy picks on the C++ argmax (one vectorized pass; torch's took 2.6% of a 48-row
        # SmolLM2 decode step), and the other rows on its sampling (one uniform number a row
        # for the exponential noise of every entry: 58 ms of a 48-row SmolLM2 decode step),
        # where the fused CPU ops are on
        self._argmax = _torch_argmax
        self._fused = cpu_fused_ops and device.type == "cpu" and cpu_fused.load()
        if self._fused:
            self._argmax = cpu_fused.argmax

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    @property
    def argmax(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The greedy pick over rows of float32 logits, as __call__ makes it."""
        return self._argmax

    @staticmethod
    def takes_argmax(seq: Sequence) -> bool:
        """Whether seq's next token is the argmax of its raw logits, whatever its batch (greedy,
        no logprobs, no penalty, min_tokens reached, no grammar): what a step that decodes
        several tokens without the sampler may compute (ModelRunner.execute)."""
        p = seq.sampling_params
        return (
            p.temperature == 0.0
            and p.logprobs is None
            and p.repetition_penalty == 1.0
            and not p.frequency_penalty
            and not p.presence_penalty
            and seq.num_output_tokens >= p.min_tokens
            and p.structured_outputs is None
        )

    def generator_for(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.sampling_params.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], grammar: GrammarMask | None = None
    ) -> SamplerOutput:
        """logits [num_seqs, vocab] (float32) at each sequence's last position."""
        raw_logprobs = None
        if any(s.sampling_params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = mask_early_stops(apply_penalties(logits, seqs), seqs)
        if grammar is not None:
            grammar.apply(logits)  # waits for the mask filled during the forward
        params = [s.sampling_params for s in seqs]
        if all(p.temperature == 0.0 for p in params):
            tokens = self._argmax(logits)
        elif self._fused and logits.dtype == torch.float32:
            tokens = self._sample_fused(logits, seqs, params)
        else:
            greedy = self._argmax(logits)
            temps = torch.tensor([p.temperature or 1.0 for p in params], device=self.device)
            probs = apply_top_k_top_p_min_p(logits / temps[:, None], params).softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for row, seq in enumerate(seqs):
                if seq.sampling_params.seed is not None and params[row].temperature > 0:
                    noise[row].exponential_(generator=self.generator_for(seq))
            sampled = (probs / noise).argmax(dim=-1)  # Gumbel-style race, no host sync
            is_greedy = torch.tensor([p.temperature == 0.0 for p in params], device=self.device)
            tokens = torch.where(is_greedy, greedy, sampled)
        token_list = tokens.tolist()
        logprobs = (
            self._logprobs(raw_logprobs, tokens, params)
            if raw_logprobs is not None
            else [None] * len(seqs)
        )
        return SamplerOutput(token_list, logprobs)

    def _sample_fused(
        self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]
    ) -> torch.Tensor:
        """The C++ sampling of every row (argmax where temperature is 0): one uniform number
        a row, a seeded request's from its own generator."""
        vocab = logits.shape[-1]
        uniform = torch.rand(len(seqs), dtype=torch.float64)
        for row, seq in enumerate(seqs):
            if params[row].seed is not None and params[row].temperature > 0:
                uniform[row] = torch.rand(
                    (), dtype=torch.float64, generator=self.generator_for(seq)
                )
        return cpu_fused.sample(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params]),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32),
            uniform,
        )

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> list[TokenLogprobs | None]:
        k = max(p.logprobs or 0 for p in params)
        return gather_logprobs(raw, tokens, [p.logprobs for p in params], k)


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, wanted: list[int | None], k: int
) -> list[TokenLogprobs | None]:
    """Per row: the top wanted[row] tokens and the chosen token, with logprob and rank."""
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen_list, chosen_lp_list = chosen.tolist(), chosen_lp[:, 0].tolist()
    top_lp_list = top_lp.tolist() if top_lp is not None else None
    top_ids_list = top_ids.tolist() if top_ids is not None else None
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            out.append(None)
            continue
        entry: TokenLogprobs = {chosen_list[row]: Logprob(chosen_lp_list[row], ranks[row])}
        for j in range(n):
            assert top_ids_list is not None and top_lp_list is not None
            entry.setdefault(top_ids_list[row][j], Logprob(top_lp_list[row][j], j + 1))
        out.append(entry)
    return out
