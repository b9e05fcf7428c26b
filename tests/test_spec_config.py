"""speculative_config: vLLM's names, ValueErrors that name the field, the CLI's JSON flag."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import add_engine_args, engine_args_from
from pagedllm.spec_config import SpeculativeConfig, parse_speculative_config


def test_ngram_defaults_and_names() -> None:
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg == SpeculativeConfig("ngram", 4, prompt_lookup_max=5, prompt_lookup_min=2)
    cfg = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1}'
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (1, 1)
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "5"}, "max"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
        ({"model": "/nonexistent", "num_speculative_tokens": 2}, "model"),
        ("{not json", "JSON"),
        ([1, 2], "dict"),
    ],
)
def test_bad_values_name_the_field(raw: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(raw)  # type: ignore[arg-type]


def test_draft_model_must_share_the_vocabulary(model_factory) -> None:
    target = model_factory("llama")
    draft = model_factory("llama", vocab_size=300)
    args = EngineArgs(
        model=str(target), speculative_config={"model": str(draft), "num_speculative_tokens": 2}
    )
    with pytest.raises(ValueError, match="vocabulary"):
        args.create_engine_config()


def test_cli_flag_takes_json(model_factory) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(
        [
            "--model",
            str(model_factory("llama")),
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
        ]
    )
    config = engine_args_from(ns).create_engine_config()
    assert config.speculative == SpeculativeConfig("ngram", 3)
