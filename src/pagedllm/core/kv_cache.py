"""The KV cache's shape as the engine sees it (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """The one runtime record of the KV cache's layout: the block manager, the scheduler and
    the model runners all read block_size and num_blocks from here once it is sized."""

    num_blocks: int
    block_size: int  # token slots per block
    bytes_per_block: int  # over all layers of one worker, K and V

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
