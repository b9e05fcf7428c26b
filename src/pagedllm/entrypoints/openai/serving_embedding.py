"""/v1/embeddings for decoder models (``pagedllm serve --runner pooling``).

Each input runs as a one-token request through the same scheduler as generation (batched
with the others, chunked if long); the model runner's Pooler keeps its prompt's last-token
or mean hidden state (worker/pooler.py). Then ``dimensions`` keeps the first ones (only for
a model trained for it, whose config lists ``matryoshka_dimensions`` or sets
``is_matryoshka``), and ``normalize`` (the default) scales to unit length.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import torch
from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedllm.entrypoints.openai.serving import (
    OpenAIServing,
    ServedModel,
    ServingError,
    collect_finals,
    unless_disconnected,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.pooler import Pooler


def attach_pooler(engine: AsyncLLMEngine, pooling_type: str) -> Pooler:
    """Give the engine's model runner a Pooler; ValueError for an engine whose steps do not
    go through one in-process ModelRunner.execute (tensor parallel workers, a split)."""
    from pagedllm.worker.executor import UniProcExecutor

    executor = engine.engine.executor
    if not isinstance(executor, UniProcExecutor):
        raise ValueError(
            "--runner pooling serves from one process (no --tensor-parallel-size, no --partition)."
        )
    pooler = Pooler(pooling_type)
    if pooling_type == "mean" and engine.engine.config.cache.enable_prefix_caching:
        raise ValueError(
            "mean pooling needs every prompt token computed: add --no-enable-prefix-caching."
        )
    executor.local_runner.pooler = pooler
    return pooler


def matryoshka(hf_config: Any) -> list[int] | bool:
    """The dimensions a model was trained to be cut to (True: any), else False."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return list(dims)
    return bool(getattr(hf_config, "is_matryoshka", False))


class OpenAIServingEmbedding(OpenAIServing):
    def __init__(self, engine: AsyncLLMEngine, model: ServedModel, pooler: Pooler | None) -> None:
        super().__init__(engine, model)
        self.pooler = pooler
        self.hidden_size: int = engine.engine.config.model.hf_config.hidden_size
        self.matryoshka = matryoshka(engine.engine.config.model.hf_config)

    def _prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        inputs: Any = req.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        prompts = []
        for item in inputs:
            ids = self.encode(item, param="input") if isinstance(item, str) else list(item)
            self.check_token_ids(ids, "input")
            if len(ids) >= self.model.max_model_len:
                raise ServingError(
                    f"This model's maximum context length is {self.model.max_model_len} "
                    f"tokens; an input has {len(ids)}.",
                    param="input",
                    code="context_length_exceeded",
                )
            prompts.append(ids)
        return prompts

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.hidden_size:
            return
        if self.matryoshka is False:
            raise ServingError(
                "this model does not support dimensions (it was not trained to be cut).",
                param="dimensions",
                code="dimensions_not_supported",
            )
        allowed = self.matryoshka if isinstance(self.matryoshka, list) else None
        if dimensions > self.hidden_size or (allowed is not None and dimensions not in allowed):
            raise ServingError(
                f"dimensions must be one of {allowed or f'1..{self.hidden_size}'}, "
                f"got {dimensions}.",
                param="dimensions",
                code="dimensions_not_supported",
            )

    async def create(self, req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        self.check_model(req.model)
        if self.pooler is None:
            raise ServingError(
                "this server generates text: start it with --runner pooling for embeddings.",
                param="model",
            )
        self._check_dimensions(req.dimensions)
        prompts = self._prompts(req)
        base = f"embd-{uuid.uuid4().hex}"
        ids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
        params = SamplingParams(max_tokens=1, temperature=0.0, skip_special_tokens=True)
        for rid in ids:
            self.pooler.expect(rid)
        try:
            streams = await self.add_requests(
                base, [({"prompt_token_ids": p}, params) for p in prompts]
            )
            await unless_disconnected(collect_finals(streams), raw)
            vectors = [self.pooler.take(rid) for rid in ids]
        except ValueError as e:
            raise ServingError(str(e), status=400, param="input") from e
        finally:
            for rid in ids:
                self.pooler.discard(rid)
        data = [
            EmbeddingData(index=i, embedding=self._encode(v, req)) for i, v in enumerate(vectors)
        ]
        count = sum(len(p) for p in prompts)
        return EmbeddingResponse(
            data=data,
            model=self.response_model(req.model),
            usage=EmbeddingUsage(prompt_tokens=count, total_tokens=count),
        )

    @staticmethod
    def _encode(vector: torch.Tensor, req: EmbeddingRequest) -> list[float] | str:
        if req.dimensions is not None:
            vector = vector[: req.dimensions]
        if req.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        if req.encoding_format == "base64":
            data = vector.to(torch.float32).numpy().astype("<f4").tobytes()
            return base64.b64encode(data).decode("ascii")
        return vector.tolist()
