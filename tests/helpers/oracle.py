"""The correctness oracle: greedy generation with Hugging Face transformers (fp32)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Exactly max_tokens greedy tokens after each prompt (EOS does not stop it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            # plain greedy, whatever sampling defaults the model's generation_config.json holds
            # (transformers applies its repetition_penalty to greedy search too)
            repetition_penalty=1.0,
            pad_token_id=2,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def hf_greedy_recompute(
    model_dir: Path | str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Greedy tokens with every step a full forward over the whole sequence (no KV cache):
    the oracle that cannot share a cache bug with the engine (sliding windows, per-layer
    rotary bases)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits
                ids.append(int(logits[0, -1].argmax()))
            outs.append(ids[len(p) :])
    return outs
