"""The six examples of docs/examples.md run as written (the user's snippets, on the demo model).

Every ```python block of the page runs in order in one namespace, from the repository root;
the tensor-parallel example (section 3) runs in 8 gloo ranks, each executing that section's
blocks. Each section's result is then checked, so a block that runs but does nothing fails.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "examples.md"
TP_RANKS = 8


def sections() -> dict[str, list[str]]:
    """Section number -> its python blocks, in page order."""
    found: dict[str, list[str]] = {}
    for part in re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]:
        number = part.split(".", 1)[0]
        found[number] = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    return found


def test_page_has_the_six_examples():
    assert sorted(sections()) == ["1", "2", "3", "4", "5", "6"]
    assert all(sections().values())


def test_examples_run_as_written(monkeypatch):
    monkeypatch.chdir(ROOT)  # the snippets name the demo model by its relative path
    ns: dict[str, object] = {}
    for number, blocks in sections().items():
        if number == "3":
            continue  # needs 8 ranks: test_tensor_parallel_example
        for block in blocks:
            exec(compile(block, f"{PAGE}#{number}", "exec"), ns)

    # 1: an engine with the asked block size and prefix caching
    engine = ns["llm_engine"]
    assert engine.kv_cache.block_size == 64 and engine.block_manager.enable_prefix_caching
    # 2: attention output of the packed qkv's shape
    assert ns["out"].shape == (300, 4, 64) and torch.isfinite(ns["out"]).all()
    # 4: the gauge holds the value
    assert b"pagedllm:kv_cache_hit_rate 0.93" in ns["monitor"].render()
    # 5: the engine's own model now runs int8, except the excluded projections
    done = ns["quantized_model"]
    assert done and not any(name.endswith("self_attn.o_proj") for name in done)
    from pagedllm import SamplingParams

    engine.add_request("after-int8", "The list type", SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 4
    # 6: a plan with a cut inside the model
    plan = ns["partition_plan"]
    assert 0 < plan.cuts[0] < ns["exported_graph"].num_layers


def _tp_rank(rank: int, port: int, results: multiprocessing.Queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP_RANKS)
    ns: dict[str, object] = {"torch": torch}
    for block in sections()["3"]:
        exec(block, ns)
    results.put((rank, ns["tensor"][:2].tolist(), ns["comm"].num_async))
    dist.destroy_process_group()


def test_tensor_parallel_example():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # torch is loaded once, in this process
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, results)) for r in range(TP_RANKS)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    total = float(sum(range(1, TP_RANKS + 1)))  # each rank contributed rank + 1
    assert got == [(r, [total, total], 1) for r in range(TP_RANKS)]
