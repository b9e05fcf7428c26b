"""How EngineArgs turns into the engine's configuration."""

from __future__ import annotations

import pytest
import torch

from pagedllm import EngineArgs


@pytest.mark.parametrize(
    ("budget", "seqs", "want_seqs"),
    [(32, 256, 32), (16, 4, 4), (None, 256, 256)],
)
def test_token_budget_below_max_num_seqs_caps_the_batch(tiny_llama, budget, seqs, want_seqs):
    """The token budget is kept as asked (prompts chunk); the batch shrinks to fit it."""
    args = EngineArgs(str(tiny_llama), max_num_batched_tokens=budget, max_num_seqs=seqs)
    config = args.create_engine_config().scheduler
    assert config.max_num_batched_tokens == (budget or 2048)
    assert config.max_num_seqs == want_seqs


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt(tiny_llama):
    args = EngineArgs(
        str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        args.create_engine_config()


def test_partition_config_is_one_dict_with_the_plain_defaults(tiny_llama):
    args = EngineArgs(str(tiny_llama), partition_config={"plan": "p.json", "address": "h:1"})
    part = args.create_engine_config().partition
    assert (part.plan, part.role, part.address) == ("p.json", "edge", "h:1")
    assert (part.pipeline_depth, part.replan_interval, part.fallback) == (1, 64, "fail")
    text = EngineArgs(str(tiny_llama), partition_config='{"plan": "p.json", "role": "cloud"}')
    assert text.create_engine_config().partition.role == "cloud"
    assert EngineArgs(str(tiny_llama)).create_engine_config().partition is None


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"plan": "p.json", "depth": 2}, r"unknown keys \['depth'\]"),
        ({"address": "h:1"}, "partition_config.plan"),
        ({"plan": "p.json", "role": "middle"}, "partition_config.role"),
        ({"plan": "p.json", "role": 2}, "partition_config.role"),
        ({"plan": "p.json", "address": 7000}, "partition_config.address"),
        ({"plan": "p.json", "pipeline_depth": 0}, "partition_config.pipeline_depth"),
        ({"plan": "p.json", "replan_interval": -1}, "partition_config.replan_interval"),
        ({"plan": "p.json", "fallback": "retry"}, "partition_config.fallback"),
        ("{not json", "partition_config is not valid JSON"),
    ],
)
def test_a_bad_partition_config_names_the_key(tiny_llama, raw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(str(tiny_llama), partition_config=raw).create_engine_config()


def test_the_old_partition_fields_still_work_with_a_deprecation_warning(tiny_llama):
    with pytest.warns(DeprecationWarning, match="partition_config"):
        args = EngineArgs(
            str(tiny_llama), partition="p.json", partition_address="h:1", partition_fallback="local"
        )
    assert args.partition_config == {"plan": "p.json", "address": "h:1", "fallback": "local"}
    assert args.partition is None  # moved: a dataclasses.replace sees each setting once
    part = args.create_engine_config().partition
    assert (part.plan, part.address, part.fallback) == ("p.json", "h:1", "local")


def test_the_partition_flags_build_partition_config_without_a_warning(recwarn):
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    argv = ["serve", "m", "--partition", "p.json", "--role", "cloud"]
    argv += ["--partition-config", '{"replan_interval": 0, "role": "edge"}']
    args = engine_args_from(build_parser("serve").parse_args(argv))
    # a flag wins over the same key of the JSON
    assert args.partition_config == {"plan": "p.json", "role": "cloud", "replan_interval": 0}
    assert not [w for w in recwarn if w.category is DeprecationWarning]


def test_every_engine_flag_has_its_help_next_to_its_field():
    import dataclasses

    for f in dataclasses.fields(EngineArgs):
        assert f.metadata.get("help"), f"EngineArgs.{f.name} has no help"


@pytest.mark.parametrize(
    "dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float32, "float32"), ("half", "half")]
)
def test_dtype_takes_a_torch_dtype_as_vllm_does(tiny_llama, dtype, name):
    args = EngineArgs(model=str(tiny_llama), dtype=dtype)
    assert args.dtype == name
    expected = {"half": "float16"}.get(name, name)
    assert args.create_engine_config().model.dtype == expected


def test_dtype_names_the_field_for_a_dtype_it_does_not_run(tiny_llama):
    with pytest.raises(ValueError, match="dtype must be one of .*got 'float64'"):
        EngineArgs(model=str(tiny_llama), dtype=torch.float64).create_engine_config()
