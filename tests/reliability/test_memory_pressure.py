"""Memory pressure: a KV cache far smaller than the load preempts again and again, yet every
request ends with the greedy output it has on a roomy cache; a request that could never fit
the whole cache is refused up front instead of preempting itself forever."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers.engine import BLOCK_BYTES, assert_no_leak, engine_args, run_to_end
from helpers.generation import GREEDY, greedy_params

from pagedllm.engine.llm_engine import LLMEngine

BLOCKS = 8  # 128 token slots
# 12 requests of 30-70 tokens each: about 600 slots of work for 128 slots of cache.
LOAD = [([(13 * i + j) % 290 + 20 for j in range(10 + 3 * i)], 20 + 2 * i) for i in range(12)]


def tight_engine(model, **overrides) -> LLMEngine:  # noqa: ANN001
    args = engine_args(model, kv_cache_memory_bytes=BLOCKS * BLOCK_BYTES, **overrides)
    engine = LLMEngine.from_engine_args(args)
    assert engine.kv_cache.num_blocks == BLOCKS
    return engine


def run(engine: LLMEngine) -> dict[str, list[int]]:
    for i, (prompt, max_tokens) in enumerate(LOAD):
        engine.add_request(f"r{i}", prompt, greedy_params(max_tokens))
    return run_to_end(engine)


@pytest.fixture(scope="module")
def roomy_outputs(tiny_llama) -> dict[str, list[int]]:
    return run(LLMEngine.from_engine_args(engine_args(tiny_llama)))


def test_repeated_preemption_keeps_greedy_outputs(tiny_llama, roomy_outputs) -> None:
    engine = tight_engine(tiny_llama)
    outputs = run(engine)
    assert outputs == roomy_outputs
    assert engine.scheduler.num_preemptions >= 5  # preempted again and again
    assert_no_leak(engine)


def test_request_that_never_fits_is_refused_up_front(tiny_llama) -> None:
    engine = tight_engine(tiny_llama, max_model_len=256)
    prompt = [5] * 100
    engine.add_request("fits", prompt, greedy_params(29))  # 128 tokens: the last one takes no slot
    for max_tokens in (30, None):  # 129 slots; up to max_model_len (256)
        with pytest.raises(ValueError, match="can never fit the KV cache"):
            engine.add_request("too-long", prompt, greedy_params(max_tokens))
    with pytest.raises(ValueError, match="can never fit the KV cache"):
        engine.add_request("too-long", [5] * 200, greedy_params(1))
    # refused in add_request itself: nothing of them reached the scheduler
    assert list(engine.requests) == ["fits"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["fits"]
    assert len(run_to_end(engine)["fits"]) == 29  # the boundary case runs to the end, alone
    assert_no_leak(engine)


def test_pressure_over_http(serve, tiny_llama, roomy_outputs) -> None:
    args = engine_args(tiny_llama, kv_cache_memory_bytes=BLOCKS * BLOCK_BYTES, max_model_len=256)
    server = serve(args)

    async def complete(client: httpx.AsyncClient, i: int) -> list[int]:
        prompt, max_tokens = LOAD[i]
        body = {"prompt": prompt, "max_tokens": max_tokens, "logprobs": 0, **GREEDY}
        r = await client.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == max_tokens
        return tokens

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(complete(client, i) for i in range(len(LOAD))))

    texts = asyncio.run(main())
    tokenizer = server.engine.get_tokenizer()
    expected = [[tokenizer.decode([t]) for t in roomy_outputs[f"r{i}"]] for i in range(len(LOAD))]
    assert texts == expected
    assert server.on_engine(lambda e: e.scheduler.num_preemptions) >= 5
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": [5] * 100, "max_tokens": 100}, timeout=30
    )
    assert r.status_code == 400 and "can never fit" in r.json()["error"]["message"]
    server.wait_idle()
