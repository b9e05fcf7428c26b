"""KV memory of an 8k-token request on sliding-window models, before and after the block
manager releases blocks that left the window (counts of blocks and bytes, not times).

The real Scheduler and BlockManager run the requests step by step with the model replaced by
a fixed sampled token (torch-free, so the machine's load does not change a figure):

one request of 8064 prompt tokens + 128 generated (8192 tokens): the most KV bytes it held
at once (during chunked prefill, whose 2048-token chunks reach a window back) and at its last
decode step; how many such requests a 32 GiB KV budget holds at either figure.

Mistral-style: every layer windowed, so the build releases blocks. Gemma-3-style (5 of 6
layers local): the global layers read every block through the same block table, so the build
releases nothing; the "per-group" row is what separate block tables for the local layers
would hold (computed from the same one-request simulations, not built).

    PYTHONPATH=src python3 benchmarks/sliding_window_memory.py
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
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


def scheduler(num_blocks: int, window_left: int | None) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=256,
        max_num_batched_tokens=CHUNK,
        max_model_len=PROMPT + OUTPUT,
        enable_chunked_prefill=True,
    )
    return Scheduler(config, BlockManager(num_blocks, BLOCK, False, window_left=window_left))


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


def row(name: str, label: str, peak: int, last: int) -> str:
    return (
        f"| {name} | {label} | {peak / GiB:.3f} GiB | {last / GiB:.3f} GiB "
        f"| {BUDGET // peak} | {BUDGET // last} |"
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
        built = one_request(model.build_window_left)
        print(row(model.name, "every block (before)", full[0] * per_block, full[1] * per_block))
        print(row(model.name, "this build", built[0] * per_block, built[1] * per_block))
        if model.build_window_left is None:  # mixed: what per-group tables would hold
            local = one_request(model.window - 1)
            glob = model.bytes_per_block(model.layers - model.local_layers)
            loc = model.bytes_per_block(model.local_layers)
            label = "per-group tables (projected, not built)"
            print(
                row(
                    model.name,
                    label,
                    full[0] * glob + local[0] * loc,
                    full[1] * glob + local[1] * loc,
                )
            )


if __name__ == "__main__":
    main()
