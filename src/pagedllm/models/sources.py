"""Where a model's config and weights come from: a Hugging Face folder or a GGUF file.

:func:`open_source` picks the source for a local path (a hub id has already been turned into
its snapshot folder by :mod:`pagedllm.hub`). Both kinds answer the same two questions, the
config (an :class:`~pagedllm.hf_config.HFConfig` or transformers' config) and the weights as
(Hugging Face name, tensor) pairs, so the loader never asks which kind it has.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.hf_config import model_kind, read_hf_config

if TYPE_CHECKING:
    import torch

    from pagedllm.models.gguf_loader import GGUFTensor


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
    from safetensors import safe_open

    for path in safetensors_files(folder):
        if not path.exists():
            raise ValueError(f"weight file {str(path)!r} named by the index is missing.")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


class ModelSource(Protocol):
    """A model's config and weights, wherever they are stored."""

    path: Path

    def read_config(self) -> Any:
        """The model's config, with the fields transformers' config of it has."""
        ...

    def iterate_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face parameter name, tensor) for every stored weight."""
        ...


class FolderSource:
    """A Hugging Face model folder: config.json and *.safetensors."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read_config(self) -> Any:
        return read_hf_config(self.path)

    def iterate_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        return iterate_weights(self.path)  # stored dtype: the parameters' copy_ converts


class GGUFSource:
    """A GGUF file: config from its metadata, tensors dequantized to the model's dtype."""

    def __init__(self, path: Path) -> None:
        from pagedllm.gguf_metadata import open_gguf

        self.path = path
        self.file = open_gguf(path)

    def read_config(self) -> Any:
        from pagedllm.hf_config import read_gguf_config

        return read_gguf_config(self.path)

    def iterate_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from pagedllm.models.gguf_loader import iterate_gguf_weights

        return iterate_gguf_weights(self.file, self.read_config(), dtype)

    def iterate_tensors(self) -> Iterator[GGUFTensor]:
        """The tensors in their stored block formats (for layers that keep them quantized)."""
        from pagedllm.models.gguf_loader import iterate_gguf_tensors

        return iterate_gguf_tensors(self.file, self.read_config())


def open_source(model: str | Path) -> ModelSource:
    """The source of a local model path; ValueError naming what to pass otherwise."""
    path = Path(model)
    return GGUFSource(path) if model_kind(path) == "gguf" else FolderSource(path)
