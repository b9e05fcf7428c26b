"""The model runner's speculative-decoding part: verifies a step's drafts with the rejection
sampler and proposes the next step's drafts, sequence by sequence, behind the adaptive gate."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedllm.config import ModelConfig
from pagedllm.core.sequence import Sequence
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.worker.spec_decode.adaptive import AdaptiveGate
from pagedllm.worker.spec_decode.draft_model import DraftModelProposer
from pagedllm.worker.spec_decode.ngram import NgramProposer
from pagedllm.worker.spec_decode.rejection_sampler import RejectionOutput, RejectionSampler

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelInput


def speculates(seq: Sequence, num_output_tokens: int) -> bool:
    """Whether seq may verify drafts. Logprobs, penalties, min_tokens and a grammar's token mask
    depend on every token before a position; they are computed for one position per step, so
    such requests decode plainly."""
    p = seq.sampling_params
    return (
        p.logprobs is None
        and p.structured_outputs is None
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and num_output_tokens >= p.min_tokens
    )


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelConfig,
        device: torch.device,
        generator_for: Callable[[Sequence], torch.Generator],
        cpu_fused_ops: bool = True,
    ) -> None:
        self.config = config
        self.generator_for = generator_for
        self.ngram: NgramProposer | None = None
        self.draft: DraftModelProposer | None = None
        k = config.num_speculative_tokens
        if config.method == "ngram":
            self.ngram = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            assert config.model is not None
            self.draft = DraftModelProposer(config.model, k, target, device, cpu_fused_ops)
        self.gate = AdaptiveGate()
        self.rejection_sampler = RejectionSampler(device, generator_for)

    def catch_up(self, inp: ModelInput) -> None:
        """A draft model computes K/V wherever the target did this step."""
        if self.draft is not None:
            self.draft.catch_up(inp.input_ids, inp.positions, inp.metadata)

    def verify(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
    ) -> RejectionOutput:
        """logits: len(drafts[i]) + 1 rows per sequence, consecutive."""
        q = self.draft.draft_probs(seqs, drafts) if self.draft is not None else None
        out = self.rejection_sampler(logits, seqs, drafts, q)
        for seq, d, n in zip(seqs, drafts, out.num_accepted):
            self.gate.observe(seq.seq_id, len(d), n)
        return out

    def propose(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> dict[int, list[int]]:
        """Drafts for the next step of each sequence, given the tokens this step adds."""
        chosen = [
            (seq, tokens)
            for seq, tokens in zip(seqs, new_tokens)
            if speculates(seq, seq.num_output_tokens + len(tokens)) and self.gate.allow(seq.seq_id)
        ]
        if not chosen:
            return {}
        if self.draft is not None:
            return self.draft.propose(
                [s for s, _ in chosen], [t for _, t in chosen], self.generator_for
            )
        assert self.ngram is not None
        drafts: dict[int, list[int]] = {}
        for seq, tokens in chosen:
            proposal = self.ngram.propose(seq.token_ids + tokens)
            if proposal:
                drafts[seq.seq_id] = proposal
        return drafts

    def release(self, seq_id: int) -> None:
        self.gate.release(seq_id)
        if self.draft is not None:
            self.draft.release(seq_id)
