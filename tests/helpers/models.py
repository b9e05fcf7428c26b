"""Tiny random-weight models of every supported architecture, built offline from configs."""

from __future__ import annotations

from pathlib import Path

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A list is a mutable sequence. "
    "Dictionaries map keys to values. naïve café — 日本語 ✓ emoji 🙂 done. "
) * 20


def build_tokenizer(folder: Path, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer trained on a few sentences, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(str(folder))


ARCH_CONFIGS = {
    "llama": dict(model_type="llama", num_key_value_heads=2),
    "llama3_rope": dict(
        model_type="llama",
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=24),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    # q / k RMSNorm per head, head_dim 32 (not hidden / heads), no qkv bias
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=32),
    # sliding (window 8) and global layers with their own rotary bases (linear scaling on the
    # global ones, as Gemma 3 4B+ configs have it), q / k norms, four offset norms a layer,
    # GeGLU, scaled embeddings, a query scale of 24 ** -0.5, tied embeddings, a final logit
    # soft cap
    "gemma3": dict(
        model_type="gemma3_text",
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
}
# Architectures whose norm weights get noise too (their q / k and offset norms would
# otherwise start as identities and go untested).
_NOISY_NORMS = ("qwen3", "gemma3")


def build_model(folder: Path, arch: str, seed: int = 0, **overrides: object) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCH_CONFIGS[arch])
    model_type = spec.pop("model_type")
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(spec)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # A random model's logits are nearly flat; a larger init spreads them so that greedy
    # choices are well separated and the comparison with HF is decisive.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            elif arch in _NOISY_NORMS and "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    build_tokenizer(folder)
    return folder
