"""Helpers shared by the benchmarks: the 125M benchmark model and machine description."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

BENCH_125M = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "pagedllm-demo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_bench_tokenizer(folder: Path, vocab_size: int = BENCH_125M["vocab_size"]) -> None:
    """A byte-level BPE tokenizer of exactly vocab_size tokens for the benchmark model.

    The shipped demo model's tokenizer (4096 tokens, GPT-2 style pre-tokenizer) grown by
    synthetic merges: each new token is the concatenation of two existing ones, appended as
    the lowest-priority merge, in a fixed order. Every id then decodes to real bytes, which
    GGUF conversion and llama.cpp's server need (prompts are token ids; the text never
    matters to the benchmarks).
    """
    if (folder / "tokenizer.json").exists():
        return
    data = json.loads((DEMO_TOKENIZER / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    base = sorted((t for t in vocab if len(t) > 1 and not t.startswith("<")), key=vocab.get)
    i = 0
    while len(vocab) < vocab_size:
        n = len(base)  # i -> (i % n, (i % n + i // n) % n) visits every pair once
        left, right = base[i % n], base[(i % n + i // n) % n]
        i += 1
        token = left + right
        if token not in vocab:
            vocab[token] = len(vocab)
            merges.append([left, right])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    for name in TOKENIZER_FILES[1:]:
        (folder / name).write_text((DEMO_TOKENIZER / name).read_text())


def build_bench_model(folder: Path, seed: int = 0) -> Path:
    """The 125M-parameter Llama benchmark model (random weights, bfloat16) and its tokenizer
    (build_bench_tokenizer), built once."""
    build_bench_tokenizer(folder)
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**BENCH_125M)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def default_model_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_BENCH_DIR", "bench_out")) / "llama-125m"


def _cpuinfo_field(name: str) -> str:
    """The first value of a /proc/cpuinfo field ('' where there is none): the field named
    exactly so ("model", not "model name")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name and, for x86, its microarchitecture with family and model: a
    guest's model name ("AMD EPYC") leaves out which generation runs the figures, and the
    kernels' rates differ by it (Zen 4 runs a 512-bit instruction in two halves, Zen 5 in
    one)."""
    name = _cpuinfo_field("model name") or "unknown CPU"
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model")
    if not (family.isdigit() and model.isdigit()):
        return name
    core = microarchitecture(_cpuinfo_field("vendor_id"), int(family), int(model))
    return ", ".join(part for part in (name, core, f"family {family} model {model}") if part)


# Intel family 6 models whose AVX-512 the kernels tell apart.
_INTEL_MODELS = {85: "Skylake-SP / Cascade Lake", 106: "Ice Lake-SP", 143: "Sapphire Rapids",
                 207: "Emerald Rapids", 173: "Granite Rapids"}  # fmt: skip


def microarchitecture(vendor: str, family: int, model: int) -> str:
    """The core generation of an x86 CPU from its CPUID vendor, family and model ('' where
    unknown)."""
    if vendor == "AuthenticAMD":
        if family == 23:
            return "Zen / Zen 2"
        if family == 25:
            zen4 = 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF
            return "Zen 4" if zen4 else "Zen 3"
        if family == 26:
            return "Zen 5"
    if vendor == "GenuineIntel" and family == 6:
        return _INTEL_MODELS.get(model, "")
    return ""


# The instruction sets the CPU kernels of both engines choose between.
_KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                 "avx512_bf16", "amx_int8", "amx_bf16")  # fmt: skip


def cpu_flags() -> str:
    """Those of _KERNEL_FLAGS this CPU reports, detected at run time."""
    flags = _cpuinfo_field("flags").split()
    return " ".join(f for f in flags if f in _KERNEL_FLAGS)


def ops_of_tree(tree: Path, source: str, library: str, namespace: str, cflags: list[str]):  # noqa: ANN201
    """torch.ops.<namespace>: another tree's C++ op library (`source` under it, registered as
    TORCH_LIBRARY(<library>, ...)) built under that namespace, so that its ops and this tree's
    run side by side in one process: its registrations (TORCH_LIBRARY, TORCH_LIBRARY_IMPL) and
    the names of its classes move to the namespace. The headers it may include (beside it, and
    in the tree's src/pagedllm/csrc) are copied beside the renamed source, where they come
    before this tree's shared headers."""
    import torch

    from pagedllm.cpp_build import load_cpp_ops

    text = (tree / source).read_text()
    registration = f"TORCH_LIBRARY({library},"
    if registration not in text:
        raise SystemExit(f"{tree}: no {registration} ...) in {source}")
    folder = Path(tempfile.mkdtemp())
    for place in (tree / "src/pagedllm/csrc", tree / Path(source).parent):  # beside wins
        for header in sorted(place.glob("*.h")):
            shutil.copy(header, folder)
    copy = folder / f"{namespace}.cpp"
    for kind in ("TORCH_LIBRARY(", "TORCH_LIBRARY_IMPL(", "torch.classes."):
        text = text.replace(f"{kind}{library}", f"{kind}{namespace}")
    copy.write_text(text)
    load_cpp_ops(copy, cflags, namespace, f"{tree}'s {Path(source).name}")
    return getattr(torch.ops, namespace)


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    import torch

    return (
        f"{os.cpu_count()} cores ({cpu_model()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}"
    )


def build_stdlib_tokenizer(folder: Path, vocab_size: int = 32000) -> Path:
    """A byte-level BPE tokenizer of vocab_size tokens trained on real text (the grammar
    benchmarks: token masks depend on what the tokens spell).

    Trained on the standard library's Python sources (about 10 MB of text, deterministic for
    one Python version), with `<unk>`, `<s>`, `</s>` as ids 0, 1, 2 like Llama's tokenizer.
    """
    if (folder / "tokenizer.json").exists():
        return folder
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))

    def texts():
        for path in files:
            yield path.read_text(encoding="utf-8", errors="replace")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder
