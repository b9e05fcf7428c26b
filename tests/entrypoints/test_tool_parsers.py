"""The Hermes tool parser and the constrained ("required" / named) readers, streaming included."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.serving import ServingError
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tools import ConstrainedToolParser, tool_mode

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]

TWO_CALLS = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"", '
    '"when": {"day": [1, 2]}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def _reassemble(parser, text: str, cuts: list[int]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    so_far = ""
    for i, piece in enumerate(pieces):
        so_far += piece
        delta = parser.stream(so_far, finished=i == len(pieces) - 1)
        content += delta.content
        for tc in delta.tool_calls:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = tc.id, tc.name
            else:
                assert call["id"] is not None, "the name comes before the arguments"
            call["arguments"] += tc.arguments
    return content, calls


def test_hermes_extract():
    parser = get_tool_parser("hermes")()
    out = parser.extract(TWO_CALLS)
    assert out.content == "Let me check.\n"
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(out.tool_calls[0].arguments) == {
        "city": 'Paris "Nord"',
        "when": {"day": [1, 2]},
    }
    assert json.loads(out.tool_calls[1].arguments) == {}


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json}</tool_call>"])
def test_hermes_text_without_valid_calls_is_content(text):
    out = get_tool_parser("hermes")().extract(text)
    assert not out.tools_called and out.content == text


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_streaming_reassembles_at_any_chunking(step):
    parser = get_tool_parser("hermes")()
    cuts = list(range(step, len(TWO_CALLS), step))
    content, calls = _reassemble(parser, TWO_CALLS, cuts)
    expected = get_tool_parser("hermes")().extract(TWO_CALLS)
    assert content == "Let me check.\n"
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    for i, call in enumerate(expected.tool_calls):
        assert calls[i]["arguments"] == call.arguments
        json.loads(calls[i]["arguments"])


def test_hermes_streaming_holds_back_a_partial_tag():
    parser = get_tool_parser("hermes")()
    assert parser.stream("Hi <tool", finished=False).content == "Hi "
    assert parser.stream("Hi <tool!", finished=False).content == "<tool!"


def test_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def test_tool_choice_validation():
    assert tool_mode(TOOLS, None).kind == "auto"
    assert tool_mode(None, None).kind == "none"
    with pytest.raises(ServingError, match="not in tools"):
        tool_mode(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ServingError, match="needs tools"):
        tool_mode(None, "required")
    with pytest.raises(ServingError, match="function tool"):
        tool_mode([{"type": "retrieval"}], "auto")


def test_named_and_required_readers():
    named = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert named.structured_outputs().json == TOOLS[0]["function"]["parameters"]
    parser = ConstrainedToolParser(named)
    content, calls = _reassemble(parser, '{"city": "Oslo"}', [3, 9])
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}

    required = tool_mode(TOOLS, "required")
    text = (
        '[{"name": "get_time", "parameters": {}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    )
    content, calls = _reassemble(ConstrainedToolParser(required), text, [5, 40])
    assert [calls[0]["name"], calls[1]["name"]] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["arguments"]) == {"city": "Rome"}


def test_auto_tool_choice_needs_a_parser():
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving import ServedModel
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

    class NoEngine:  # what the handler reads at construction, and nothing to run
        engine = SimpleNamespace(
            config=SimpleNamespace(model=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=8)))
        )

        def get_tokenizer(self) -> None:
            return None

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    model = ServedModel(names=["m"], path="m", max_model_len=64)
    with pytest.raises(ServingError, match="--tool-call-parser"):
        OpenAIServingChat(NoEngine(), model)._constraint(req, tool_mode(TOOLS, None), "")
    with_parser = OpenAIServingChat(NoEngine(), model, tool_call_parser="hermes")
    # "auto": free text, and from <tool_call> on only the declared functions
    auto = with_parser._constraint(req, tool_mode(TOOLS, None), "")
    assert auto.kind == "structural_tag"
    (tag,) = json.loads(auto.structural_tag)["format"]["tags"]
    names = [
        c["properties"]["name"]["const"]
        for c in tag["content"]["elements"][1]["json_schema"]["anyOf"]
    ]
    assert names == [t["function"]["name"] for t in TOOLS]
    assert with_parser._constraint(req, tool_mode(TOOLS, "required"), "").kind == "json"


def test_required_streams_each_call_when_complete():
    parser = ConstrainedToolParser(tool_mode(TOOLS, "required"))
    first = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_w'
    delta = parser.stream(first, finished=False)
    assert [(tc.index, tc.name) for tc in delta.tool_calls] == [(0, "get_time")]
    assert json.loads(delta.tool_calls[0].arguments) == {"zone": "UTC"}
    assert not parser.stream(first + "eather", finished=False)


def test_required_cut_short_keeps_its_complete_calls():
    parser = ConstrainedToolParser(tool_mode(TOOLS, "required"))
    cut = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_wea'
    extracted = parser.extract(cut)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == [
        ("get_time", {"zone": "UTC"})
    ]
    assert extracted.content is None
    assert parser.extract('[{"name": "get_ti').content == '[{"name": "get_ti'


def test_chat_template_flag_takes_a_file_inline_text_or_a_builtin(tmp_path):
    from pagedllm.entrypoints.openai.chat_templates import CHATML_TOOLS, load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}x{% endfor %}").startswith("{% for")
    assert load_chat_template("chatml_tools") == CHATML_TOOLS
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="not a file, an inline Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
