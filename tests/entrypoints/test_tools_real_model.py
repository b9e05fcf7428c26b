"""Tool calling to OpenAI's letter on the real model (SmolLM2-135M-Instruct), through the
openai client against a served app: a few-shot prompt makes the model write Hermes
``<tool_call>`` blocks, and the grammar keeps them to the declared functions."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers.real_model import smollm2_hf_folder
from helpers.serve import pagedllm_serve

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

NAME = "smollm2-hf"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]


def hermes(name: str, city: str) -> str:
    return json.dumps({"name": name, "arguments": {"city": city}}).join(
        ["<tool_call>", "</tool_call>"]
    )


# The examples call functions named after the city: left free, the model invents
# weather_in_berlin, which the request never declared.
FEW_SHOT = [
    {"role": "user", "content": "Weather in Paris and Lima?"},
    {
        "role": "assistant",
        "content": hermes("weather_in_paris", "Paris") + "\n" + hermes("weather_in_lima", "Lima"),
    },
    {"role": "user", "content": "Weather in Rome and Oslo?"},
    {
        "role": "assistant",
        "content": hermes("weather_in_rome", "Rome") + "\n" + hermes("weather_in_oslo", "Oslo"),
    },
    {"role": "user", "content": "Weather in Berlin and Madrid?"},
]


def array(*cities: str) -> str:
    return json.dumps([{"name": "get_weather", "parameters": {"city": c}} for c in cities])


# Examples answering in "required"'s own format, with three calls each.
ARRAY_SHOT = [
    {"role": "user", "content": "Weather in Paris, Lima and Cairo?"},
    {"role": "assistant", "content": array("Paris", "Lima", "Cairo")},
    {"role": "user", "content": "Weather in Rome, Oslo and Bern?"},
    {"role": "assistant", "content": array("Rome", "Oslo", "Bern")},
    {"role": "user", "content": "Weather in Berlin, Madrid and Tokyo?"},
]


@pytest.fixture(scope="module")
def served():
    args = EngineArgs(
        model=str(smollm2_hf_folder()), kv_cache_memory_bytes=1 << 26, max_model_len=2048
    )
    app = build_app(args, [NAME], log_stats_interval=None, tool_call_parser="hermes")
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), app


@pytest.fixture(scope="module")
def client(served):
    return served[0]


def chat(client, messages=FEW_SHOT, **kwargs):
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kwargs)


def calls(choice) -> list[tuple[str, dict]]:
    return [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []
    ]


def test_auto_calls_only_declared_functions(client):
    free = chat(client).choices[0].message.content  # no tools: the model's own names
    assert "weather_in_berlin" in free
    choice = chat(client, tools=TOOLS).choices[0]
    assert calls(choice) == [
        ("get_weather", {"city": "Berlin"}),
        ("get_weather", {"city": "Madrid"}),
    ]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_auto_streams_the_same_declared_calls(client):
    streamed: dict[int, list[str]] = {}
    reasons = []
    for chunk in chat(client, tools=TOOLS, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert [(n, json.loads(a)) for n, a in streamed.values()] == [
        ("get_weather", {"city": "Berlin"}),
        ("get_weather", {"city": "Madrid"}),
    ]
    assert reasons[-1] == "tool_calls"


def test_parallel_tool_calls_false_allows_one_call(client):
    # The same prompt that gave two calls above: the grammar ends the output after one.
    for kwargs in ({}, {"tool_choice": "required"}):
        choice = chat(client, tools=TOOLS, parallel_tool_calls=False, **kwargs).choices[0]
        assert calls(choice) == [("get_weather", {"city": "Berlin"})], kwargs
        assert choice.finish_reason == "tool_calls"


def test_required_cut_by_length_returns_its_complete_calls(client):
    whole = chat(client, ARRAY_SHOT, tools=TOOLS, tool_choice="required").choices[0]
    assert len(calls(whole)) == 3 and whole.finish_reason == "tool_calls"
    # 30 tokens hold the first call and part of the second
    cut = chat(client, ARRAY_SHOT, tools=TOOLS, tool_choice="required", max_tokens=30)
    choice = cut.choices[0]
    assert cut.usage.completion_tokens == 30 and choice.finish_reason == "length"
    assert calls(choice) == calls(whole)[:1] and choice.message.content is None
    stream = chat(
        client, ARRAY_SHOT, tools=TOOLS, tool_choice="required", max_tokens=30, stream=True
    )
    chunks = list(stream)
    streamed = [tc for chunk in chunks for tc in chunk.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == calls(
        whole
    )[:1]


def test_template_that_drops_tools_is_reported(client):
    # SmolLM2's template does not list tools: the prompt is the same with and without them.
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=1
    )
    assert "ignores `tools`" in raw.headers["warning"]
    assert raw.headers["warning"].startswith('299 pagedllm "')
    plain = client.chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    assert "warning" not in plain.headers
    assert raw.parse().usage.prompt_tokens == plain.parse().usage.prompt_tokens
    streamed = client.chat.completions.with_raw_response.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        max_tokens=1,
        stream=True,
    )
    assert "ignores `tools`" in streamed.headers["warning"]
    assert list(streamed.parse())  # the stream itself is unaffected


def test_response_names_the_model_the_request_used(client):
    folder = str(smollm2_hf_folder())
    for name in (NAME, folder):
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        assert r.model == name
        c = client.completions.create(model=name, prompt="hi", max_tokens=1)
        assert c.model == name
        chunks = list(client.completions.create(model=name, prompt="hi", max_tokens=2, stream=True))
        assert {ch.model for ch in chunks} == {name}


def weather_call(city: str) -> dict:
    call = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{city}", "type": "function", "function": call}],
    }


def test_serve_chat_template_gives_tools_to_a_model_without_them():
    """`pagedllm serve --chat-template chatml_tools --tool-call-parser hermes`: the prompt
    lists the tools (no warning), earlier calls are written as <tool_call> blocks, and the
    model calls the declared function. With --reasoning-parser qwen3 the grammar also admits
    a <think> block first; SmolLM2 writes none, so there is no reasoning_content."""
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        weather_call("Paris"),
        {"role": "user", "content": "What is the weather in Rome?"},
        weather_call("Rome"),
        {"role": "user", "content": "What is the weather in Berlin?"},
    ]
    folder = str(smollm2_hf_folder())
    with pagedllm_serve(
        folder,
        f"--served-model-name={NAME}",
        "--max-model-len=2048",
        "--kv-cache-memory-bytes=67108864",
        "--chat-template=chatml_tools",
        "--tool-call-parser=hermes",
        "--reasoning-parser=qwen3",
    ) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=NAME, messages=history, tools=TOOLS, temperature=0, max_tokens=60
        )
        assert "warning" not in raw.headers
        choice = raw.parse().choices[0]
        assert calls(choice) == [("get_weather", {"city": "Berlin"})]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.reasoning_content is None
        # /tokenize renders the same messages without tools: the listing adds tokens
        without = httpx.post(url + "/tokenize", json={"model": NAME, "messages": history})
        assert raw.parse().usage.prompt_tokens > without.json()["count"] + 50
