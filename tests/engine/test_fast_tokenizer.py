"""FastTokenizer (tokenizers + jinja2) behaves as transformers' AutoTokenizer does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.engine.fast_tokenizer import FastTokenizer, is_plain

DEMO = Path(__file__).resolve().parents[2] / "models" / "pagedllm-demo"
TEXTS = [
    "The list type",
    "",
    " leading and trailing spaces ",
    "naïve café — 日本語 ✓ emoji 🙂",
    "A dictionary is a mapping.\n\n    def f(x):\n        return x  # don't",
    "<s> literal specials </s> <pad>",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A sequence."},
    {"role": "user", "content": "And a dict?"},
]


def _folders(model_factory) -> list[Path]:
    folders = [model_factory("llama")]
    if (DEMO / "tokenizer.json").exists():
        folders.append(DEMO)
    return folders


def _assert_same(folder: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = FastTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert is_plain(folder)
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                )
    for prompt in (True, False):
        kwargs = dict(add_generation_prompt=prompt, tokenize=False)
        assert ours.apply_chat_template(MESSAGES, **kwargs) == theirs.apply_chat_template(
            MESSAGES, **kwargs
        )
    assert ours.apply_chat_template(MESSAGES, tokenize=True) == theirs.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=False
    )


def test_matches_autotokenizer(model_factory) -> None:
    for folder in _folders(model_factory):
        _assert_same(folder)


def test_folders_transformers_would_rewrite_are_not_plain(model_factory, tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(model_factory("llama"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=True)
    config_path.write_text(json.dumps(config))
    assert not is_plain(folder)
    config.update(add_bos_token=None, tokenizer_class="LlamaTokenizerFast")
    del config["add_bos_token"]
    config_path.write_text(json.dumps(config))
    assert not is_plain(folder)


def test_no_chat_template_is_a_value_error(model_factory, tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(model_factory("llama"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok = FastTokenizer(folder)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(MESSAGES)


def test_loading_imports_neither_torch_nor_transformers() -> None:
    if not (DEMO / "tokenizer.json").exists():
        pytest.skip("demo model absent")
    code = (
        "import sys; from pagedllm.engine.fast_tokenizer import FastTokenizer; "
        f"t = FastTokenizer({str(DEMO)!r}); "
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
