"""Faults for the tests to inject, and ``pagedllm serve`` with them installed (run as a script):

    python fault_server.py STEP_DELAY serve MODEL [serve flags...]

Every model step then sleeps STEP_DELAY seconds (requests stay in flight long enough to be
drained), and a step holding a prompt that starts with token POISON corrupts the block
accounting and raises: the engine's state is unknown and it must stop serving.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from pagedllm.core.scheduler import Scheduler, SchedulerOutput

POISON = 3  # first prompt token of the requests that trigger a fault


def poisoned(out: SchedulerOutput) -> bool:
    return any(item.seq.prompt_token_ids[:1] == [POISON] for item in out.scheduled)


def corrupt_and_raise(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Leak a reference to a block of the step (as a half-done update would), then raise."""
    seq = next(item.seq for item in out.scheduled if item.seq.block_table)
    scheduler.block_manager.blocks[seq.block_table[0]].ref_cnt += 1
    raise RuntimeError("injected fault: the block accounting is corrupt")


def install(step_delay: float) -> None:
    from pagedllm.worker.executor import UniProcExecutor

    execute_model, update = UniProcExecutor.execute_model, Scheduler.update

    def slow_execute(self: UniProcExecutor, out: SchedulerOutput) -> Any:
        time.sleep(step_delay)
        return execute_model(self, out)

    def faulty_update(self: Scheduler, out: SchedulerOutput, sampled: dict[int, int]) -> Any:
        if poisoned(out):
            corrupt_and_raise(self, out)
        return update(self, out, sampled)

    UniProcExecutor.execute_model = slow_execute  # type: ignore[method-assign]
    Scheduler.update = faulty_update  # type: ignore[method-assign]


if __name__ == "__main__":
    install(float(sys.argv[1]))
    from pagedllm.entrypoints.cli import main

    sys.exit(main(sys.argv[2:]))
