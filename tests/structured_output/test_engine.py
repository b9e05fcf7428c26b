"""Constrained generation through the engine: every output obeys its constraint, in batches
that mix constrained and free requests, across preemption, prefix-cache hits and n > 1."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

DEMO = Path(__file__).resolve().parents[2] / "models" / "pagedllm-demo"

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 8},
        "vals": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
        },
    },
    "required": ["id", "tag", "ok", "name"],
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
EBNF = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]?'
EBNF_RE = r"\(\d{1,2}(\+\d{1,2}){0,3}\)"


def so(**fields) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)


def check(params: StructuredOutputsParams, text: str) -> None:
    """The output obeys the constraint (the oracle is independent of the grammar engine)."""
    kind = params.kind
    if kind == "json":
        jsonschema.validate(json.loads(text), params.schema_dict())
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(params.regex, text), text
    elif kind == "choice":
        assert text in params.choice
    else:
        assert re.fullmatch(EBNF_RE, text), text


def tiny_llm(model_dir: Path, **kwargs) -> LLM:
    args = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20)
    args.update(kwargs)
    return LLM(str(model_dir), **args)


def prompts(n: int, seed: int, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    head = shared or []
    return [head + [rng.randrange(3, 320) for _ in range(rng.randint(4, 12))] for _ in range(n)]


CONSTRAINTS = [
    so(json=SCHEMA, disable_any_whitespace=True),
    so(json=json.dumps(SCHEMA)),
    so(regex=REGEX),
    so(choice=CHOICES),
    so(grammar=EBNF),
]


def test_mixed_batch_obeys_every_constraint(tiny_llama):
    llm = tiny_llm(tiny_llama)
    ps = prompts(len(CONSTRAINTS) + 2, seed=1)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=c)
        for i, c in enumerate(CONSTRAINTS)
    ] + [free, free]
    outs = llm.generate(ps, params, use_tqdm=False)
    for p, out in zip(params, outs):
        comp = out.outputs[0]
        if p.structured_outputs is None:
            continue
        assert comp.finish_reason == "stop", comp.text
        check(p.structured_outputs, comp.text)
    # Free requests next to constrained ones produce what they produce alone.
    alone = llm.generate(ps[-2:], free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[-2:]] == [o.outputs[0].token_ids for o in alone]
    stats = llm.llm_engine.structured.stats
    assert stats.num_masks > 0 and llm.llm_engine.structured.num_active == 0
    llm.llm_engine.check_integrity()


def _greedy_constrained(llm: LLM, ps: list[list[int]]) -> list[str]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=250, structured_outputs=CONSTRAINTS[i % 5])
        for i in range(len(ps))
    ]
    outs = llm.generate(ps, params, use_tqdm=False)
    texts = []
    for p, out in zip(params, outs):
        assert out.outputs[0].finish_reason == "stop"
        check(p.structured_outputs, out.outputs[0].text)
        texts.append(out.outputs[0].text)
    llm.llm_engine.check_integrity()
    return texts


def test_preemption_and_prefix_hits_keep_the_grammar_state(tiny_llama):
    shared = prompts(1, seed=2)[0] * 3  # a common prefix of several full blocks
    ps = prompts(12, seed=3, shared=shared)
    roomy = tiny_llm(tiny_llama)
    _greedy_constrained(roomy, ps[:1])  # caches the shared prefix for the batch
    expected = _greedy_constrained(roomy, ps)
    assert roomy.llm_engine.scheduler.num_preemptions == 0
    assert roomy.llm_engine.block_manager.prefix_cache_hits > 0
    # 70 blocks of 4 slots (2 KiB each) hold 280 tokens: less than twelve sequences need.
    tight = tiny_llm(tiny_llama, kv_cache_memory_bytes=70 * 2048)
    _greedy_constrained(tight, ps[:1])
    got = _greedy_constrained(tight, ps)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert tight.llm_engine.block_manager.prefix_cache_hits > 0
    assert got == expected  # recompute resumed each matcher where it stood


def test_n_samples_each_follow_the_schema(tiny_llama):
    llm = tiny_llm(tiny_llama)
    c = CONSTRAINTS[0]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=200, structured_outputs=c)
    out = llm.generate(prompts(1, seed=4), params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for comp in out.outputs:
        assert comp.finish_reason == "stop"
        check(c, comp.text)
    assert len({comp.text for comp in out.outputs}) > 1  # each sample has its own matcher


@pytest.mark.parametrize(
    "constraint, words",
    [
        (so(json={"type": "object", "properties": {"a": {"type": 5}}}), "json"),
        (so(regex="[a-"), "regex"),
        (so(grammar="root ::= undefined_rule"), "grammar"),
    ],
)
def test_invalid_constraint_is_a_value_error_not_a_crashed_step(tiny_llama, constraint, words):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=1 << 20)
    )
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match=f"structured_outputs.{words}"):
        engine.add_request("bad", [5, 6, 7], SamplingParams(structured_outputs=constraint))
    assert "bad" not in engine.requests
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok"]
    assert len(finished[0].outputs[0].token_ids) == 3


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="demo model absent")
def test_demo_model_mixed_batch():
    llm = LLM(str(DEMO), kv_cache_memory_bytes=64 << 20)
    # Compact JSON only: greedy, this model fills every whitespace gap to the cap.
    constraints = [c for c in CONSTRAINTS if c.kind != "json" or c.disable_any_whitespace]
    constraints.append(so(json_object=True, disable_any_whitespace=True))
    params = [
        SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=c) for c in constraints
    ] + [SamplingParams(temperature=0.0, max_tokens=16)]
    outs = llm.generate(["A dictionary is"] * len(params), params, use_tqdm=False)
    for p, out in zip(params[:-1], outs):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        check(p.structured_outputs, out.outputs[0].text)
    assert outs[-1].outputs[0].finish_reason == "length"


def test_tensor_parallel_constrains_on_rank_zero(tiny_llama):
    ps = prompts(5, seed=6)
    one = _greedy_constrained(tiny_llm(tiny_llama), ps)
    tp = tiny_llm(tiny_llama, tensor_parallel_size=2)
    try:
        assert _greedy_constrained(tp, ps) == one
        assert tp.llm_engine.structured.stats.num_masks > 0
    finally:
        tp.llm_engine.shutdown()
