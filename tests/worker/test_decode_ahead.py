"""num_scheduler_steps: a batch whose every sequence decodes greedily runs several decode
steps per schedule on the fused CPU decoder (ModelRunner._decode_ahead), and gives the tokens
that one step a schedule gives: through bursts cut short by max_tokens, a stop token inside a
burst, a KV cache too small for the steps ahead, quantized layers and a sliding window. A
batch the sampler has more to do for (temperature, logprobs, penalties) steps one token a
schedule, as does a model whose logits the decoder's call does not give (a soft-capped
head). A model of several KV cache groups (Gemma 3) runs each group's layers over its own
blocks."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import unavailable
from helpers.generation import greedy, random_prompts

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.layers import cpu_fused
from pagedllm.worker.cpu_decoder import DecodeSteps


@pytest.fixture(autouse=True)
def kernel() -> None:
    if not cpu_fused.load():
        unavailable("the C++ fused ops could not be built")


def engine(model_dir: str, steps: int, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(
        dtype="float32", block_size=4, max_num_seqs=4, kv_cache_memory_bytes=1 << 20
    )
    options.update(kwargs)
    return LLM(model_dir, num_scheduler_steps=steps, **options)


def bursts(llm: LLM) -> tuple[int, int]:
    """(schedules that ran several steps, the steps they ran)."""
    runner = llm.llm_engine.executor.local_runner
    return runner.num_decode_bursts, runner.num_burst_steps


def generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.block_manager.usage == 0.0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("arch", "dtype", "quantization"),
    [
        ("llama", "float32", None),
        ("llama", "bfloat16", None),
        ("llama", "float32", "int8"),
        ("llama", "bfloat16", "int4"),
        ("mistral", "float32", None),  # sliding window shorter than the outputs
        ("qwen3", "bfloat16", None),
    ],
)
def test_bursts_give_the_tokens_of_one_step_a_schedule(model_factory, arch, dtype, quantization):
    model_dir = str(model_factory(arch))
    prompts = random_prompts(4, 5, 30, seed=7)
    max_tokens = [23, 9, 17, 30]  # rows leave at different steps: bursts end there
    kwargs = dict(dtype=dtype, quantization=quantization)
    single = engine(model_dir, 1, **kwargs)
    expected = generate(single, prompts, max_tokens)
    assert bursts(single) == (0, 0)
    several = engine(model_dir, 5, **kwargs)
    assert generate(several, prompts, max_tokens) == expected
    count, steps = bursts(several)
    assert count > 0 and steps > count  # several steps a schedule
    # a burst stops where the first of its rows reaches max_tokens: none ran past
    assert [len(t) for t in expected] == max_tokens


def test_a_stop_token_inside_a_burst_ends_the_output_there(model_factory):
    model_dir = str(model_factory("llama"))
    prompt = random_prompts(1, 12, 12, seed=2)[0]
    single = engine(model_dir, 1)
    free = single.llm_engine.block_manager.num_free_blocks
    tokens = generate(single, [prompt], [24])[0]
    stop = tokens[10]  # its first place is at most 10: a burst of 8 has tokens after it
    cut = tokens.index(stop) + 1
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    several = engine(model_dir, 8)
    for llm in (single, several):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == tokens[:cut]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        llm.llm_engine.check_integrity()
    assert bursts(several)[0] > 0
    # the slots written past the stop went back with the sequence; a prompt that meets the
    # cached blocks again decodes as before
    assert single.llm_engine.block_manager.num_free_blocks == free
    assert greedy(several, [prompt], 24) == [tokens]


def test_a_batch_loses_a_stopped_sequence_where_one_step_a_schedule_does(model_factory):
    """A burst ends after the step that picks a row's stop token, so the other rows go on
    in the batch one step a schedule would have: their tokens are the same too."""
    model_dir = str(model_factory("llama"))
    prompts = random_prompts(3, 8, 16, seed=9)
    single = engine(model_dir, 1)
    free = generate(single, prompts, [20] * 3)
    stop = free[1][4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=ids)
        for ids in ([], [stop], [])
    ]
    outputs = {}
    for steps in (1, 8):
        llm = engine(model_dir, steps)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[steps] = [o.outputs[0].token_ids for o in outs]
        llm.llm_engine.check_integrity()
        if steps == 8:
            assert bursts(llm)[0] > 0
    assert outputs[8] == outputs[1]
    assert outputs[8][1] == free[1][: free[1].index(stop) + 1]


def test_decode_greedy_ends_after_the_step_that_picks_a_stop_token(model_factory):
    llm = engine(str(model_factory("llama")), 8)
    runner = llm.llm_engine.executor.local_runner
    decoder = runner.fast_path
    assert decoder is not None
    block_size, last = 4, runner.num_blocks - 1
    tables = [torch.tensor([[last - 1], [last]], dtype=torch.int32)]  # a block each: 4 steps
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    ids = torch.tensor([11, 12])
    embed = llm.llm_engine.model.model.get_input_embeddings

    def run(stops: torch.Tensor | None) -> torch.Tensor:
        steps = DecodeSteps.ahead(torch.tensor([0, 0]), tables, cu_q, block_size, 4)
        return decoder.decode_greedy(ids, steps, embed, runner.sampler.argmax, stops)

    free = run(None)
    assert free.shape == (4, 2)
    stops = torch.tensor([[-1, -1], [int(free[1, 1]), 7]])  # row 1 stops at step 1
    stopped = run(stops)
    assert torch.equal(stopped, free[: stopped.shape[0]])
    # row 1's stop tokens: the steps end after the first that picks one of them
    first = 0 if int(free[0, 1]) in (int(free[1, 1]), 7) else 1
    assert stopped.shape[0] == first + 1


def test_a_cache_too_small_for_the_steps_ahead_runs_what_the_blocks_hold(model_factory):
    """Steps ahead only take free blocks: four sequences that outgrow a cache of 30 blocks
    are preempted and recomputed as with one step a schedule, the bursts running what each
    sequence's blocks hold, with the same tokens."""
    model_dir = str(model_factory("llama"))
    prompts = random_prompts(4, 10, 20, seed=5)
    probe = engine(model_dir, 1).llm_engine.executor.local_runner.kv_spec
    assert probe is not None
    tight = dict(kv_cache_memory_bytes=30 * probe.bytes_per_block)
    single = engine(model_dir, 1, **tight)
    expected = generate(single, prompts, [40] * 4)
    several = engine(model_dir, 8, **tight)
    assert several.llm_engine.block_manager.num_blocks == 30
    assert generate(several, prompts, [40] * 4) == expected
    assert several.llm_engine.scheduler.num_preemptions > 0
    assert single.llm_engine.scheduler.num_preemptions > 0
    assert bursts(several)[0] > 0


@pytest.mark.parametrize(
    "other",
    [
        dict(temperature=0.8, seed=1),
        dict(temperature=0.0, logprobs=1),
        dict(temperature=0.0, repetition_penalty=1.2),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.0, min_tokens=12),
    ],
)
def test_a_batch_the_sampler_must_see_steps_one_token_a_schedule(model_factory, other):
    model_dir = str(model_factory("llama"))
    prompts = random_prompts(2, 8, 16, seed=1)
    llm = engine(model_dir, 8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True, **other),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert bursts(llm) == (0, 0)
    # the greedy request alone bursts
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert bursts(llm)[0] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bursts_run_each_kv_group_over_its_own_blocks(model_factory, dtype):
    """Gemma 3 without a soft cap: its sliding (window 8, shorter than the outputs) and global
    layers run in a call each over their group's block tables, step after step."""
    model_dir = str(model_factory("gemma3", final_logit_softcapping=None))
    prompts = random_prompts(3, 10, 20, seed=4)
    max_tokens = [14, 21, 9]
    expected = generate(engine(model_dir, 1, dtype=dtype), prompts, max_tokens)
    llm = engine(model_dir, 6, dtype=dtype)
    fast_path = llm.llm_engine.executor.local_runner.fast_path
    assert fast_path is not None and len(fast_path.segments) > 1
    assert generate(llm, prompts, max_tokens) == expected
    count, steps = bursts(llm)
    assert count > 0 and steps > count


def test_a_soft_capped_head_steps_one_token_a_schedule(model_factory):
    """The tiny Gemma 3's head is soft-capped: its logits come from Python after the layers'
    call, so the decoder cannot pick the next tokens itself."""
    model_dir = str(model_factory("gemma3"))
    prompts = random_prompts(2, 10, 20, seed=4)
    expected = generate(engine(model_dir, 1), prompts, [10, 10])
    llm = engine(model_dir, 4)
    assert llm.llm_engine.model.logit_softcap
    assert generate(llm, prompts, [10, 10]) == expected
    assert bursts(llm) == (0, 0)


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_num_scheduler_steps_must_be_a_positive_integer(tiny_llama, value):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(str(tiny_llama), num_scheduler_steps=value).create_engine_config()


def test_num_scheduler_steps_excludes_speculative_decoding(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    args = EngineArgs(str(tiny_llama), num_scheduler_steps=4, speculative_config=spec)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        args.create_engine_config()
