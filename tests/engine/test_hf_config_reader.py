"""pagedllm's own config.json reader gives the fields transformers' AutoConfig gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.hf_config import HFConfig, read_hf_config
from pagedllm.layers.rotary import rope_parameters
from pagedllm.models.llama import window_left

DEMO = Path(__file__).resolve().parents[2] / "models" / "pagedllm-demo"
FIELDS = (
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "sliding_window",
    "layer_types",
    "quantization_config",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 99}
CASES = {
    "llama-minimal": {"model_type": "llama"},
    "llama-gqa-headdim": {"model_type": "llama", "num_key_value_heads": 2, "head_dim": 32},
    "llama3-rope": {
        "model_type": "llama",
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    },
    "llama-linear-old-key": {
        "model_type": "llama",
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16",
    },
    "llama-new-rope-key": {
        "model_type": "llama",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0},
        "dtype": "float16",
        "tie_word_embeddings": True,
        "quantization_config": {"quant_method": "pagedllm_int8", "granularity": "per_channel"},
    },
    "mistral-default-window": {"model_type": "mistral"},
    "mistral-no-window": {"model_type": "mistral", "sliding_window": None},
    "mistral-window": {"model_type": "mistral", "sliding_window": 24, "num_key_value_heads": 2},
    "qwen2-default": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen2-window-on": {
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 1,
        "eos_token_id": [5, 6],
    },
    "qwen2-window-off": {"model_type": "qwen2", "sliding_window": 16, "max_window_layers": 1},
}


def head_dim_of(c: object) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def num_kv_heads_of(c: object) -> int:
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def _write(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _assert_same(ours: HFConfig, theirs: object) -> None:
    for name in FIELDS:
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    assert head_dim_of(ours) == head_dim_of(theirs)
    assert num_kv_heads_of(ours) == num_kv_heads_of(theirs)
    assert rope_parameters(ours) == rope_parameters(theirs)
    for layer in range(ours.num_hidden_layers):
        assert window_left(ours, layer) == window_left(theirs, layer)
    their_dtype = getattr(theirs, "dtype", None)
    assert ours.dtype == (None if their_dtype is None else str(their_dtype).split(".")[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_fields_match_autoconfig(case: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    folder = _write(tmp_path, BASE | CASES[case])
    _assert_same(read_hf_config(folder), AutoConfig.from_pretrained(str(folder)))


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "mistral", "qwen2"])
def test_saved_tiny_models_match_autoconfig(arch: str, model_factory) -> None:
    from transformers import AutoConfig

    folder = model_factory(arch)
    _assert_same(read_hf_config(folder), AutoConfig.from_pretrained(str(folder)))


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="demo model absent")
def test_demo_config_matches_autoconfig() -> None:
    from transformers import AutoConfig

    _assert_same(read_hf_config(DEMO), AutoConfig.from_pretrained(str(DEMO)))


def test_bad_files_are_value_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        read_hf_config(tmp_path)
    _write(tmp_path, {"model_type": "llama", "hidden_size": "64", "num_attention_heads": 4})
    with pytest.raises(ValueError, match="hidden_size"):
        read_hf_config(tmp_path)


def test_reading_a_config_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys; from pagedllm.hf_config import read_hf_config; "
        f"read_hf_config({str(DEMO)!r}); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
