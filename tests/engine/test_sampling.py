"""Sampling semantics through the engine: seeds, stop strings, logprobs, errors."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.engine import on_call, patch_execute_model

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(
        str(model_factory("llama")), dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 20
    )


def test_seeded_requests_repeat_and_differ_by_seed(llm):
    prompt = [5, 6, 7, 8]
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=12, ignore_eos=True)
    a = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [[9, 10, 11], [12, 13]]
    b = llm.generate([prompt, *others], p, use_tqdm=False)[0].outputs[0].token_ids
    c = llm.generate(
        [prompt],
        SamplingParams(temperature=1.0, seed=124, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert a == b
    assert c[0].outputs[0].token_ids != a


def test_stop_string_cuts_text_and_sets_reason(llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["The quick"], params, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.generate(
        ["The quick"],
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(
        ["The quick"],
        SamplingParams(
            temperature=0.0,
            max_tokens=30,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    full = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = full[4]
    first = full.index(stop_tok)
    out = llm.generate(
        [[5, 6, 7]],
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == full[: first + 1] and out.stop_reason == stop_tok
    late = llm.generate(
        [[5, 6, 7]],
        SamplingParams(
            temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok], min_tokens=first + 2
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert stop_tok not in late.token_ids[: first + 2]


def test_logprobs_match_hf_log_softmax(llm, model_factory):
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 33, 90]
    out = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True
        ),
        use_tqdm=False,
    )[0]
    comp = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_factory("llama")), dtype=torch.float32)
    ids = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == 1  # greedy picks the top token
        assert len(entry) == 3 and set(entry) == set(row.topk(3).indices.tolist())
        total += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - ref[j - 1][prompt[j]].item()) < 1e-4


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("n", 0),
        ("max_tokens", 0),
        ("logprobs", 50),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("stop", [""]),
        ("temperature", "hot"),
        ("n", True),
        ("output_kind", 3),
        ("output_kind", "delta"),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_requests_raise_clear_errors_and_engine_continues(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 600], use_tqdm=False)
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_abort_request_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7] * 5, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.block_manager.usage == 0.0


def test_failing_model_step_fails_only_its_requests(llm, monkeypatch):
    engine = llm.llm_engine
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # "ok" is running, then a step including "bad" blows up
    engine.add_request("bad", [8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    patch_execute_model(monkeypatch, engine.executor, fault=on_call(1, RuntimeError("boom")))
    failed = engine.step()
    assert {o.request_id for o in failed} == {"ok", "bad"}
    assert all(o.finished and o.outputs[0].finish_reason == "error" for o in failed)
    assert "boom" in failed[0].error
    engine.check_integrity()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and engine.block_manager.usage == 0.0


def test_generate_freezes_the_heap_only_while_it_runs(llm, monkeypatch):
    engine = llm.llm_engine
    real = engine.executor.execute_model
    frozen_during: list[int] = []

    def step(out):  # noqa: ANN001, ANN202
        frozen_during.append(gc.get_freeze_count())
        return real(out)

    monkeypatch.setattr(engine.executor, "execute_model", step)
    assert gc.get_freeze_count() == 0
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(frozen_during) >= 4 and min(frozen_during) > 0
    assert gc.get_freeze_count() == 0  # collectable again afterwards

    gc.freeze()  # the caller's own freeze is left as it is
    try:
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
