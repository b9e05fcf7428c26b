"""The tokenizer built from a GGUF file's vocabulary, against transformers' GGUF tokenizer.

SentencePiece-style ``llama`` vocabularies are written by helpers.gguf_files from a BPE
trained here (with and without stored merges); byte-level ``gpt2`` ones from a tiny model's
tokenizer.json. The real model's vocabulary is tested in tests/models/test_real_model_gguf.py.
"""

from __future__ import annotations

import json

import pytest
from helpers.gguf_files import write_model_gguf, write_spm_gguf

from pagedllm.engine.gguf_tokenizer import sentencepiece_merges
from pagedllm.engine.tokenizer import load_tokenizer, stop_token_ids_from_generation_config

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world, hello there! "
    "Tokenizers split text into pieces; the pieces merge back. 1234 5678 "
) * 30
STRINGS = [
    "Hello world",
    "hello there the quick fox",
    "  two leading spaces and   runs   ",
    "tabs\tand\nnew\n\nlines",
    "unicode: héllo wörld, 日本語, emoji 🤖 (byte fallback)",
    "def f(x):\n    return x ** 2  # code",
    "numbers 1234567 and 3.14",
    "<s>inline bos</s> and <|im_end|> control",
    "a <think>user token</think> here",
    "",
    " ",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _trained_pieces() -> tuple[list[str], list[str]]:
    from tokenizers import SentencePieceBPETokenizer

    tok = SentencePieceBPETokenizer()
    tok.train_from_iterator([CORPUS], vocab_size=200, show_progress=False)
    data = json.loads(tok.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return [t for t, _ in vocab], merges


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    pieces, merges = _trained_pieces()
    folder = tmp_path_factory.mktemp("spm")
    common = dict(control=("<|im_start|>", "<|im_end|>"), user_defined=("<think>", "</think>"))
    files = {
        "merges": write_spm_gguf(folder / "merges.gguf", pieces, merges, **common),
        "scores": write_spm_gguf(
            folder / "scores.gguf",
            pieces,
            None,
            chat_template=TEMPLATE,
            eot_token="<|im_end|>",
            **common,
        ),
        "eos": write_spm_gguf(folder / "eos.gguf", pieces, merges, add_bos=False, add_eos=True),
        "unflagged": write_spm_gguf(folder / "unflagged.gguf", pieces, merges, add_bos=None),
    }
    return files


def _transformers(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("variant", ["merges", "scores", "eos", "unflagged"])
def test_sentencepiece_vocab_encodes_and_decodes_like_transformers(spm_files, variant):
    path = spm_files[variant]
    ours, theirs = load_tokenizer(str(path)), _transformers(path)
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        ), text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        ), text
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)


def test_bos_and_eos_follow_the_files_flags(spm_files):
    with_bos = load_tokenizer(str(spm_files["merges"])).encode("hello")
    with_eos = load_tokenizer(str(spm_files["eos"])).encode("hello")
    unflagged = load_tokenizer(str(spm_files["unflagged"])).encode("hello")
    assert with_bos[0] == 1 and with_bos[-1] != 2
    assert with_eos[0] != 1 and with_eos[-1] == 2
    assert unflagged[0] == 1  # a SentencePiece vocabulary without the flag adds BOS


def test_control_and_user_defined_tokens_stay_whole(spm_files):
    tok = load_tokenizer(str(spm_files["merges"]))
    ids = tok.encode("x<|im_end|>y<think>z", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    assert tok.convert_tokens_to_ids("<think>") in ids
    assert "<|im_end|>" in tok.all_special_tokens and "<think>" not in tok.all_special_tokens
    assert tok.decode(ids, skip_special_tokens=True).count("<think>") == 1


def test_chat_template_comes_from_the_file(spm_files):
    path = spm_files["scores"]
    ours, theirs = load_tokenizer(str(path)), _transformers(path)
    assert ours.chat_template == TEMPLATE
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "héllo 🤖"},
    ]
    for prompt in (True, False):
        kw = dict(tokenize=False, add_generation_prompt=prompt)
        want = theirs.apply_chat_template(conversation, **kw)
        text = ours.apply_chat_template(conversation, **kw)
        assert text == want
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )


def test_merges_recovered_from_scores_are_the_stored_ones_in_effect(spm_files):
    """A file without merges tokenizes like the one that stores them."""
    stored, derived = (load_tokenizer(str(spm_files[k])) for k in ("merges", "scores"))
    for text in STRINGS:
        assert stored.encode(text) == derived.encode(text), text


def test_sentencepiece_merges_order_by_score_then_left_length():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert sentencepiece_merges(tokens, scores) == [
        ("b", "c"),
        ("a", "b"),
        ("ab", "c"),
        ("a", "bc"),
    ]


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe"])
def test_byte_level_vocab_of_a_tiny_model_matches_transformers(model_factory, tmp_path, pre):
    """The pre-tokenizer split named by tokenizer.ggml.pre (digits one by one for qwen2,
    in threes for llama-bpe) is the one transformers applies."""
    folder = model_factory("llama")
    path = write_model_gguf(folder, tmp_path / "m.gguf", "llama", pre=pre)
    ours, theirs = load_tokenizer(str(path)), _transformers(path)
    for text in [*STRINGS, "naïve café — 日本語 ✓ emoji 🙂 done.", "x 1234567 y'S\r\n z"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text)), text
    assert ours.eos_token == theirs.eos_token == "</s>"


def test_tokenizer_flag_overrides_the_files_vocabulary(model_factory, tmp_path):
    from pagedllm.config import EngineArgs

    folder = model_factory("llama")
    path = write_model_gguf(folder, tmp_path / "m.gguf", "llama")
    assert EngineArgs(model=str(path)).create_engine_config().model.tokenizer == str(path)
    config = EngineArgs(model=str(path), tokenizer=str(folder)).create_engine_config()
    assert type(load_tokenizer(config.model.tokenizer)).__name__ == "FastTokenizer"
    assert load_tokenizer(config.model.tokenizer).name_or_path == str(folder)


def test_unknown_tokenizer_models_are_refused_clearly(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "llama")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'t5' tokenizer"):
        load_tokenizer(str(tmp_path / "t5.gguf"))


def test_end_of_turn_tokens_stop_generation(spm_files):
    tok = load_tokenizer(str(spm_files["scores"]))
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids_from_generation_config(str(spm_files["scores"])) == {2, eot}
    assert stop_token_ids_from_generation_config(str(spm_files["merges"])) == {2}


def test_transformers_view_of_the_built_tokenizer_encodes_the_same(spm_files):
    """Structured outputs compile grammars against transformers' tokenizer object."""
    tok = load_tokenizer(str(spm_files["scores"]))
    hf = tok.hf_tokenizer()
    for text in STRINGS:
        assert hf.encode(text) == tok.encode(text), text
    assert hf.eos_token == tok.eos_token and hf.chat_template == tok.chat_template
