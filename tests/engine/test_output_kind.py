"""SamplingParams.output_kind: what each RequestOutput carries, step by step (vLLM's
RequestOutputKind), through the engine's own loop."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

PROMPTS = ["The quick brown", "A tiny model"]


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(
        str(model_factory("llama")), dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20
    )


def run_steps(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list]:
    """Every step's outputs, requests added straight to the engine (as a server does)."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"kind-{params.output_kind.name}-{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def finals(steps: list[list]) -> dict[str, object]:
    return {out.request_id.rsplit("-", 1)[1]: out for step in steps for out in step if out.finished}


def params(kind: RequestOutputKind, **extra: object) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=kind, **extra
    )


def test_cumulative_reports_everything_so_far_after_every_step(llm):
    steps = run_steps(llm, params(RequestOutputKind.CUMULATIVE))
    for i in range(len(PROMPTS)):
        seen = [
            out.outputs[0].token_ids
            for step in steps
            for out in step
            if out.request_id.endswith(f"-{i}")
        ]
        assert [len(t) for t in seen] == list(range(1, 13))  # one output a step, growing
        assert all(seen[k] == seen[-1][: k + 1] for k in range(len(seen)))


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2, "prompt_logprobs": 1}, {"n": 2}])
def test_delta_outputs_add_up_to_the_cumulative_result(llm, extra):
    whole = finals(run_steps(llm, params(RequestOutputKind.CUMULATIVE, **extra)))
    steps = run_steps(llm, params(RequestOutputKind.DELTA, **extra))
    for key, final in whole.items():
        outs = [out for step in steps for out in step if out.request_id.endswith(f"-{key}")]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        for index, completion in enumerate(final.outputs):
            parts = [c for o in outs for c in o.outputs if c.index == index]
            assert all(len(c.token_ids) <= 1 for c in parts)  # one token a step, or none
            assert sum((c.token_ids for c in parts), []) == completion.token_ids
            assert "".join(c.text for c in parts) == completion.text
            if completion.logprobs is not None:
                assert sum((c.logprobs for c in parts), []) == completion.logprobs
                assert parts[-1].cumulative_logprob == completion.cumulative_logprob
        if final.prompt_logprobs is not None:  # with the first output only
            assert outs[0].prompt_logprobs == final.prompt_logprobs
            assert all(o.prompt_logprobs is None for o in outs[1:])


def test_delta_text_holds_back_a_partial_stop_string_like_cumulative(llm):
    full = finals(run_steps(llm, params(RequestOutputKind.CUMULATIVE)))["0"].outputs[0].text
    stop = full[4:7]
    cut = finals(run_steps(llm, params(RequestOutputKind.CUMULATIVE, stop=[stop])))["0"]
    steps = run_steps(llm, params(RequestOutputKind.DELTA, stop=[stop]))
    parts = [o.outputs[0].text for s in steps for o in s if o.request_id.endswith("-0")]
    assert cut.outputs[0].stop_reason == stop
    assert "".join(parts) == cut.outputs[0].text == full[: full.index(stop)]


@pytest.mark.parametrize("n", [1, 2])
def test_final_only_returns_nothing_until_the_request_ends(llm, n):
    whole = finals(run_steps(llm, params(RequestOutputKind.CUMULATIVE, n=n)))
    steps = run_steps(llm, params(RequestOutputKind.FINAL_ONLY, n=n))
    outs = [out for step in steps for out in step]
    assert len(steps) >= 12 and len(outs) == len(PROMPTS)  # one output per request, in all
    assert all(out.finished for out in outs)
    for key, out in finals(steps).items():
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in whole[key].outputs]
        assert [c.text for c in out.outputs] == [c.text for c in whole[key].outputs]


def test_generate_runs_final_only_and_leaves_the_callers_params_alone(llm):
    mine = params(RequestOutputKind.CUMULATIVE)
    engine = llm.llm_engine
    step = engine.step
    returned: list[int] = []

    def counting_step():
        outs = step()
        returned.append(len(outs))
        return outs

    engine.step = counting_step
    try:
        outs = llm.generate(PROMPTS, mine, use_tqdm=False)
    finally:
        del engine.step
    assert mine.output_kind == RequestOutputKind.CUMULATIVE
    assert sum(returned) == len(PROMPTS) and len(returned) >= 12  # the finals, nothing else
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    steps = run_steps(llm, mine)  # the engine itself still reports every step
    assert sum(len(s) for s in steps) == 12 * len(PROMPTS)
