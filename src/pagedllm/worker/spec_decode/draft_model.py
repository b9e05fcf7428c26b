"""Draft-model proposer: a smaller model of the same vocabulary proposes k tokens, one decode
step at a time, for every sequence of the batch together.

Its KV cache has the target's layout: the same number of blocks of the same size, indexed by
the same block ids, so the target's block tables and slot mapping serve it unchanged and the
block manager (allocation, prefix cache, preemption, rollback) needs no second bookkeeping.
Invariant: the draft has computed K/V for every position the target has. It runs over each
step's batch after the target (``catch_up``), then decodes k tokens from the step's last
token; those decode steps write slots past the kept tokens (the scheduler's lookahead slots),
which the next step's catch-up overwrites with the verified tokens' K/V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata, ForwardContext
from pagedllm.config import ModelConfig, load_hf_config
from pagedllm.core.sequence import Sequence
from pagedllm.models.loader import load_model
from pagedllm.worker.cpu_decoder import CpuFusedDecoder, run_fused
from pagedllm.worker.sampler import apply_top_k_top_p_min_p


class DraftModelProposer:
    def __init__(
        self,
        path: str,
        k: int,
        target: ModelConfig,
        device: torch.device,
        cpu_fused_ops: bool = True,
    ) -> None:
        config = dataclasses.replace(
            target,
            model=path,
            tokenizer=path,
            hf_config=load_hf_config(path),
            layer_range=None,
            quant_config=None,
        )
        self.model = load_model(config, device, cpu_fused_ops=cpu_fused_ops)
        self.fast_path: CpuFusedDecoder | None = None  # set by the runner (rebuild_fast_path)
        self.k = k
        self.device = device
        self.block_size = 0
        self._probs: dict[int, torch.Tensor] = {}  # seq_id -> [k_i, vocab] q of its drafts

    # ---- KV cache ------------------------------------------------------------------------
    def kv_cache_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the draft's cache."""
        layers = self.model.attention_layers()
        return len(layers), layers[0].num_kv_heads, layers[0].head_dim

    def bind_kv_cache(
        self, caches: list[tuple[torch.Tensor, torch.Tensor]], backend: object, block_size: int
    ) -> None:
        for layer, (k, v) in zip(self.model.attention_layers(), caches):
            layer.key_cache, layer.value_cache, layer.backend = k, v, backend
        self.block_size = block_size

    # ---- proposing -----------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> None:
        """The draft over the step's batch: K/V at every position the target computed."""
        with ForwardContext(md):
            self._forward(input_ids, positions, md)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        new_tokens: list[list[int]],
        generator_for: Callable[[Sequence], torch.Generator],
    ) -> dict[int, list[int]]:
        """Up to k drafts per sequence, decoded from its newest token; fewer when its blocks
        end sooner (no lookahead slots were free)."""
        bs = self.block_size
        # the newest token sits at position p = num_tokens - 1, not yet computed
        pos = np.array([s.num_tokens + len(t) - 1 for s, t in zip(seqs, new_tokens)])
        room = np.array([len(s.block_table) * bs for s in seqs]) - pos
        steps = np.minimum(room, self.k)
        current = [t[-1] for t in new_tokens]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(int(steps.max(initial=0))):
            active = [i for i in range(len(seqs)) if steps[i] > j]
            logits = self._decode_step([seqs[i] for i in active], pos[active] + j, current, active)
            tokens, q = self._sample(logits, [seqs[i] for i in active], generator_for)
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                probs[i].append(q[row])
                current[i] = tokens[row]
        out: dict[int, list[int]] = {}
        for seq, d, p in zip(seqs, drafts, probs):
            if d:
                out[seq.seq_id] = d
                self._probs[seq.seq_id] = torch.stack(p)
        return out

    def _decode_step(
        self, seqs: list[Sequence], pos: np.ndarray, current: list[int], active: list[int]
    ) -> torch.Tensor:
        """One token per sequence at positions pos: logits [len(seqs), vocab] (float32)."""
        bs, dev = self.block_size, self.device
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        for row, s in enumerate(seqs):
            tables[row, : len(s.block_table)] = s.block_table
        blocks = tables[np.arange(len(seqs)), pos // bs].astype(np.int64)
        seq_lens = (pos + 1).tolist()
        md = AttentionMetadata.paged(
            query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(blocks * bs + pos % bs).to(dev),
            query_lens_cpu=[1] * len(seqs),
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor([current[i] for i in active], dtype=torch.long, device=dev)
        with ForwardContext(md):
            hidden = self._forward(ids, torch.from_numpy(pos.astype(np.int64)).to(dev), md)
        return self.model.compute_logits(hidden).float()

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        if self.fast_path is not None:
            return run_fused(self.model, self.fast_path, input_ids, positions, md)
        return self.model(input_ids, positions)

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        generator_for: Callable[[Sequence], torch.Generator],
    ) -> tuple[list[int], torch.Tensor]:
        """Drafts drawn from q (the draft's distribution under each request's temperature,
        top-k, top-p, min-p), greedy rows by argmax. Returns the tokens and q [B, vocab]."""
        params = [s.sampling_params for s in seqs]
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=self.device)
        q = apply_top_k_top_p_min_p(logits / temps[:, None], params).softmax(dim=-1)
        noise = torch.empty_like(q).exponential_()
        for row, seq in enumerate(seqs):
            if params[row].seed is not None and params[row].temperature > 0:
                noise[row].exponential_(generator=generator_for(seq))
        sampled = (q / noise).argmax(dim=-1)
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=self.device)
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
        return tokens.tolist(), q

    def draft_probs(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """q of the drafts being verified, [B, K, vocab] (rows past a sequence's drafts: 1s,
        never read)."""
        k = max(len(d) for d in drafts)
        rows = []
        for seq, d in zip(seqs, drafts):
            q = self._probs[seq.seq_id][: len(d)]
            if q.shape[0] < k:
                q = torch.cat([q, q.new_ones(k - q.shape[0], q.shape[1])])
            rows.append(q)
        return torch.stack(rows)

    def release(self, seq_id: int) -> None:
        self._probs.pop(seq_id, None)
