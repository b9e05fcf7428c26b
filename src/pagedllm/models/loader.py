"""Build a model from a local Hugging Face folder and stream its safetensors weights in."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.distributed.communicator import SINGLE, Communicator
from pagedllm.models.registry import get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model folder {str(folder)!r} has no *.safetensors weights "
            "(pytorch_model.bin checkpoints are not supported; convert with save_pretrained)."
        )
    return files


def iterate_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(folder):
        if not path.exists():
            raise ValueError(f"weight file {str(path)!r} named by the index is missing.")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model, each through its parameter's weight_loader."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed: dict[str, tuple[str, int | str]] = getattr(model, "packed_modules", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        shard_id = None
        for ckpt_part, (param_part, sid) in packed.items():
            if f".{ckpt_part}." in name:
                name, shard_id = name.replace(f".{ckpt_part}.", f".{param_part}."), sid
                break
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model.")
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor)
        elif shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add(name)
    missing = [n for n in params if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(
            f"checkpoint is missing weights: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}"
        )


def load_model(config: ModelConfig, device: torch.device, comm: Communicator = SINGLE) -> nn.Module:
    cls = get_model_class(config.architecture)
    dtype = DTYPES[config.dtype]
    with torch.device(device):
        model = cls(config.hf_config, dtype, comm)
    load_weights(model, iterate_weights(Path(config.model)))
    return model.eval()
