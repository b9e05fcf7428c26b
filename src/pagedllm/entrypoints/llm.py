"""LLM: the offline batch API, as vLLM's ``LLM(model=...).generate(...)``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import EngineArgs
from pagedllm.core.outputs import RequestOutput
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline generation over a batch of prompts with continuous batching underneath.

    ``LLM(model=PATH, **engine_kwargs)`` takes every EngineArgs field as a keyword.
    """

    def __init__(
        self, model: str | None = None, skip_tokenizer_init: bool = False, **engine_kwargs: Any
    ) -> None:
        unknown = set(engine_kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}.")
        args = (
            EngineArgs(**engine_kwargs)
            if model is None
            else EngineArgs(model=model, **engine_kwargs)
        )
        self.llm_engine = LLMEngine.from_engine_args(args, skip_tokenizer_init)
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, skip_tokenizer_init: bool = False) -> LLM:
        return cls(skip_tokenizer_init=skip_tokenizer_init, **dataclasses.asdict(args))

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling used when none is given: the model's generation_config.json values
        over SamplingParams' defaults, as vLLM's LLM does."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order. lora_request:
        one adapter for all prompts or one (or None: the base model) per prompt."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("sampling_params must be one SamplingParams or one per prompt.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError("lora_request must be one LoRARequest or one per prompt.")
        # generate returns each request's last output only: the steps build none before it
        final: dict[int, SamplingParams] = {}
        for params in params_list:
            if id(params) not in final:
                final[id(params)] = _final_only(params)
        params_list = [final[id(params)] for params in params_list]
        ids = []
        try:
            for prompt, params, lora in zip(prompt_list, params_list, lora_list):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params, lora_request=lora)
                ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted by the tokenizer's chat template."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template.")
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        generated = 0
        with _heap_frozen():
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                elapsed = bar.format_dict["elapsed"] or 1e-9
                bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s", refresh=False)
        bar.close()
        return [finished[i] for i in ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    """params with output_kind FINAL_ONLY, as vLLM's LLM runs its requests; the caller's
    object stays as it was (anything else is left for add_request to refuse)."""
    if not isinstance(params, SamplingParams) or params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    params = copy.copy(params)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """The objects alive when generation starts (the model, the tokenizer, the caller's own)
    set aside from the collector until it ends: a full collection, which would walk them all,
    then only sees what the steps make (SmolLM2 int8 at one request: 122-124 -> 136-142 tok/s,
    alternating runs). Unfrozen afterwards, so they are collectable again; left alone where
    the caller has frozen objects itself."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("prompts must not be empty.")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise ValueError(f"prompts must be a string, token ids or a list of them, got {type(prompts)}.")
