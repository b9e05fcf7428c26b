"""The engine's input side: a request checked, tokenized, its grammar compiled and its
sequences built, before anything of it reaches the scheduler (vLLM v1's input processor)."""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sequence import Sequence
from pagedllm.engine.tokenizer import encode_text, stop_token_ids_from_generation_config
from pagedllm.lora.adapter import read_adapter_config
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager

PromptType = str | list[int] | dict[str, Any]

# Most samples one request may ask for (OpenAI's limit): n sequences are created at once.
MAX_N = 128
# Seeds seed .. seed + n - 1 go to torch.Generator.manual_seed, which takes 64-bit values.
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass
class ProcessedRequest:
    """A request ready for the scheduler; nothing of it is queued yet."""

    request_id: str
    prompt: str | None  # the prompt text, when it was given as text
    prompt_token_ids: list[int]
    params: SamplingParams  # as the caller gave them
    seqs: list[Sequence]  # one per sample (n)
    grammar: Any  # the compiled constraint of structured_outputs; None without one


class InputProcessor:
    """Turns (request_id, prompt, params) into sequences; ValueError, naming the field, for
    anything that would otherwise fail a model step later."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        # stop ids of generation_config.json, beside the tokenizer's EOS
        self.extra_stop_ids = stop_token_ids_from_generation_config(config.model.model)
        stop_ids = {self.eos_token_id, *self.extra_stop_ids} - {None}
        # Grammars compile here; the engine's loop fills and advances their masks. Masks are
        # filled in a thread during the forward only where the forward leaves the CPU free
        # (CUDA); on the CPU the thread costs more than the fill (benchmarks/results/
        # structured.md), so the fill runs on the engine thread.
        self.structured = StructuredOutputManager(
            tokenizer,
            config.model.hf_config.vocab_size,
            sorted(stop_ids),
            overlap=config.device.device != "cpu",
        )
        self._seq_ids = itertools.count()
        self._checked_loras: set[tuple[int, str]] = set()

    @property
    def eos_token_id(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_token_id

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float | None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string.")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams.")
        self._check_params(params)
        grammar = self._compile_grammar(params)
        text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        arrival = arrival_time if arrival_time is not None else time.time()
        self._check_lora(lora_request)
        seqs = self._make_sequences(request_id, prompt_ids, params, arrival)
        for seq in seqs:
            seq.lora_request = lora_request
        return ProcessedRequest(request_id, text, prompt_ids, params, seqs, grammar)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids when the tokenizer is skipped.")
            return prompt, encode_text(self.tokenizer, prompt)
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}.")

    def _check_params(self, params: SamplingParams) -> None:
        """Limits that depend on the engine: a bad value here would fail a whole model step."""
        if params.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {params.n}.")
        lo, hi = SEED_RANGE
        if params.seed is not None and not lo <= params.seed <= hi - (params.n - 1):
            raise ValueError(f"seed must be a 64-bit integer (n={params.n}), got {params.seed}.")
        vocab = self.config.model.hf_config.vocab_size
        bad = [t for t in params.stop_token_ids if not t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab}).")

    def _check_lora(self, req: LoRARequest | None) -> None:
        """An adapter the workers will be able to load: enabled, a LoRARequest, a readable
        PEFT folder within max_lora_rank (read once per adapter id and path)."""
        if req is None:
            return
        lora = self.config.lora
        if lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True.")
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}.")
        key = (req.lora_int_id, req.lora_path)
        if key not in self._checked_loras:
            read_adapter_config(req.lora_path, lora.max_lora_rank)
            self._checked_loras.add(key)

    def _compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled constraint of structured_outputs (None without one); ValueError."""
        if params.structured_outputs is None:
            return None
        if self.config.partition is not None:
            raise ValueError("structured_outputs is not supported with the edge/cloud split.")
        return self.structured.compile(params.structured_outputs)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty.")
        vocab = self.config.model.hf_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab}).")
        limit = self.config.scheduler.max_model_len
        if len(ids) > limit:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, more than max_model_len ({limit})."
            )

    def _make_sequences(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float
    ) -> list[Sequence]:
        eos = self.eos_token_id
        extra = self.extra_stop_ids - {eos}
        if extra and not params.ignore_eos:
            params = copy.copy(params)  # the caller's object stays as it was
            params.stop_token_ids = sorted(set(params.stop_token_ids or []) | extra)
        seqs: list[Sequence] = []
        for index in range(params.n):
            child = params if params.n == 1 else params.clone_for_child(index)
            seq = Sequence(
                next(self._seq_ids),
                request_id,
                index,
                prompt_ids,
                child,
                eos,
                arrival,
                prompt_leader=seqs[0] if seqs else None,
            )
            seqs.append(seq)
        return seqs
