"""LoRA adapters over HTTP, as vLLM serves them: each adapter is a model name of its own
(``--lora-modules name=path``, ``POST /v1/load_lora_adapter``), listed in /v1/models with the
base model as its parent, and picked by a request's ``model``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from pagedllm.entrypoints.openai.openapi import ERRORS, MODEL_RESPONSES
from pagedllm.entrypoints.openai.protocol import ModelCard, OpenAIRequest
from pagedllm.entrypoints.openai.serving import ServedModel, ServingError, model_not_found
from pagedllm.lora.adapter import read_adapter_config
from pagedllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(OpenAIRequest):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a PEFT folder on the server's file system


class UnloadLoRAAdapterRequest(OpenAIRequest):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides


_SUCCESS = {200: {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}}}


class LoRARegistry:
    """The served adapters by name. Ids are never reused: the prefix cache is keyed by id,
    so an adapter loaded after another was unloaded must not inherit its cached blocks."""

    def __init__(self, model: ServedModel, lora_config: Any) -> None:
        self.model, self.config = model, lora_config
        self._ids: Iterator[int] = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        if self.config is None:
            raise ServingError(
                "LoRA adapters need a server started with --enable-lora.", param="lora_name"
            )
        if not name or name in self.model.names or name in self.model.loras:
            raise ServingError(
                f"the model name {name!r} is empty or already in use.", param="lora_name"
            )
        try:
            read_adapter_config(path, self.config.max_lora_rank)
        except ValueError as e:
            raise ServingError(str(e), param="lora_path") from e
        req = LoRARequest(name, next(self._ids), path)
        self.model.loras[name] = req
        return req

    def remove(self, name: str) -> None:
        if self.model.loras.pop(name, None) is None:
            raise model_not_found(name, self.model)

    def cards(self) -> list[ModelCard]:
        return [
            ModelCard(id=r.lora_name, root=r.lora_path, parent=self.model.name)
            for r in self.model.loras.values()
        ]


def parse_lora_modules(modules: Sequence[str]) -> list[tuple[str, str]]:
    """``name=path`` pairs of --lora-modules; ValueError naming the bad one."""
    pairs = []
    for item in modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {item!r}.")
        pairs.append((name, path))
    return pairs


def add_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    """The load/unload routes, on a server started with --enable-lora only (as vLLM, which
    offers them only where adapters can change)."""
    if registry.config is None:
        return

    @app.post("/v1/load_lora_adapter", response_class=Response, responses={**_SUCCESS, **ERRORS})
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        registry.add(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post(
        "/v1/unload_lora_adapter",
        response_class=Response,
        responses={**_SUCCESS, **MODEL_RESPONSES},
    )
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        registry.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
