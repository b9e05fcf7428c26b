"""Owns the model and its KV cache on one device; turns a SchedulerOutput into tokens."""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import get_attention_backend
from pagedllm.attention.metadata import AttentionMetadata, ForwardContext
from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    default_kv_cache_bytes,
)
from pagedllm.core.kv_cache import KVCacheGroup, KVCacheSpec, split_kv_budget
from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.core.sequence import Sequence
from pagedllm.distributed.communicator import SINGLE, Communicator
from pagedllm.dtypes import torch_dtype
from pagedllm.lora.manager import LoRAManager
from pagedllm.models.loader import load_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_config import SpeculativeConfig
from pagedllm.worker.cpu_decoder import (
    CpuFusedDecoder,
    DecodeSteps,
    ModelEnds,
    run_fused,
    run_fused_logits,
)
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes
from pagedllm.worker.huge_pages import gather_weights, private_memory
from pagedllm.worker.pooler import Pooler
from pagedllm.worker.sampler import GrammarMask, Sampler, TokenLogprobs, gather_logprobs
from pagedllm.worker.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


def _slots(table: list[int], pos: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slots of the tokens at positions pos, through one block table."""
    blocks = np.asarray(table, dtype=np.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


def _padded_tables(tables: list[list[int]]) -> np.ndarray:
    """[num_seqs, longest] int32, padded with block 0."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] flat over the scheduled sequences
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] token rows whose logits are needed
    sample_seqs: list[Sequence]  # the sequences sampled this step
    sample_rows: list[int]  # their rows in logits_indices
    prompt_logprob_rows: list[tuple[Sequence, int, int]]  # (seq, first logits row, count)
    grammar: GrammarMask | None = None  # token mask of the constrained sampled rows
    verify_seqs: list[Sequence] = field(default_factory=list)  # sequences verifying drafts
    verify_drafts: list[list[int]] = field(default_factory=list)  # their drafts
    verify_rows: list[int] = field(default_factory=list)  # len(drafts) + 1 logits rows each
    lora_requests: list[Any] | None = None  # each sequence's LoRARequest (None: base; LoRA on)
    logits_all_rows: bool = False  # logits_indices is every token row in order (a decode step)
    logits: torch.Tensor | None = None  # float32, when the fused decoder computed them (forward)


@dataclass
class ModelOutput:
    sampled: dict[int, list[int]]  # seq_id -> new tokens (drafts: accepted + 1; a burst: its steps)
    logprobs: dict[int, TokenLogprobs]  # seq_id -> logprobs of the new token
    prompt_logprobs: dict[int, list[TokenLogprobs | None]]  # seq_id -> this chunk's positions
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)  # next step's drafts


class ModelRunner:
    """Takes only the configs it reads: the model, the KV cache's budget and block size,
    the scheduler's limits (for the profiling run and the useful cache size) and the device."""

    pooler: Pooler | None = None  # embeddings: sees each step's hidden states (pooler.py)

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device_config: DeviceConfig,
        comm: Communicator = SINGLE,
        speculative_config: SpeculativeConfig | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.device = torch.device(device_config.device)
        self.enforce_eager = device_config.enforce_eager
        self.kernels = device_config.kernels
        self.world_size = comm.world_size
        if self.device.type == "cuda" and comm.world_size > 1:
            self.device = torch.device("cuda", comm.rank % torch.cuda.device_count())
        self.dtype = torch_dtype(model_config.dtype)
        # the K/V's dtype: the model's, or kv_cache_dtype's (attention then runs in it)
        cache_dtype = cache_config.cache_dtype
        self.kv_dtype = self.dtype if cache_dtype == "auto" else torch_dtype(cache_dtype)
        torch.manual_seed(model_config.seed)
        start = time.perf_counter()
        self.model = load_model(
            model_config, self.device, comm, self.kernels.cpu_fused_ops,
            self.kernels.cuda_fused_ops,
        )  # fmt: skip
        # an in-place change of its linears (quantization) rebuilds how steps run
        self.model.on_weights_changed = self.rebuild_fast_path
        self.load_seconds = time.perf_counter() - start
        self.lora: LoRAManager | None = None  # adapters beside the base weights (lora/)
        if lora_config is not None:
            self.lora = LoRAManager(self.model, lora_config.max_loras, lora_config.max_lora_rank)
        self.backend = get_attention_backend(
            device_config.attention_backend, self.device, self.kernels.attention_tiles
        )
        self.sampler = Sampler(self.device, self.kernels.cpu_fused_ops)
        self.speculator: Speculator | None = None
        if speculative_config is not None:
            self.speculator = Speculator(
                speculative_config,
                model_config,
                self.device,
                self.sampler.generator_for,
                self.kernels.cpu_fused_ops,
            )
        self.kv_spec: KVCacheSpec | None = None  # the allocated cache's layout
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_buffer: mmap.mmap | None = None  # backs the CPU cache (see _zeroed)
        # How steps run beyond the modules' own forward: built by rebuild_fast_path
        self.fast_path: CpuFusedDecoder | None = None
        self.draft_fast_path: CpuFusedDecoder | None = None
        self.graphs: DecodeGraphs | None = None  # CUDA: the captured decode steps
        self._profiling = False  # the CUDA memory profile's throwaway cache: no graphs
        # schedules whose batch ran several greedy decode steps (_decode_ahead), and the steps
        self.num_decode_bursts = self.num_burst_steps = 0

    @classmethod
    def from_engine_config(cls, config: EngineConfig, comm: Communicator = SINGLE) -> ModelRunner:
        return cls(
            config.model, config.cache, config.scheduler, config.device, comm, config.speculative,
            config.lora,
        )  # fmt: skip

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks of the allocated cache (0 before allocate_kv_cache)."""
        return 0 if self.kv_spec is None else self.kv_spec.num_blocks

    # ---- KV cache ------------------------------------------------------------------------
    def kv_cache_groups(self) -> list[list[int]]:
        """The attention layers' indexes per KV cache group: one group unless the model
        mixes windows (Gemma 3: global and sliding layers), then the global layers first
        and each window's layers after, widest first. Each group has its own block pool."""
        windows = [attn.window_left for attn in self.model.attention_layers()]
        order = sorted(set(windows), key=lambda w: (w >= 0, -w))
        return [[i for i, w in enumerate(windows) if w == key] for key in order]

    def _group_windows(self) -> list[int | None]:
        attn = self.model.attention_layers()
        return [
            None if attn[g[0]].window_left < 0 else attn[g[0]].window_left
            for g in self.kv_cache_groups()
        ]

    def _bytes_per_block(self, group: int | None = None) -> int:
        """K and V bytes of one block of a group's layers, or of every layer (group None, a
        single pool); the draft's with the first group."""
        layers = self.model.attention_layers()
        attn = layers[0]
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        num_layers = len(layers) if group is None else len(self.kv_cache_groups()[group])
        per_token = num_layers * attn.num_kv_heads * attn.head_dim
        if not group and self.speculator is not None and self.speculator.draft is not None:
            draft_layers, heads, dim = self.speculator.draft.kv_cache_shape()
            per_token += draft_layers * heads * dim  # the draft's cache shares the block ids
        return 2 * self.block_size * per_token * elem

    def kv_cache_budget(self) -> int:
        """Bytes the KV cache may take: explicit, else from device memory or the CPU default."""
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return explicit
        if self.device.type == "cuda":
            return self._profile_cuda_budget()
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(default_kv_cache_bytes(), int(available * 0.4))

    def _profile_cuda_budget(self) -> int:
        """gpu_memory_utilization x total, less weights and the peak of a full-size forward."""
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.scheduler_config.max_num_batched_tokens
        extra = len(self.kv_cache_groups()) - 1
        blocks = -(-num_tokens // self.block_size)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        seq = Sequence(-1, "profile", 0, [0] * num_tokens, params, None)
        seq.block_table = list(range(blocks))
        seq.group_block_tables = [list(range(blocks)) for _ in range(extra)]
        self._profiling = True
        try:
            self.allocate_kv_cache(blocks, [blocks] * extra)
            self.execute(SchedulerOutput([ScheduledSequence(seq, num_tokens)], num_tokens))
        finally:
            self._profiling = False
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches, self.kv_spec = [], None
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.cache_config.gpu_memory_utilization) - peak

    def plan_kv_cache(self, grouped: bool = False) -> KVCacheSpec:
        """The cache the budget buys: with grouped, a block pool per KV cache group for
        models that mix windows (the engine's executors); else one pool for every layer."""
        if grouped and len(self.kv_cache_groups()) > 1:
            return self._plan_grouped_kv_cache()
        per_block = self._bytes_per_block()
        num_blocks = self.kv_cache_budget() // per_block
        sched = self.scheduler_config
        useful = sched.max_num_seqs * -(-sched.max_model_len // self.block_size) + 1
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(
                "no memory left for the KV cache; raise kv_cache_memory_bytes "
                "or gpu_memory_utilization."
            )
        return KVCacheSpec(num_blocks, self.block_size, per_block)

    def _plan_grouped_kv_cache(self) -> KVCacheSpec:
        """Global and sliding layers: one budget split between the groups' pools by need
        (kv_cache.split_kv_budget). A sequence of max_model_len tokens needs all its blocks in
        the global group but only those its window and one step reach in a sliding one
        (BlockManager.max_blocks_held). Shorter sequences are then bounded by the sliding
        pools, which hold fewer blocks than one pool for every layer would."""
        sched = self.scheduler_config
        full = -(-sched.max_model_len // self.block_size)
        step = sched.max_num_batched_tokens
        windows = self._group_windows()
        need = [
            full if w is None else min(full, -(-(w + step) // self.block_size) + 1) for w in windows
        ]
        per_block = [self._bytes_per_block(g) for g in range(len(windows))]
        windowed = [w is not None for w in windows]
        counts = split_kv_budget(
            self.kv_cache_budget(), need, per_block, windowed, sched.max_num_seqs
        )
        if min(c - w for c, w in zip(counts, windowed)) < 1:
            raise ValueError(
                "no memory left for the KV cache; raise kv_cache_memory_bytes "
                "or gpu_memory_utilization."
            )
        return self._grouped_spec(counts)

    def _grouped_spec(self, counts: list[int]) -> KVCacheSpec:
        windows = self._group_windows()
        extra = tuple(
            KVCacheGroup(counts[g], self._bytes_per_block(g), windows[g])
            for g in range(1, len(counts))
        )
        return KVCacheSpec(counts[0], self.block_size, self._bytes_per_block(0), extra, windows[0])

    def allocate_kv_cache(self, num_blocks: int, extra_blocks: Seq[int] = ()) -> None:
        """num_blocks for group 0 and extra_blocks for each further KV cache group (models
        mixing windows; kv_cache_groups). Every group's layers get caches of its count.
        Without extra_blocks every layer shares one pool of num_blocks, as a model without
        groups does."""
        self.kv_caches = []  # the old cache (if any) is freed before the new one is made
        attn = self.model.attention_layers()
        groups = self.kv_cache_groups() if extra_blocks else [list(range(len(attn)))]
        counts = [num_blocks, *extra_blocks]
        if len(counts) != len(groups):
            raise ValueError(f"{len(groups)} KV cache groups, got block counts for {len(counts)}")
        # CUDA graphs replay padded batches: the padding rows write their K/V to a scratch
        # block past those the block manager hands out (group 0's tensors only)
        scratch = 1 if self._graphs_wanted(len(groups)) else 0
        allocated = [num_blocks + scratch, *extra_blocks]
        per_block = self.block_size * attn[0].num_kv_heads * attn[0].head_dim
        # Zeroed: padded key slots are masked, but 0 * NaN garbage would still poison P @ V.
        flat = self._zeroed(2 * per_block * sum(len(g) * c for g, c in zip(groups, allocated)))
        caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        offset = 0
        for index, (layers, count) in enumerate(zip(groups, allocated)):
            shape = (count, self.block_size, attn[0].num_kv_heads, attn[0].head_dim)
            size = 2 * len(layers) * math.prod(shape)
            views = flat[offset : offset + size].view(len(layers), 2, *shape)
            offset += size
            for j, layer_idx in enumerate(layers):
                caches[layer_idx] = (views[j, 0], views[j, 1])
                attn[layer_idx].kv_group = index
        self.kv_caches = [caches[i] for i in range(len(attn))]
        for layer, (k, v) in zip(attn, self.kv_caches):
            layer.key_cache, layer.value_cache, layer.backend = k, v, self.backend
        if self.speculator is not None and self.speculator.draft is not None:
            self._allocate_draft_kv_cache(num_blocks)
        if len(groups) == 1:
            self.kv_spec = KVCacheSpec(num_blocks, self.block_size, self._bytes_per_block())
        else:
            self.kv_spec = self._grouped_spec(counts)
        self.rebuild_fast_path()

    # ---- how a step runs -----------------------------------------------------------------
    def rebuild_fast_path(self) -> None:
        """Decide, from the model as it is now, how steps run: on a CPU the fused decoder
        (every decoder layer in one C++ call, worker/cpu_decoder.py), unless enforce_eager or
        PAGEDLLM_CPU_FUSED_DECODER=0 (then the modules run one by one). allocate_kv_cache calls
        this; whoever replaces weights, linear classes (quantization) or caches afterwards calls
        it again. On CUDA the decode steps are captured as CUDA graphs (worker/cuda_graphs.py)
        unless enforce_eager; other steps, and models the graphs do not take, run eagerly."""
        self.fast_path = self.draft_fast_path = self.graphs = None
        if self.device.type == "cpu" and self.kernels.cpu_huge_pages:
            self._gather_weights()
        if self.device.type == "cuda" and self.kv_caches:
            self._capture_graphs()
        if self.enforce_eager or not self.kv_caches or self.device.type != "cpu":
            return
        if self.lora is not None:  # the fused decoder has no LoRA product
            return
        if not self.kernels.cpu_fused_decoder:
            return
        self.fast_path = self._build_cpu_decoder(self.model, ends=True)
        if self.speculator is not None and self.speculator.draft is not None:
            self.draft_fast_path = self._build_cpu_decoder(self.speculator.draft.model)
            self.speculator.draft.fast_path = self.draft_fast_path

    def _graphs_wanted(self, num_groups: int) -> bool:
        """Whether decode steps are to run as CUDA graphs: on one GPU with the Triton
        attention (the torch backend's decode gathers every sequence's keys up to the
        captured max_model_len), not enforce_eager, one KV cache group, a model that starts
        at the embedding (not a later partition tier), and none of what runs eagerly: LoRA, a
        draft model, int8 layers whose range follows the batch; not the memory profile's
        throwaway cache either."""
        if self.device.type != "cuda":
            return False
        from pagedllm.layers.quantization import batch_dependent  # loaded where int8 is used

        layers = self.model_config.layer_range
        return (
            self.backend.name == "triton"
            and not self.enforce_eager
            and not self._profiling
            and num_groups == 1
            and self.world_size == 1
            and (layers is None or layers[0] == 0)
            and self.lora is None
            and self.speculator is None
            and not batch_dependent(self.model)
        )

    def _capture_graphs(self) -> None:
        """Capture the decode graphs; a capture that fails leaves every step eager (logged).
        Their memory comes from what gpu_memory_utilization leaves beside the KV cache."""
        # the scratch block exists only if graphs were wanted when the cache was allocated,
        # which takes a single KV cache group
        has_scratch = self.kv_caches[0][0].shape[0] > self.num_blocks
        if not (has_scratch and self._graphs_wanted(num_groups=1)):
            return
        sched = self.scheduler_config
        graphs = DecodeGraphs(
            self.model,
            capture_sizes(sched.max_num_seqs),
            sched.max_model_len,
            self.block_size,
            pad_slot=self.num_blocks * self.block_size,  # the scratch block's first slot
            device=self.device,
        )
        before = torch.cuda.memory_allocated(self.device)
        try:
            graphs.capture()
        except Exception:  # noqa: BLE001 - a step that cannot be captured still runs eagerly
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return
        mib = (torch.cuda.memory_allocated(self.device) - before) / 2**20
        logger.info("CUDA graphs hold %.1f MiB", mib)
        self.graphs = graphs

    def _gather_weights(self) -> None:
        """The weights as they are now (loaded, quantized, repacked) into huge-page memory
        (worker/huge_pages.py); those moved by an earlier call stay where they are."""
        start = time.perf_counter()
        models = [self.model]
        if self.speculator is not None and self.speculator.draft is not None:
            models.append(self.speculator.draft.model)
        moved = 0
        for model in models:
            caches = [
                cache
                for layer in model.attention_layers()
                for cache in (layer.key_cache, layer.value_cache)
                if cache is not None
            ]
            moved += gather_weights(model, leave=caches)
        if moved:  # the first touch of 2 MB pages can cost seconds a GiB (a VM's host)
            seconds, mib = time.perf_counter() - start, moved / 2**20
            logger.info(
                "weights on huge pages: %.1f MiB moved in %.2f s "
                "(PAGEDLLM_CPU_HUGE_PAGES=0 leaves them)", mib, seconds,
            )  # fmt: skip

    def _build_cpu_decoder(
        self, model: torch.nn.Module, ends: bool = False
    ) -> CpuFusedDecoder | None:
        """The fused decoder of model's layers; with ends (the runner's own model, every
        layer of it), also its embedding, final norm and LM head where they can join."""
        layers = model.model.layers
        decoder = CpuFusedDecoder.build(layers, self.dtype)
        if decoder is None:
            logger.info("fused CPU decoder off: %s", CpuFusedDecoder.why_not(layers, self.dtype))
        elif ends and self.model_config.layer_range is None:
            decoder.with_ends(ModelEnds.build(model, self.dtype))
        return decoder

    def ensure_kv_cache(self, num_blocks: int) -> None:
        """Allocate a cache of num_blocks unless the one allocated already has that many."""
        if self.num_blocks != num_blocks:
            self.allocate_kv_cache(num_blocks)

    def _allocate_draft_kv_cache(self, num_blocks: int) -> None:
        assert self.speculator is not None and self.speculator.draft is not None
        layers, heads, dim = self.speculator.draft.kv_cache_shape()
        shape = (num_blocks, self.block_size, heads, dim)
        views = self._zeroed(2 * layers * math.prod(shape)).view(layers, 2, *shape)
        caches = [(views[i, 0], views[i, 1]) for i in range(layers)]
        self.speculator.draft.bind_kv_cache(caches, self.backend, self.block_size)

    def _zeroed(self, numel: int) -> torch.Tensor:
        """A zero tensor of the cache's dtype; on the CPU backed by anonymous memory that the
        OS zeroes on first touch, so a multi-GiB cache costs nothing at start-up.

        The mapping is private: a shared one (``mmap``'s default) is shared memory in the
        kernel, and its first touch of a page cost 2.5 us against 1.6 us on a 2-core Zen 4
        guest, paid in the middle of the steps that first write each block (the shared-prefix
        workload's first round writes 25,000 pages). A forked worker gets a copy-on-write view
        rather than the parent's very pages."""
        if self.device.type != "cpu":
            return torch.zeros(numel, dtype=self.kv_dtype, device=self.device)
        nbytes = numel * torch.empty(0, dtype=self.kv_dtype).element_size()
        self._kv_buffer = private_memory(nbytes)  # kept alive as long as the cache
        return torch.frombuffer(self._kv_buffer, dtype=self.kv_dtype)

    # ---- one step ------------------------------------------------------------------------
    def prepare_input(self, out: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, logits_idx, sample_seqs, sample_rows, plp = [], [], [], [], [], []
        verify_seqs, verify_drafts, verify_rows = [], [], []
        for item in out.scheduled:
            seq, n, drafts = item.seq, item.num_new_tokens, item.spec_token_ids
            start = seq.num_computed_tokens
            if n == 1 and not drafts:  # a decoding sequence: no arrays for one token
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start : start + n - len(drafts)])
                ids.extend(drafts)
                positions.extend(range(start, start + n))
                slots.extend(_slots(seq.block_table, np.arange(start, start + n), bs).tolist())
            first = len(ids) - n
            if seq.sampling_params.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                count = min(n, seq.num_prompt_tokens - start)
                plp.append((seq, len(logits_idx), count))
                logits_idx.extend(range(first, first + count))
            if item.samples and drafts:  # logits after the last token and after each draft
                verify_seqs.append(seq)
                verify_drafts.append(drafts)
                verify_rows.extend(range(len(logits_idx), len(logits_idx) + len(drafts) + 1))
                logits_idx.extend(range(first + n - len(drafts) - 1, first + n))
            elif item.samples:
                sample_rows.append(len(logits_idx))
                logits_idx.append(first + n - 1)
                sample_seqs.append(seq)
            query_lens.append(n)
            seq_lens.append(start + n)
        tables = _padded_tables([item.seq.block_table for item in out.scheduled])
        on_device = self._on_device
        cu_seqlens = [0, *accumulate(query_lens)]
        metadata = AttentionMetadata.paged(
            query_start_loc=on_device(torch.tensor(cu_seqlens, dtype=torch.int32)),
            seq_lens=on_device(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=on_device(torch.from_numpy(tables)),
            slot_mapping=on_device(torch.tensor(slots, dtype=torch.long)),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        if self.kv_spec is not None and self.kv_spec.extra_groups:
            metadata.groups = self._group_metadata(out, metadata)
        return ModelInput(
            input_ids=on_device(torch.tensor(ids, dtype=torch.long)),
            positions=on_device(torch.tensor(positions, dtype=torch.long)),
            metadata=metadata,
            logits_indices=on_device(torch.tensor(logits_idx, dtype=torch.long)),
            sample_seqs=sample_seqs,
            sample_rows=sample_rows,
            prompt_logprob_rows=plp,
            grammar=out.grammar,
            verify_seqs=verify_seqs,
            verify_drafts=verify_drafts,
            verify_rows=verify_rows,
            lora_requests=self._lora_requests(out),
            # a count alone can mislead: a last prompt chunk with prompt logprobs lists its
            # last row twice, a chunk that does not sample lists none
            logits_all_rows=logits_idx == list(range(len(ids))),
        )

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor made by prepare_input, on the runner's device (as it is on the CPU)."""
        return t if self.device.type == "cpu" else t.to(self.device)

    def _group_metadata(
        self, out: SchedulerOutput, metadata: AttentionMetadata
    ) -> tuple[AttentionMetadata, ...]:
        """The step's metadata for KV cache groups 1..: the same batch over each group's
        block tables (seq.group_block_tables)."""
        assert self.kv_spec is not None
        bs = self.block_size
        starts = [item.seq.num_computed_tokens for item in out.scheduled]
        positions = [
            np.arange(start, start + item.num_new_tokens)
            for start, item in zip(starts, out.scheduled)
        ]
        result = []
        for g in range(len(self.kv_spec.extra_groups)):
            group_tables = [item.seq.group_block_tables[g] for item in out.scheduled]
            slots = [_slots(t, pos, bs) for t, pos in zip(group_tables, positions)]
            result.append(
                dataclasses.replace(
                    metadata,
                    batch=dataclasses.replace(
                        metadata.batch,
                        block_table=self._on_device(torch.from_numpy(_padded_tables(group_tables))),
                    ),
                    slot_mapping=self._on_device(torch.from_numpy(np.concatenate(slots))),
                )
            )
        return tuple(result)

    def _lora_requests(self, out: SchedulerOutput) -> list[Any] | None:
        if self.lora is None:
            return None
        return [item.seq.lora_request for item in out.scheduled]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.release(out.finished_seq_ids)
        inp = self.prepare_input(out)
        steps = self._steps_ahead(out)
        if steps > 1:
            return self._decode_ahead(inp, steps)
        hidden = self.forward(inp)
        if self.pooler is not None:
            self.pooler.observe(out, hidden)
        if self.speculator is not None:
            self.speculator.catch_up(inp)
        return self.compute_output(inp, hidden)

    def _steps_ahead(self, out: SchedulerOutput) -> int:
        """How many decode steps this schedule's batch runs (num_scheduler_steps): more than
        one where every sequence decodes one token greedily (Sampler.takes_argmax) on the fused
        decoder with the model's ends, as many as every sequence's blocks hold slots for and
        none passes its max_tokens or max_model_len (a stop token ends them early:
        _decode_ahead)."""
        steps = self.scheduler_config.num_scheduler_steps
        decoder = self.fast_path
        if steps == 1 or decoder is None or decoder.ends is None:
            return 1
        if self.pooler is not None or self.speculator is not None or out.grammar is not None:
            return 1
        bs, longest = self.block_size, self.scheduler_config.max_model_len
        for item in out.scheduled:
            seq = item.seq
            if item.num_new_tokens != 1 or item.spec_token_ids or not item.samples:
                return 1
            if not Sampler.takes_argmax(seq):
                return 1
            slots = len(seq.block_table) * bs - seq.num_computed_tokens
            steps = min(steps, slots, longest - seq.num_tokens)
            max_tokens = seq.sampling_params.max_tokens
            if max_tokens is not None:
                steps = min(steps, max_tokens - seq.num_output_tokens)
        return steps

    def _decode_ahead(self, inp: ModelInput, count: int) -> ModelOutput:
        """Up to `count` greedy decode steps of the batch in one go (_steps_ahead): each
        sequence's tokens, as as many schedules of one step would have sampled them. The steps
        end early after one that picks a sequence's stop token (EOS, stop_token_ids), where
        the next schedule drops that sequence."""
        assert self.fast_path is not None
        md = inp.metadata
        tables = [md.for_group(g).block_table for g in range(1 + len(md.groups))]
        steps = DecodeSteps.ahead(
            inp.positions, tables, md.batch.cu_seqlens_q, self.block_size, count
        )
        stops = [seq.stop_token_ids() for seq in inp.sample_seqs]
        width = max(map(len, stops))
        stop_ids = None
        if width:
            stop_ids = torch.tensor([row + [-1] * (width - len(row)) for row in stops])
        tokens = self.fast_path.decode_greedy(
            inp.input_ids, steps, self.model.model.get_input_embeddings, self.sampler.argmax,
            stop_ids,
        )  # fmt: skip
        self.num_decode_bursts += 1
        self.num_burst_steps += tokens.shape[0]
        sampled = {seq.seq_id: column for seq, column in zip(inp.sample_seqs, tokens.T.tolist())}
        return ModelOutput(sampled, {}, {})

    @torch.inference_mode()
    def forward(
        self,
        inp: ModelInput,
        hidden_states: torch.Tensor | None = None,
        layer_by_layer: bool = False,
    ) -> torch.Tensor:
        """The model over the step's tokens: [num_tokens, hidden]. A partition tier after the
        first passes the previous tier's hidden_states in place of the embedding.
        layer_by_layer calls every module (so forward hooks, e.g. the partition profiler's
        timers, see each layer) instead of the fast path."""
        self.prepare_lora(inp)
        if self.graphs is not None and hidden_states is None and not layer_by_layer:
            hidden = self.graphs.run(inp.input_ids, inp.positions, inp.metadata)
            if hidden is not None:
                return hidden
        with ForwardContext(inp.metadata):
            if self.fast_path is not None and not layer_by_layer:
                if self._logits_in_forward(inp, hidden_states):
                    rows = None if inp.logits_all_rows else inp.logits_indices
                    hidden, inp.logits = run_fused_logits(
                        self.model, self.fast_path, inp.input_ids, inp.positions, inp.metadata,
                        rows,
                    )  # fmt: skip
                    return hidden
                return run_fused(
                    self.model, self.fast_path, inp.input_ids, inp.positions, inp.metadata,
                    hidden_states,
                )  # fmt: skip
            if hidden_states is None:
                return self.model(inp.input_ids, inp.positions)
            return self.model(inp.input_ids, inp.positions, hidden_states)

    def _logits_in_forward(self, inp: ModelInput, hidden_states: torch.Tensor | None) -> bool:
        """Whether the fused decoder computes the step's logits too: it holds the model's
        ends, the step needs logits, and the hidden states are this model's own (no pooler
        reading them, no previous tier's input)."""
        assert self.fast_path is not None
        return (
            self.fast_path.ends is not None
            and hidden_states is None
            and self.pooler is None
            and inp.logits_indices.numel() > 0
        )

    def prepare_lora(self, inp: ModelInput) -> None:
        """Point the LoRA layers at this step's rows per adapter (loading adapters as needed)."""
        if self.lora is not None:
            requests = inp.lora_requests or [None] * len(inp.metadata.query_lens_cpu)
            self.lora.prepare(requests, inp.metadata.query_lens_cpu, self.device)

    @torch.inference_mode()
    def compute_output(self, inp: ModelInput, hidden: torch.Tensor) -> ModelOutput:
        """Logits where needed, prompt logprobs, the sampled tokens and the next drafts."""
        if inp.logits_indices.numel() == 0:
            return ModelOutput({}, {}, {})
        logits = inp.logits
        if logits is None:
            rows = hidden if inp.logits_all_rows else hidden[inp.logits_indices]
            logits = self.model.compute_logits(rows).float()
        out = ModelOutput({}, {}, self._prompt_logprobs(inp, logits))
        if inp.sample_seqs:
            rows = logits
            if len(inp.sample_rows) < logits.shape[0]:
                rows = logits[torch.tensor(inp.sample_rows, device=logits.device)]
            sampler_out = self.sampler(rows, inp.sample_seqs, inp.grammar)
            for seq, token, lp in zip(inp.sample_seqs, sampler_out.token_ids, sampler_out.logprobs):
                out.sampled[seq.seq_id] = [token]
                if lp is not None:
                    out.logprobs[seq.seq_id] = lp
        if self.speculator is not None:
            self._speculate(inp, logits, out)
        return out

    def _speculate(self, inp: ModelInput, logits: torch.Tensor, out: ModelOutput) -> None:
        """Verify this step's drafts, then propose the next step's."""
        assert self.speculator is not None
        if inp.verify_seqs:
            rows = logits[torch.tensor(inp.verify_rows, device=logits.device)]
            verified = self.speculator.verify(rows, inp.verify_seqs, inp.verify_drafts)
            for seq, tokens in zip(inp.verify_seqs, verified.token_ids):
                out.sampled[seq.seq_id] = tokens
        seqs = inp.sample_seqs + inp.verify_seqs
        out.spec_token_ids = self.speculator.propose(seqs, [out.sampled[s.seq_id] for s in seqs])

    def _prompt_logprobs(
        self, inp: ModelInput, logits: torch.Tensor
    ) -> dict[int, list[TokenLogprobs | None]]:
        """Logprobs of each prompt token given the tokens before it (for prompt_logprobs)."""
        result: dict[int, list[TokenLogprobs | None]] = {}
        for seq, row, count in inp.prompt_logprob_rows:
            start = seq.num_computed_tokens
            # logits at position p score token p + 1; only prompt tokens are reported here
            targets = seq.token_ids[start + 1 : min(start + 1 + count, seq.num_prompt_tokens)]
            count = min(count, len(targets))
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if count:
                lp = torch.log_softmax(logits[row : row + count], dim=-1)
                chosen = torch.tensor(targets[:count], device=lp.device)
                k = seq.sampling_params.prompt_logprobs or 0
                entries += gather_logprobs(lp, chosen, [k] * count, k)
            result[seq.seq_id] = entries[: seq.num_prompt_tokens - start]
        return result

    def release(self, seq_ids: list[int]) -> None:
        """Forget the per-sequence sampler state of finished sequences."""
        for seq_id in seq_ids:
            self.sampler.release(seq_id)
            if self.speculator is not None:
                self.speculator.release(seq_id)
