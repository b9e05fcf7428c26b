"""The model runner's speculative-decoding part: verifies a step's drafts with the rejection
sampler and proposes the next step's drafts, sequence by sequence, behind the adaptive gate."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.core.sequence import Sequence
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.worker.spec_decode.adaptive import AdaptiveGate
from pagedllm.worker.spec_decode.ngram import NgramProposer
from pagedllm.worker.spec_decode.rejection_sampler import RejectionOutput, RejectionSampler


def speculates(seq: Sequence, num_output_tokens: int) -> bool:
    """Whether seq may verify drafts. Logprobs, penalties and min_tokens depend on every token
    before a position; they are computed for one position per step, so such requests decode
    plainly."""
    p = seq.sampling_params
    return (
        p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and num_output_tokens >= p.min_tokens
    )


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        device: torch.device,
        generator_for: Callable[[Sequence], torch.Generator],
    ) -> None:
        if config.method != "ngram":
            raise ValueError(f"speculative method {config.method!r} has no proposer here.")
        self.config = config
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.gate = AdaptiveGate()
        self.rejection_sampler = RejectionSampler(device, generator_for)

    def verify(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
    ) -> RejectionOutput:
        """logits: len(drafts[i]) + 1 rows per sequence, consecutive."""
        out = self.rejection_sampler(logits, seqs, drafts)
        for seq, d, n in zip(seqs, drafts, out.num_accepted):
            self.gate.observe(seq.seq_id, len(d), n)
        return out

    def propose(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> dict[int, list[int]]:
        """Drafts for the next step of each sequence, given the tokens this step adds."""
        drafts: dict[int, list[int]] = {}
        for seq, tokens in zip(seqs, new_tokens):
            if not speculates(seq, seq.num_output_tokens + len(tokens)):
                continue
            if not self.gate.allow(seq.seq_id):
                continue
            proposal = self.proposer.propose(seq.token_ids + tokens)
            if proposal:
                drafts[seq.seq_id] = proposal
        return drafts

    def release(self, seq_id: int) -> None:
        self.gate.release(seq_id)
