"""Hugging Face hub ids (``org/name``) as local model paths, through huggingface_hub.

A model argument that is no local path but has the shape of a hub id is downloaded into
huggingface_hub's cache (``HF_HOME``; ``--revision`` picks a branch, tag or commit) and
replaced by its snapshot folder, as vLLM does. With ``HF_HUB_OFFLINE=1`` only the cache is
read, and a model that is not in it is a clear error that says how to get it.
"""

from __future__ import annotations

import re
from pathlib import Path

# the files a model needs; a repository's other files (pytorch_model.bin, onnx/ ...) stay
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "/"))


def resolve_model(model: str, revision: str | None = None) -> str:
    """A local path for ``model``: itself when it exists here, else a hub id's snapshot."""
    if Path(model).exists() or not looks_like_hub_id(model):
        return model  # a local path, or one whose error the model source reports
    return _snapshot(model, revision)


def _snapshot(repo_id: str, revision: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - huggingface_hub comes with transformers
        raise ValueError(
            f"model {repo_id!r} is no local path; loading hub ids needs huggingface_hub "
            "(pip install huggingface_hub)."
        ) from e
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS))
    except LocalEntryNotFoundError as e:
        raise ValueError(_not_cached_message(repo_id, revision)) from e
    except RevisionNotFoundError as e:
        raise ValueError(f"hub model {repo_id!r} has no revision {revision!r}.") from e
    except RepositoryNotFoundError as e:
        raise ValueError(
            f"model {repo_id!r} is neither a local path nor a hub repository you can read "
            "(for a gated or private one, log in with `hf auth login` or set HF_TOKEN)."
        ) from e
    return str(_model_in(folder, repo_id))


def _not_cached_message(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import constants

    rev = f" --revision {revision}" if revision else ""
    where = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        return (
            f"hub model {repo_id!r}{rev} is not in the cache {where} and HF_HUB_OFFLINE is set: "
            f"download it once while online (`hf download {repo_id}{rev}`), or unset "
            "HF_HUB_OFFLINE, or pass a local folder or GGUF file."
        )
    return (
        f"hub model {repo_id!r}{rev} could not be downloaded and is not in the cache {where}: "
        "check the network (or a proxy), or pass a local folder or GGUF file."
    )


def _model_in(folder: Path, repo_id: str) -> Path:
    if not (folder / "config.json").exists():
        raise ValueError(
            f"hub model {repo_id!r} has no config.json; for a repository of GGUF files, "
            "download the file you want and pass its path."
        )
    return folder
