"""Where a model's config and weights come from: a Hugging Face folder or a GGUF file.

:func:`open_source` picks the source for a local path (a hub id is first turned into its
snapshot folder by :mod:`pagedllm.models.hub`). Both kinds answer the same two questions,
the config (an :class:`~pagedllm.hf_config.HFConfig` or transformers' config) and the
weights as (Hugging Face name, tensor) pairs, so the loader and the engine config never ask
which kind they have.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


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
        if not (self.path / "config.json").exists():
            raise ValueError(f"model folder {str(self.path)!r} has no config.json.")
        from pagedllm.hf_config import read_hf_config

        return read_hf_config(self.path)

    def iterate_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from pagedllm.models.loader import iterate_weights

        return iterate_weights(self.path)  # stored dtype: the parameters' copy_ converts


class GGUFSource:
    """A GGUF file: config from its metadata, tensors dequantized to the model's dtype."""

    def __init__(self, path: Path) -> None:
        from pagedllm.models.gguf_loader import open_gguf

        self.path = path
        self.file = open_gguf(path)

    def read_config(self) -> Any:
        from pagedllm.hf_config import config_from_dict
        from pagedllm.models.gguf_loader import gguf_config_dict

        return config_from_dict(gguf_config_dict(self.file), origin=self.path.name)

    def iterate_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from pagedllm.models.gguf_loader import iterate_gguf_weights

        return iterate_gguf_weights(self.file, self.read_config(), dtype)


def open_source(model: str | Path) -> ModelSource:
    """The source of a local model path; ValueError naming what to pass otherwise."""
    from pagedllm.models.gguf_loader import is_gguf

    path = Path(model)
    if path.is_dir():
        return FolderSource(path)
    if is_gguf(path):
        return GGUFSource(path)
    if path.is_file():
        raise ValueError(
            f"model {str(model)!r} is a file but not a GGUF file; pass a GGUF file, a local "
            "Hugging Face model folder (config.json + *.safetensors) or a hub id (org/name)."
        )
    raise ValueError(
        f"model {str(model)!r} is not a local folder or file; pass a Hugging Face model folder "
        "(config.json + *.safetensors), a GGUF file or a hub id (org/name)."
    )
