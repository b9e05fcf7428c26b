"""Tiny GGUF files written with the gguf package, the way llama.cpp's converter writes them.

:func:`write_model_gguf` turns a tiny Hugging Face folder (helpers.models) into a GGUF file:
metadata under llama.cpp's keys, tensors under llama.cpp's names (the gguf package's own
TensorNameMap), Llama's q/k rows interleaved for llama.cpp's rotary layout, Gemma's norms
stored as ``1 + w``, each tensor in the block type asked for. :func:`write_spm_gguf` writes a
SentencePiece-style ``llama`` vocabulary (scores, byte tokens) without any tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np


def _types():
    import gguf

    return gguf.GGMLQuantizationType


def interleave_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of a Llama q/k projection: each head's two rotary halves
    interleaved row by row."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(table, hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    name = table.get_name(base)
    assert name is not None, hf_name
    return f"{name}.{suffix}"


def _write_arch_metadata(writer, arch: str, config: dict) -> None:
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta", 1e4)))
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        sliding = [t == "sliding_attention" for t in config["layer_types"]]
        every_sixth = [(i + 1) % 6 != 0 for i in range(len(sliding))]
        if sliding != every_sixth:  # llama.cpp writes the pattern where it is not its default
            writer.add_sliding_window_pattern(sliding)


def _write_gpt2_vocab(writer, folder: Path, pre: str = "gpt-2") -> None:
    """The folder's byte-level BPE tokenizer.json as tokenizer.ggml.* (model gpt2)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for name, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
    ):
        add(vocab[config[name]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def encode_tensor(values: np.ndarray, ggml_type) -> tuple[np.ndarray, object | None]:
    """(array to write, raw_dtype) for values stored as ggml_type."""
    from gguf.quants import quantize

    types = _types()
    if ggml_type == types.F32:
        return values.astype(np.float32), None
    if ggml_type == types.F16:
        return values.astype(np.float16), None
    return quantize(values.astype(np.float32), ggml_type), ggml_type


def write_model_gguf(
    folder: Path,
    out: Path,
    arch: str,
    tensor_type: Callable[[str, np.ndarray], object] | None = None,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    pre: str = "gpt-2",
) -> Path:
    """A GGUF file of the Hugging Face model in folder. tensor_type(hf_name, values) picks
    each tensor's block type (default: F32 everywhere); names in drop are left out; extra
    adds F32 tensors under llama.cpp names (rope_freqs.weight)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), arch)
    _write_arch_metadata(writer, arch, config)
    _write_gpt2_vocab(writer, folder, pre)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, values in state.items():
        if name in drop:
            continue
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads:
            values = interleave_rows(values, heads[proj])
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1.0
        chosen = _types().F32 if tensor_type is None else tensor_type(name, values)
        if values.ndim == 1:
            chosen = _types().F32  # llama.cpp keeps 1-D tensors (norms, biases) in F32
        data, raw = encode_tensor(values, chosen)
        writer.add_tensor(_gguf_name(table, name), data, raw_dtype=raw)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values.astype(np.float32))
    _finish(writer)
    return out


def write_raw_tensor_gguf(
    out: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], **metadata: int
) -> Path:
    """A GGUF file of raw blocks: {llama.cpp name: (uint8 blocks [rows, bytes], type)}."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(metadata.get("block_count", 1))
    for name, (blocks, kind) in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=kind)
    _finish(writer)
    return out


def write_spm_gguf(
    out: Path,
    pieces: list[str],
    merges: list[str] | None,
    add_bos: bool | None = True,
    add_eos: bool = False,
    control: tuple[str, ...] = (),
    user_defined: tuple[str, ...] = (),
    chat_template: str | None = None,
    eot_token: str | None = None,
) -> Path:
    """A llama-architecture GGUF holding only a SentencePiece-style vocabulary: <unk>, <s>,
    </s>, the 256 byte tokens, then pieces (scores falling with their rank), then control
    and user-defined tokens."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    types = [2, 3, 3, *[6] * 256]
    tokens += pieces
    types += [1] * len(pieces)
    tokens += [*control, *user_defined]
    types += [3] * len(control) + [4] * len(user_defined)
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *[-float(i) for i in range(len(pieces))]]
    scores += [0.0] * (len(control) + len(user_defined))
    writer = gguf.GGUFWriter(str(out), "llama")
    config = dict(
        max_position_embeddings=64,
        num_hidden_layers=1,
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=1,
        rms_norm_eps=1e-5,
        vocab_size=len(tokens),
    )
    _write_arch_metadata(writer, "llama", config)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if eot_token is not None:
        writer.add_eot_token_id(tokens.index(eot_token))
    _finish(writer)
    return out


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
