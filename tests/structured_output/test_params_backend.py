"""StructuredOutputsParams validation, xgrammar compilation errors and the manager's rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.structured_output.manager import StructuredOutputManager

DEMO = Path(__file__).resolve().parents[2] / "models" / "pagedllm-demo"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO))


@pytest.fixture()
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, 4096, [tokenizer.eos_token_id], overlap=True)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({}, "exactly one"),
        ({"json": {"type": "object"}, "regex": "a+"}, "exactly one"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", ""]}, "choice"),
        ({"regex": ""}, "regex"),
        ({"json": 3}, "json"),
    ],
)
def test_params_reject_bad_fields(fields, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**fields)


def test_sampling_params_type_checked():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"json": {"type": "foo"}}, "not a valid JSON schema"),
        ({"json": '{"type": "object"'}, "not valid JSON"),
        ({"json": {"properties": {"a": {"$ref": "#/nope"}}}}, "json is invalid"),
        ({"regex": "a(b"}, "regex is invalid: .*parenthesis"),
        ({"grammar": 'root ::= "a" | foo'}, 'grammar is invalid: .*"foo"'),
    ],
)
def test_compile_errors_name_the_problem(manager, fields, words):
    with pytest.raises(ValueError, match=words):
        manager.compile(StructuredOutputsParams(**fields))


def _seq(seq_id: int, prompt: list[int], params: SamplingParams) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, params, 2)


def test_manager_rows_follow_sampling_order(manager, tokenizer):
    compiled = manager.compile(StructuredOutputsParams(choice=["yes", "no"]))
    free, chunked, constrained = (_seq(i, [5, 6, 7, 8], SamplingParams()) for i in range(3))
    manager.add([chunked, constrained], compiled)
    out = SchedulerOutput(
        [
            ScheduledSequence(free, 4),  # samples: row 0, unconstrained
            ScheduledSequence(chunked, 2),  # a prompt chunk: no row
            ScheduledSequence(constrained, 4),  # samples: row 1, constrained
        ],
        10,
    )
    pending = manager.prepare(out)
    assert pending is not None
    mask = pending.result()
    assert mask.rows == [1]
    assert mask.bitmask.shape == (2, 4096 // 32)
    logits = torch.zeros(2, 4096)
    pending.apply(logits)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert torch.isfinite(logits[0]).all()  # the free row is untouched
    assert manager.stats.num_masks == 1


def test_manager_costs_nothing_without_constraints(manager):
    seq = _seq(0, [5, 6], SamplingParams())
    assert manager.prepare(SchedulerOutput([ScheduledSequence(seq, 2)], 2)) is None
    assert manager._pool is None  # no thread was even started


def test_advance_finishes_on_termination_and_drops_finished(manager, tokenizer):
    compiled = manager.compile(StructuredOutputsParams(choice=["yes"]))
    seq = _seq(0, [5, 6], SamplingParams())
    manager.add([seq], compiled)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        seq.append_token(token)
        assert manager.advance([seq]) == []
    seq.append_token(tokenizer.eos_token_id)
    assert manager.advance([seq]) == [seq]  # the grammar ended with EOS
    seq.status = SequenceStatus.FINISHED_STOPPED
    assert manager.prepare(SchedulerOutput([], 0)) is None
    assert 0 not in manager


def test_rejected_token_finishes_the_sequence(manager, tokenizer):
    compiled = manager.compile(StructuredOutputsParams(regex="[0-9]+"))
    seq = _seq(0, [5], SamplingParams())
    manager.add([seq], compiled)
    seq.append_token(tokenizer.encode("x", add_special_tokens=False)[0])
    assert manager.advance([seq]) == [seq]


def test_schema_walk_accepts_a_valid_document(manager, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compiled = manager.compile(StructuredOutputsParams(json=json.dumps(schema)))
    seq = _seq(0, [5], SamplingParams())
    manager.add([seq], compiled)
    for token in tokenizer.encode('{"a": 12}', add_special_tokens=False):
        seq.append_token(token)
        assert manager.advance([seq]) == []


@pytest.mark.parametrize(
    ("body", "legal"),
    [
        (b"abc", True),
        ("é\U0010ffff".encode(), True),  # two bytes, and the last code point
        ("\u0915".encode(), True),  # U+0915, three bytes
        ("\U0001f600".encode(), True),  # four bytes
        (b"\xe0\x90\x90", False),  # U+0410 overlong in three bytes
        (b"\xc0\x80", False),  # NUL overlong in two
        (b"\xf0\x80\x80\x80", False),  # overlong in four
        (b"\xed\xa0\x80", False),  # a UTF-16 surrogate
        (b"\xf4\x90\x80\x80", False),  # past U+10FFFF
        (b"\x01", False),  # a raw control character
    ],
)
def test_bounded_strings_take_only_well_formed_utf8(body, legal):
    """A maxLength string's pattern admits each character's one UTF-8 form: a byte-level
    matcher takes well-formed characters and refuses overlong, surrogate and out-of-range
    forms (xgrammar's own classes admitted E0 90 90) and control characters."""
    import xgrammar as xgr

    from pagedllm.structured_output.backend import bounded_strings_as_patterns

    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)], vocab_type=xgr.VocabType.RAW)
    schema = bounded_strings_as_patterns({"type": "string", "maxLength": 3})
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    matcher = xgr.GrammarMatcher(grammar)
    text = b'"' + body + b'"'
    assert all(matcher.accept_token(b) for b in text) == legal
