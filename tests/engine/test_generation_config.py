"""generation_config.json sampling becomes the request defaults, as vLLM reads it."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import add_sampling_args, sampling_params_from
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.generation_config import generation_config_folder, read_sampling_defaults

DEMO = Path(__file__).resolve().parents[2] / "models" / "pagedllm-demo"


def _with_generation_config(src: Path, dst: Path, values: dict) -> Path:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(config | values))
    return dst


def test_reads_the_fields_vllm_reads(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 99,
                "min_p": "bad",
                "num_beams": 4,
            }
        )
    )
    assert read_sampling_defaults(str(tmp_path)) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 99,
    }
    assert read_sampling_defaults(str(tmp_path / "absent")) == {}
    assert read_sampling_defaults(None) == {}
    assert generation_config_folder("auto", "m") == "m"
    assert generation_config_folder("pagedllm", "m") is None
    with pytest.raises(ValueError, match="generation_config"):
        generation_config_folder("/no/such/folder", "m")


def test_llm_uses_the_defaults_and_a_request_overrides_them(tiny_llama, tmp_path: Path) -> None:
    folder = _with_generation_config(
        tiny_llama, tmp_path / "m", {"temperature": 0.0, "repetition_penalty": 1.5}
    )
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=16 << 20)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty) == (0.0, 1.5)
    prompt = [5, 6, 7, 8]
    implicit = llm.generate([prompt], use_tqdm=False)[0].outputs[0].token_ids
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=16)
    explicit = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert implicit == explicit  # both greedy with the penalty, 16 tokens
    plain = SamplingParams(temperature=0.0, max_tokens=16)
    assert llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids != implicit
    off = LLM(
        str(folder), dtype="float32", kv_cache_memory_bytes=16 << 20, generation_config="pagedllm"
    )
    assert off.get_default_sampling_params().repetition_penalty == 1.0


def test_cli_flags_over_model_defaults_over_greedy() -> None:
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    defaults = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
    params = sampling_params_from(parser.parse_args([]), defaults)
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.7, 0.9, 1.1)
    params = sampling_params_from(parser.parse_args(["--temperature", "0"]), defaults)
    assert (params.temperature, params.top_p) == (0.0, 0.9)
    assert sampling_params_from(parser.parse_args([]), {}).temperature == 0.0


def test_server_fields_fall_back_to_the_model_defaults() -> None:
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = SimpleNamespace(sampling_defaults={"temperature": 0.7, "top_k": 40})
    assert serving.default("temperature", None, 1.0) == 0.7
    assert serving.default("temperature", 0.0, 1.0) == 0.0
    assert serving.default("top_k", None, 0) == 40
    assert serving.default("top_p", None, 1.0) == 1.0


@pytest.mark.skipif(not (DEMO / "generation_config.json").exists(), reason="demo model absent")
def test_demo_model_ships_sampling_defaults() -> None:
    defaults = read_sampling_defaults(str(DEMO))
    assert 0.0 < defaults["temperature"] < 1.0
    assert defaults["repetition_penalty"] > 1.0
