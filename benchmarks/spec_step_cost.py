"""Step cost behind benchmarks/results/speculative.md: CPU time of one 125M forward at
batch 1 over a 160-token context: 1 query token (decode)
vs 5 (a verify step with 4 drafts), logits at every query row."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.core.sequence import Sequence

sys.path.insert(0, str(Path(__file__).parent))
from common import default_model_dir  # noqa: E402

llm = LLM(str(default_model_dir()), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 28)
runner = llm.llm_engine.executor.runner
params = SamplingParams(temperature=0.0, max_tokens=8)
seq = Sequence(10**6, "x", 0, list(range(3, 163)), params, None)
seq.block_table = list(range(12))
runner.execute(SchedulerOutput([ScheduledSequence(seq, 160)], 160))  # prefill the cache
for q in (1, 5, 1, 5):
    seq.num_computed_tokens = 160 - q
    out = SchedulerOutput([ScheduledSequence(seq, q)], q)
    inp = runner.prepare_input(out)
    runner.compute_output(inp, runner.forward(inp))
    cpu = time.process_time()
    for _ in range(10):
        inp = runner.prepare_input(out)
        runner.compute_output(inp, runner.forward(inp))
    per_forward = 1e3 * (time.process_time() - cpu) / 10
    print(f"query tokens {q}: {per_forward:.1f} CPU ms per forward", flush=True)
