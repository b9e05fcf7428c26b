"""CUDA graphs of the decode step: one captured forward per padded batch size.

A decode step launches a few kernels per layer, each doing little at small batches; on a
GPU their launches cost more than their work. ``DecodeGraphs`` captures the model's forward
(embedding to final norm; logits and sampling stay eager, as in vLLM) once per batch size in
``capture_sizes``, over static input buffers, and a decode step of n sequences replays the
smallest graph of at least n rows after copying its inputs in.

What makes one graph serve every decode step of its size:

- the inputs live in static buffers (token ids, positions, cache slots, key counts, block
  tables of ``max_model_len`` keys); a step copies its rows in, and the rows past n are
  padding: token 0 at position 0, one key, its cache write going to a scratch block that no
  sequence owns (``ModelRunner.allocate_kv_cache`` adds it);
- attention is captured with ``max_seqlen_k = max_model_len``: its launch grid (split-K sized
  for the longest context) covers any step, the Triton kernel cutting each sequence's own
  keys into the launch's splits;
- the graphs share one memory pool, captured largest first, and the output of the graph
  replayed last is valid until the next replay (the runner takes its logits before that).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagedllm.attention.metadata import AttentionMetadata, ForwardContext

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (at most 256): a batch pads to at most 15
    rows past its own."""
    limit = min(max_num_seqs, 256)
    sizes = [s for s in (1, 2, 4, 8) if s <= limit]
    sizes += list(range(16, limit + 1, 16))
    if sizes[-1] < limit:
        sizes.append(limit)
    return sizes


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # [size, hidden], written by each replay


class DecodeGraphs:
    """Captured decode forwards of ``model`` over its bound KV cache, for batches of at most
    ``max(sizes)`` sequences. ``run`` returns the step's hidden states, or None when the step
    is not one a graph replays (then the caller runs it eagerly)."""

    def __init__(
        self,
        model: torch.nn.Module,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        pad_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.pad_slot = pad_slot
        largest = self.sizes[-1]
        blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), pad_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(largest, blocks, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0  # decode steps served by a graph
        self.capture_seconds = 0.0

    def _metadata(self, size: int) -> AttentionMetadata:
        """The static buffers' first ``size`` rows as a decode step's metadata, its longest
        context max_model_len (the attention launch every replay reuses)."""
        return AttentionMetadata.paged(
            query_start_loc=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        with ForwardContext(self._metadata(size)):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, in one shared memory pool. Each size runs once
        eagerly first (Triton compiles its kernels, cuBLAS picks its algorithms)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.input_ids.device)
        stream.wait_stream(torch.cuda.current_stream(self.input_ids.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    output = self._forward(size)
                self.graphs[size] = _Graph(graph, output)
        torch.cuda.current_stream(self.input_ids.device).wait_stream(stream)
        torch.cuda.synchronize(self.input_ids.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "CUDA graphs: decode batches of %s captured in %.2f s",
            self.sizes, self.capture_seconds,
        )  # fmt: skip

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size of at least num_seqs rows, None past the largest."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """[num_seqs, hidden] for a decode-only step that fits a graph; None otherwise."""
        if not metadata.is_decode_only or metadata.groups:
            return None
        n = metadata.num_seqs
        size = self.size_for(n)
        table = metadata.block_table
        if size is None or size not in self.graphs or table.shape[1] > self.block_table.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.batch.seq_lens_k, non_blocking=True)
        self.block_table[:n, : table.shape[1]].copy_(table, non_blocking=True)
        if size > n:  # padding rows: one key each, their writes into the scratch block
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.seq_lens[n:size].fill_(1)
        entry = self.graphs[size]
        entry.graph.replay()
        self.replays += 1
        return entry.output[:n]
