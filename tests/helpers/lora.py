"""Tiny random LoRA adapters made with peft, and the transformers + peft greedy oracle."""

from __future__ import annotations

from pathlib import Path

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTN, "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base: Path, out: Path, seed: int, r: int, targets: list[str], use_rslora: bool = False
) -> Path:
    """A PEFT adapter of base with random A and B (peft starts B at zero: no effect)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, use_rslora=use_rslora
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(str(out))
    return out


def peft_greedy(
    base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Exactly max_tokens greedy tokens per prompt from transformers with the adapter on."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            repetition_penalty=1.0,
            pad_token_id=2,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


def most_adapters_in_a_step(runner) -> int:  # noqa: ANN001 - runs on every rank (collective_rpc)
    return max(runner.lora.adapters_per_step)
