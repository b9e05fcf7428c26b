"""The KV cache's shape as the engine sees it (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVCacheGroup:
    """The attention layers that share one window, and their own block pool: a block of
    the group holds K and V of only its layers, so block bytes differ between groups."""

    num_blocks: int
    bytes_per_block: int  # K and V of the group's layers, one worker
    window_left: int | None  # keys its queries look back at most; None: the whole sequence


@dataclass(frozen=True)
class KVCacheSpec:
    """The one runtime record of the KV cache's layout: the block manager, the scheduler and
    the model runners all read block_size and num_blocks from here once it is sized."""

    num_blocks: int  # of group 0 (the only group of a model without mixed windows)
    block_size: int  # token slots per block
    bytes_per_block: int  # over all layers of one worker, K and V (group 0's layers)
    # Models mixing global and sliding-window layers: one entry per further group, its
    # layers' own block pool (see KVCacheGroup); empty for every other model.
    extra_groups: tuple[KVCacheGroup, ...] = ()
    group0_window: int | None = None  # group 0's window_left (None: global layers)

    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        """Every group, group 0 first, with its block count and window."""
        first = KVCacheGroup(self.num_blocks, self.bytes_per_block, self.group0_window)
        return (first, *self.extra_groups)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def split_kv_budget(
    budget: int, need: list[int], per_block: list[int], windowed: list[bool], max_seqs: int
) -> list[int]:
    """Block counts per KV cache group (group 0 global) for budget bytes: as many whole
    max-length sequences as fit (need: blocks one holds per group; at most max_seqs), each
    windowed group with one null block more. A budget below one such sequence gives every
    group the same count, as one pool for all layers would (every request that fits one
    pool still fits). Budget left over goes to the windowed groups (up to group 0's count),
    where it keeps released blocks cached for prefix hits."""
    budget -= sum(b for b, w in zip(per_block, windowed) if w)  # the null blocks
    seqs = min(budget / sum(n * b for n, b in zip(need, per_block)), float(max_seqs))
    counts = [int(seqs * n) for n in need]
    if seqs < 1:
        counts = [budget // sum(per_block)] * len(need)
    spare = budget - sum(c * b for c, b in zip(counts, per_block))
    windowed_bytes = sum(b for b, w in zip(per_block, windowed) if w)
    more = max(0, spare) // windowed_bytes if windowed_bytes else 0
    counts = [max(c, min(c + more, counts[0])) if w else c for c, w in zip(counts, windowed)]
    return [c + w for c, w in zip(counts, windowed)]


_INTERLEAVED = frozenset({"gemma2", "gemma3", "gemma3_text", "cohere2"})


def shared_window_left(hf_config: Any) -> int | None:
    """The keys every attention layer looks back at most (flash-attn's window_size[0]), or
    None when some layer sees the whole sequence. The per-layer rule is the models' own:
    ``layer_types`` when the config has them, else ``sliding_window`` on every layer unless
    ``use_sliding_window`` is false."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window - 1 if all(t == "sliding_attention" for t in layer_types) else None
    # Interleaved families that name their global layers some other way: never release.
    interleaved = getattr(hf_config, "model_type", None) in _INTERLEAVED
    if interleaved or getattr(hf_config, "sliding_window_pattern", None) is not None:
        return None
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return window - 1
