"""Processes of a tensor-parallel engine: a dying worker, and two nodes meeting at a port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.generation import random_prompts
from helpers.oracle import hf_greedy
from helpers.tp import BASE, generate_both_ways

from pagedllm import LLM

_KILL_SCRIPT = """
import os, signal, sys, threading, time
from pagedllm import LLM, SamplingParams

def errors(engine, deadline):
    # step until every request is done; (error message, tokens made) of those that failed
    found = []
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        found += [(o.error, len(o.outputs[0].token_ids)) for o in engine.step() if o.error]
    return found

if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", block_size=4,
              kv_cache_memory_bytes=1 << 20)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), [5 + i] * 8, params)
    for _ in range(3):
        engine.step()
    pid = engine.executor.worker_pids[1]
    threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
    found = errors(engine, time.monotonic() + 60)
    most = max((n for _, n in found), default=0)
    print(f"{len(found)} FAILED, at most {most} tokens made: {[e for e, _ in found][:1]}")
    engine.add_request("later", [7] * 8, params)  # the engine stays failed, it does not hang
    print(f"LATER {[e for e, _ in errors(engine, time.monotonic() + 60)][:1]}")
    engine.shutdown()
"""


def _python(script: str, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def test_killed_worker_fails_the_running_requests_and_exit_is_clean(tiny_llama):
    proc = _python(_KILL_SCRIPT, str(tiny_llama))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    failed = next(ln for ln in out.splitlines() if " FAILED, " in ln)
    assert failed.startswith("4 FAILED")  # every running request ends with an error
    assert int(failed.split()[4]) < 400  # ended by the failure, not by running to its end
    assert "rank 1" in failed and "killed by signal 9" in failed
    later = next(ln for ln in out.splitlines() if ln.startswith("LATER"))
    assert "rank 1" in later
    assert "terminate called" not in err  # no abort from a dangling process group at exit


_NODE1_SCRIPT = """
import sys
from pagedllm import LLM

LLM(sys.argv[1], tensor_parallel_size=2, nnodes=2, node_rank=1, dtype="float32",
    block_size=4, kv_cache_memory_bytes=1 << 20)
print("node 1 returned from LLM()")  # never: a worker node exits when the engine stops
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_at_master_port(model_factory):
    model_dir = model_factory("mistral")
    port = _free_port()
    # node 1 finds the rendezvous through the environment, node 0 through its flags; node 1
    # imports helpers.tp to run the collective_rpc functions
    node1 = _python(
        _NODE1_SCRIPT,
        str(model_dir),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), *sys.path]),  # helpers
    )
    try:
        llm = LLM(str(model_dir), tensor_parallel_size=2, nnodes=2, master_port=port, **BASE)
        prompts = random_prompts(4, 1, 30, seed=5)
        assert generate_both_ways(llm, prompts, 8) == hf_greedy(model_dir, prompts, 8)
        assert llm.llm_engine.executor.worker_pids == {}  # rank 1 is the other node's
        llm.llm_engine.shutdown()
        out, err = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 0, err[-2000:]
    assert "returned" not in out
