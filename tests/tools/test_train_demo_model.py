"""Tests for tools/train_demo_model.py and the bundled models/pagedllm-demo folder."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = ROOT / "models" / "pagedllm-demo"
UTF8_TEXT = "naïve café — 日本語 ✓"


def _load_script() -> ModuleType:
    """tools/train_demo_model.py as a module."""
    return load_tool("train_demo_model")


def _safetensors_dtypes(path: Path) -> set[str]:
    """Tensor dtypes listed in a safetensors header."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def tdm() -> ModuleType:
    return _load_script()


@pytest.fixture(scope="module")
def tiny_run(
    tdm: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, Any], Path]]:
    """Train the --tiny preset once into a temp folder; restores global thread settings."""
    out = tmp_path_factory.mktemp("tiny") / "model"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYON_NUM_THREADS", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        try:
            report = tdm.run(tdm.parse_args(["--tiny", "--out", str(out)]))
        finally:
            torch.set_num_threads(threads)
        yield report, out


def test_help_lists_flags(tdm: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tdm.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--max-minutes", "--max-steps", "--hidden-size", "--tiny", "--seed"):
        assert flag in text


def test_requires_a_stopping_limit(tdm: ModuleType) -> None:
    with pytest.raises(SystemExit):
        tdm.parse_args(["--max-minutes", "0"])
    cfg = tdm.parse_args(["--max-steps", "5", "--max-minutes", "0"])
    assert cfg.max_steps == 5 and cfg.max_minutes is None


def test_default_shape_is_gqa_llama(tdm: ModuleType) -> None:
    cfg = tdm.TrainConfig()
    assert cfg.heads() == (6, 2)
    assert cfg.mlp_size() == 1024


def test_learning_rate_schedule(tdm: ModuleType) -> None:
    cfg = tdm.TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert tdm.learning_rate(0, 100, cfg) == pytest.approx(1e-4)
    assert tdm.learning_rate(10, 100, cfg) == pytest.approx(1e-3)
    assert tdm.learning_rate(100, 100, cfg) == pytest.approx(1e-4)


def test_corpus_is_clean_and_split_is_stable(tdm: ModuleType) -> None:
    docs = tdm.build_corpus()
    assert len(docs) == len(set(docs)) > 1000
    # docstrings lose run-dependent addresses; source files are static text as shipped
    source = [doc for doc in docs if doc.startswith("# Lib/")]
    assert len(source) > 200
    assert any(doc.startswith("# Lib/collections/__init__.py\n") for doc in source)
    assert not any("/test/" in doc.split("\n", 1)[0] for doc in source)
    assert not any(" at 0x" in doc for doc in docs if not doc.startswith("# Lib/"))
    train, heldout = tdm.split_corpus(docs)
    assert len(train) + len(heldout) == len(docs)
    assert 0.02 < len(heldout) / len(docs) < 0.08
    assert all(tdm.is_heldout(doc) for doc in heldout)


def test_tiny_training_reduces_loss(tiny_run: tuple[dict[str, Any], Path]) -> None:
    report, _ = tiny_run
    assert report["training"]["steps"] == 60
    assert report["train_loss"] < report["initial_loss"] - 0.5
    assert report["heldout_loss"] < report["initial_heldout_loss"] - 0.5
    assert report["heldout_subset_bf16"] == pytest.approx(report["heldout_subset_fp32"], abs=0.05)
    assert 0.0 < report["heldout_accuracy"] < 1.0


def test_tiny_export_loads_and_generates(tiny_run: tuple[dict[str, Any], Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = tiny_run
    for name in ("config.json", "generation_config.json", "README.md", "special_tokens_map.json"):
        assert (out / name).is_file()
    assert _safetensors_dtypes(out / "model.safetensors") == {"BF16"}
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    inputs = tokenizer("The list type", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]
    assert "perplexity" in (out / "README.md").read_text(encoding="utf-8")


needs_demo = pytest.mark.skipif(not DEMO_DIR.is_dir(), reason="models/pagedllm-demo not present")


@needs_demo
def test_demo_folder_files() -> None:
    size = sum(p.stat().st_size for p in DEMO_DIR.iterdir() if p.is_file())
    assert size < 40 * 2**20
    assert _safetensors_dtypes(DEMO_DIR / "model.safetensors") == {"BF16"}
    config = json.loads((DEMO_DIR / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    tok_config = json.loads((DEMO_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "add_generation_prompt" in tok_config["chat_template"]


@needs_demo
def test_demo_tokenizer_round_trip_and_chat_template() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR))
    ids = tokenizer(UTF8_TEXT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == UTF8_TEXT
    messages = [{"role": "user", "content": "What is a list?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(tokenizer.bos_token)
    assert prompt.endswith("### Assistant:\n")


@needs_demo
def test_demo_model_loads_and_generates() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR))
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_DIR))
    assert 8_000_000 < sum(p.numel() for p in model.parameters()) < 16_000_000
    inputs = tokenizer("A dictionary is", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    assert text.startswith("A dictionary is") and len(text) > len("A dictionary is")


def test_wsd_schedule_holds_then_decays(tdm: ModuleType) -> None:
    cfg = tdm.TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, lr_schedule="wsd")
    assert tdm.learning_rate(0, 100, cfg) == pytest.approx(1e-4)
    assert tdm.learning_rate(50, 100, cfg, decay_start=None) == pytest.approx(1e-3)
    assert tdm.learning_rate(79, 100, cfg, decay_start=80) == pytest.approx(1e-3)
    assert tdm.learning_rate(90, 100, cfg, decay_start=80) == pytest.approx(5.5e-4)
    assert tdm.learning_rate(100, 100, cfg, decay_start=80) == pytest.approx(1e-4)


def test_repro_command_fixes_the_schedule_of_a_timed_run(tdm: ModuleType) -> None:
    cfg = tdm.parse_args(["--lr-schedule", "wsd", "--max-minutes", "5", "--autocast-bf16"])
    training = tdm.dataclasses.asdict(cfg) | {"steps": 150, "schedule_steps": 160}
    training |= {"decay_start": 120, "out": str(cfg.out)}
    command = tdm.repro_command(training)
    for part in ("--decay-start 120", "--max-steps 150", "--schedule-steps 160"):
        assert part in command
    assert "--max-minutes 0" in command and "--autocast-bf16" in command
    again = tdm.parse_args(command.split()[2:])
    assert (again.decay_start, again.max_steps, again.schedule_steps) == (120, 150, 160)
    assert again.max_minutes is None and again.lr_schedule == "wsd"


class SteppingClock:
    """time.monotonic for the tool: 50 ms pass each time it is read, so a time-limited run
    makes the same steps however fast or loaded this machine is."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.05
        return self.now


def test_timed_wsd_run_is_reproduced_by_its_step_limited_command(
    tdm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's command for a time-limited run gives bit-identical weights."""
    monkeypatch.setattr(tdm, "time", SteppingClock())
    threads = torch.get_num_threads()
    timed, again = tmp_path / "timed", tmp_path / "again"
    base = ["--tiny", "--max-steps", "0", "--eval-every", "1000"]
    try:
        timed_args = [*base, "--out", str(timed), "--lr-schedule", "wsd", "--max-minutes", "0.1"]
        report = tdm.run(tdm.parse_args(timed_args))
        command = tdm.repro_command(report["training"]).split()[2:]
        command[command.index("--out") + 1] = str(again)
        tdm.run(tdm.parse_args(["--tiny", *command]))
    finally:
        torch.set_num_threads(threads)
    assert 0 < report["training"]["decay_start"] < report["training"]["steps"]
    weights = (timed / "model.safetensors").read_bytes()
    assert weights == (again / "model.safetensors").read_bytes()
