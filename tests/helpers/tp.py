"""Tensor-parallel test helpers (the rpc functions run on every rank via collective_rpc)."""

from __future__ import annotations

from helpers.generation import greedy
from pagedllm import LLM

BASE = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)


def async_reduces(runner) -> int:  # noqa: ANN001 - runs on every rank via collective_rpc
    return runner.model.model.layers[0].self_attn.o_proj.comm.num_async


def parameter_shapes(runner) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
    """Each parameter's shape; a linear weight kept in panels reports its plain [N, K]."""
    from pagedllm.layers.panel_gemm import unpack

    shapes = {name: tuple(p.shape) for name, p in runner.model.named_parameters()}
    for name, module in runner.model.named_modules():
        panels = getattr(module, "weight_panels", None)
        if panels is not None:
            shapes[f"{name}.weight"] = tuple(unpack(panels).shape)
    return shapes


def generate_both_ways(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens with overlap on, then off; asserts both agree and overlap really ran."""
    executor = llm.llm_engine.executor
    executor.overlap_min_tokens = 2  # split every step of two sequences or more, decode too
    results = []
    for overlap in (True, False):
        executor.comm_overlap = overlap
        before = executor.collective_rpc(async_reduces)
        results.append(greedy(llm, prompts, max_tokens))
        issued = [a - b for a, b in zip(executor.collective_rpc(async_reduces), before)]
        assert all(n > 0 for n in issued) if overlap else issued == [0, 0]
    assert results[0] == results[1]
    return results[0]
