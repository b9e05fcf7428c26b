"""KV memory of an 8k-token request on sliding-window models, before and after the block
manager releases blocks that left the window (counts of blocks and bytes, not times).

The real Scheduler and BlockManager run the requests step by step with the model replaced by
a fixed sampled token (torch-free, so the machine's load does not change a figure):

one request of 8064 prompt tokens + 128 generated (8192 tokens): the most KV bytes it held
at once (during chunked prefill, whose 2048-token chunks reach a window back) and at its last
decode step; how many such requests a 32 GiB KV budget holds at either figure.

Mistral-style: every layer windowed, so one block manager releases blocks. Gemma-3-style
(5 of 6 layers local): one block pool per KV cache group (GroupedBlockManager), the global
layers' blocks all kept, the local layers' released past their window; "fit" there is what
the pools that split_kv_budget sizes for this budget hold (the smaller of the two groups'
counts).

    PYTHONPATH=src python3 benchmarks/sliding_window_memory.py
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_cache import KVCacheGroup, split_kv_budget
from pagedllm.core.kv_groups import GroupedBlockManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence
from pagedllm.sampling_params import SamplingParams

BLOCK = 16
PROMPT, OUTPUT = 8064, 128
CHUNK = 2048
BUDGET = 32 << 30
GiB = 1 << 30


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    local_layers: int  # sliding-window layers; the rest see the whole sequence
    kv_heads: int
    head_dim: int
    window: int

    def bytes_per_block(self, layers: int) -> int:  # K and V, bf16
        return 2 * layers * self.kv_heads * self.head_dim * 2 * BLOCK

    @property
    def build_window_left(self) -> int | None:
        return self.window - 1 if self.local_layers == self.layers else None


MODELS = [
    Model("Mistral-7B-style (32 layers, 8 KV heads x 128, window 4096)", 32, 32, 8, 128, 4096),
    Model(
        "Gemma-3-4B-style (34 layers, 5 of 6 local, 4 KV heads x 256, window 1024)",
        34,
        29,
        4,
        256,
        1024,
    ),
]


CONFIG = SchedulerConfig(
    max_num_seqs=256,
    max_num_batched_tokens=CHUNK,
    max_model_len=PROMPT + OUTPUT,
    enable_chunked_prefill=True,
)


def scheduler(num_blocks: int, window_left: int | None) -> Scheduler:
    return Scheduler(CONFIG, BlockManager(num_blocks, BLOCK, False, window_left=window_left))


def request(seq_id: int) -> Sequence:
    prompt = [(seq_id * 7919 + i) % 30000 + 3 for i in range(PROMPT)]
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, params, eos_token_id=None)


def one_request(window_left: int | None) -> tuple[int, int]:
    """Run one request to its end: (most blocks it held at once, blocks at its last step)."""
    sched = scheduler(1 << 20, window_left)
    seq = request(0)
    sched.add(seq)
    null = sched.block_manager.null_block_id
    most = last = 0
    while sched.num_unfinished:
        out = sched.schedule()
        last = sum(b != null for b in seq.block_table)
        most = max(most, last)
        sched.update(out, {s.seq.seq_id: [5] for s in out.scheduled if s.samples})
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    return most, last


def grouped_request(model: Model) -> tuple[list[int], list[int], int]:
    """One request through a global and a sliding group: (most blocks held per group, blocks
    per group at its last step, most bytes held at once)."""
    per_block = [model.bytes_per_block(model.layers - model.local_layers)]
    per_block.append(model.bytes_per_block(model.local_layers))
    groups = [
        KVCacheGroup(1 << 20, per_block[0], None),
        KVCacheGroup(1 << 20, per_block[1], model.window - 1),
    ]
    bm = GroupedBlockManager(groups, BLOCK, False)
    sched = Scheduler(CONFIG, bm)
    seq = request(0)
    sched.add(seq)
    most, last, peak = [0, 0], [0, 0], 0
    while sched.num_unfinished:
        out = sched.schedule()
        last = [sum(b != g.null_block_id for b in g.table(seq)) for g in bm.groups]
        most = [max(m, n) for m, n in zip(most, last)]
        peak = max(peak, sum(n * b for n, b in zip(last, per_block)))
        sched.update(out, {s.seq.seq_id: [5] for s in out.scheduled if s.samples})
        sched.check_integrity()
    assert bm.groups[0].num_released_blocks == 0 and bm.groups[1].num_released_blocks > 0
    return most, last, peak


def grouped_fit(model: Model, held: list[int]) -> int:
    """Requests holding held blocks per group that the budget's grouped pools fit at once."""
    full = -(-(PROMPT + OUTPUT) // BLOCK)
    need = [full, min(full, -(-(model.window - 1 + CHUNK) // BLOCK) + 1)]
    per_block = [model.bytes_per_block(model.layers - model.local_layers)]
    per_block.append(model.bytes_per_block(model.local_layers))
    counts = split_kv_budget(BUDGET, need, per_block, [False, True], CONFIG.max_num_seqs)
    return min(counts[0] // held[0], (counts[1] - 1) // held[1])


def row(name: str, label: str, peak: int, last: int, fits: tuple[int, int] | None = None) -> str:
    fit_peak, fit_last = fits if fits is not None else (BUDGET // peak, BUDGET // last)
    return (
        f"| {name} | {label} | {peak / GiB:.3f} GiB | {last / GiB:.3f} GiB "
        f"| {fit_peak} | {fit_last} |"
    )


def main() -> None:
    print(
        f"request: {PROMPT} prompt + {OUTPUT} generated tokens; block {BLOCK}; chunks of "
        f"{CHUNK}; bf16; budget {BUDGET / GiB:.0f} GiB\n"
    )
    print("| model | KV blocks held | peak / request | at last step | fit (peak) | fit (last) |")
    print("|---|---|---:|---:|---:|---:|")
    for model in MODELS:
        per_block = model.bytes_per_block(model.layers)
        full = one_request(None)
        print(row(model.name, "every block (before)", full[0] * per_block, full[1] * per_block))
        if model.build_window_left is not None:
            built = one_request(model.build_window_left)
            print(row(model.name, "this build", built[0] * per_block, built[1] * per_block))
            continue
        most, last, peak = grouped_request(model)  # mixed: a block pool per group
        glob = model.bytes_per_block(model.layers - model.local_layers)
        loc = model.bytes_per_block(model.local_layers)
        fits = (grouped_fit(model, most), grouped_fit(model, last))
        label = f"this build: per-group pools (global {most[0]}, local {most[1]} blocks at most)"
        print(row(model.name, label, peak, last[0] * glob + last[1] * loc, fits))


if __name__ == "__main__":
    main()
