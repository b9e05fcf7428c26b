"""Structured outputs and tool calling over the OpenAI API, driven by the openai client
against a server started here (tiny random model, Hermes tool parser, a chat template that
lists the tools and writes earlier calls back)."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import openai
import pytest

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

MODEL = "tiny-tools"
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
# Makes the random model write a Hermes call, so "auto" parsing is exercised for real.
HERMES_REGEX = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
    r'"unit": "(celsius|fahrenheit)"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tools-model")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(folder))
    args = EngineArgs(model=str(folder), kv_cache_memory_bytes=1 << 22, max_model_len=512)
    app = build_app(args, [MODEL], log_stats_interval=None, tool_call_parser="hermes")
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "What is the weather?"}])
    kwargs.setdefault("max_tokens", 300)
    return client.chat.completions.create(model=MODEL, **kwargs)


def test_response_format_json_schema(client):
    for seed in range(3):
        out = chat(
            client,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_structured_outputs_and_guided_aliases(client):
    out = client.completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=20,
        n=3,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert all(c.text in ("red", "green", "blue") for c in out.choices)
    out = client.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=20,
        temperature=1.0,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.choices[0].text)
    out = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=200,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(out.choices[0].text), dict)


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "JSON schema",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "regex"),
        ({"extra_body": {"guided_json": {}, "guided_regex": "a"}}, "only one"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
        ({"extra_body": {"thinking_token_budget": 4}}, "--reasoning-parser"),
    ],
)
def test_bad_constraints_are_400s(client, body, words):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, **body)
    assert err.value.status_code == 400 and words in str(err.value)
    assert chat(client, max_tokens=3).choices[0].message.content is not None  # still serving


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_tool_round_trip(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = chat(client, messages=messages, tools=TOOLS, tool_choice="required", seed=3)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(_check_call(c) is not None for c in calls)
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump(exclude_none=True) for c in calls],
        }
    )
    for c in calls:
        messages.append({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"})
    final = chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content
    # The template wrote the tools, the call and its result into the prompt.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 10

    named = chat(
        client,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    ).choices[0]
    assert named.finish_reason == "stop"
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    _check_call(named.message.tool_calls[0])


def _stream_calls(client, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize(
    "kwargs, finish",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "stop"),
        ({"tool_choice": "required", "seed": 5, "temperature": 1.0}, "tool_calls"),
        (
            {
                "tool_choice": "auto",
                "temperature": 1.0,
                "extra_body": {"guided_regex": HERMES_REGEX},
            },
            "tool_calls",
        ),
    ],
)
def test_streamed_tool_call_deltas_reassemble(client, kwargs, finish):
    content, calls, got_finish = _stream_calls(client, tools=TOOLS, **kwargs)
    assert got_finish == finish and calls and content == ""
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


# Two calls forced by a regex (the request's own constraint, so the tool grammar is off):
# one of a function the request never declared, then a declared one.
TWO_CALLS_REGEX = (
    r'<tool_call>\{"name": "(get_weather|weather_in_paris)", "arguments": \{"city": "paris", '
    r'"unit": "celsius"\}\}</tool_call><tool_call>\{"name": "get_time", "arguments": '
    r'\{"zone": "UTC"\}\}</tool_call>'
)


def test_undeclared_and_extra_calls_are_dropped_without_a_grammar(client, caplog):
    undeclared = TWO_CALLS_REGEX.replace("(get_weather|weather_in_paris)", "weather_in_paris")
    with caplog.at_level("WARNING", logger="pagedllm.entrypoints.openai.tools"):
        for stream in (False, True):
            kwargs = {"tools": TOOLS, "extra_body": {"guided_regex": undeclared}}
            if stream:
                _, streamed, finish = _stream_calls(client, **kwargs)
                names = [c["name"] for c in streamed.values()]
                assert sorted(streamed) == [0]  # the kept call is renumbered
            else:
                choice = chat(client, **kwargs).choices[0]
                names, finish = [c.function.name for c in choice.message.tool_calls], None
                finish = choice.finish_reason
            assert names == ["get_time"] and finish == "tool_calls"
    assert "'weather_in_paris', a function the request did not declare" in caplog.text
    declared = TWO_CALLS_REGEX.replace("(get_weather|weather_in_paris)", "get_weather")
    both = chat(client, tools=TOOLS, extra_body={"guided_regex": declared}).choices[0]
    assert [c.function.name for c in both.message.tool_calls] == ["get_weather", "get_time"]
    one = chat(
        client, tools=TOOLS, parallel_tool_calls=False, extra_body={"guided_regex": declared}
    ).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]


def test_auto_grammar_admits_only_declared_calls(tiny_llama):
    """The "auto" grammar itself, on the tiny model's vocabulary: free text, then from
    <tool_call> only declared functions with valid arguments; one call unless parallel."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.openai.structural import as_params
    from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
    from pagedllm.entrypoints.openai.tools import call_schemas, tool_mode
    from pagedllm.structured_output.backend import XGrammarBackend

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    backend = XGrammarBackend(tok, 320, [tok.eos_token_id])
    functions = tool_mode(TOOLS, "auto").functions

    def matcher(parallel: bool) -> xgr.GrammarMatcher:
        fmt = HermesToolParser.call_format(call_schemas(functions, "arguments"), parallel)
        return backend.matcher(backend.compile(as_params(fmt))).matcher

    good = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert matcher(True).accept_string("Let me see. " + good + " ok " + good)
    assert not matcher(True).accept_string('<tool_call>{"name": "weather_in_paris"')
    assert not matcher(True).accept_string('<tool_call>{"name": "get_time", "arguments": {"city"')
    single = matcher(False)
    assert single.accept_string("Let me see. " + good)
    assert not single.accept_string(" ")  # nothing may follow the one call
    assert single.accept_token(tok.eos_token_id) and single.is_terminated()
