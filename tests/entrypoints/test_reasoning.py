"""Reasoning output: ``--reasoning-parser`` splits the <think> block into
``reasoning_content``, streamed as deltas of its own; output constraints and tools apply
after the block. A tiny random model whose chat template opens the block (as DeepSeek-R1's
does) and closes it at once for ``enable_thinking: false`` (as Qwen3's does); the grammar's
``thinking_token_budget`` makes it end its reasoning."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

MODEL = "tiny-think"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
PERSON = {
    "type": "object",
    "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "Who?"}]


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("think-model")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(folder))
    # Without prefix caching a repeated request runs the same shapes through the same
    # kernels, so that greedy output (streamed or not) repeats on this random model.
    args = EngineArgs(
        model=str(folder),
        kv_cache_memory_bytes=1 << 22,
        max_model_len=512,
        enable_prefix_caching=False,
    )
    app = build_app(
        args,
        [MODEL],
        log_stats_interval=None,
        tool_call_parser="hermes",
        reasoning_parser="deepseek_r1",
    )
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, **kwargs)


def budget(n: int) -> dict:
    return {"thinking_token_budget": n}


def test_reasoning_then_the_schema(client):
    result = chat(client, response_format=FORMAT, extra_body=budget(6))
    message = result.choices[0].message
    assert message.reasoning_content  # six tokens of free text
    assert "</think>" not in message.reasoning_content + message.content
    jsonschema.validate(json.loads(message.content), PERSON)
    assert result.choices[0].finish_reason == "stop"
    # A longer budget: more reasoning, still the schema after it
    longer = chat(client, response_format=FORMAT, extra_body=budget(20)).choices[0].message
    assert len(longer.reasoning_content) > len(message.reasoning_content)
    jsonschema.validate(json.loads(longer.content), PERSON)


def test_reasoning_streams_as_its_own_deltas(client):
    whole = chat(client, response_format=FORMAT, extra_body=budget(16)).choices[0].message
    kinds, reasoning, content = [], "", ""
    for chunk in chat(client, response_format=FORMAT, extra_body=budget(16), stream=True):
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None)
        if piece:
            reasoning += piece
            kinds.append("r")
        if delta.content:
            content += delta.content
            kinds.append("c")
    assert reasoning == whole.reasoning_content and content == whole.content
    # all reasoning deltas come first, then the answer's
    assert kinds.count("r") >= 2 and kinds == sorted(kinds, reverse=True)


def test_enable_thinking_false_reaches_the_template(client):
    on = chat(client, response_format=FORMAT, extra_body=budget(4))
    off = chat(
        client,
        response_format=FORMAT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty block is in the prompt
    message = off.choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), PERSON)  # the schema from the first token


def test_tools_after_reasoning(client):
    choice = chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=budget(5),
    ).choices[0]
    assert choice.message.reasoning_content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert json.loads(choice.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    # streamed: the reasoning deltas, then the call's
    reasoning, name, arguments, content = "", "", "", ""
    for chunk in chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=budget(5),
        stream=True,
    ):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            assert reasoning == choice.message.reasoning_content  # all reasoning came first
            name += tc.function.name or ""
            arguments += tc.function.arguments or ""
    assert name == "get_time" and arguments == choice.message.tool_calls[0].function.arguments
    assert content == ""


def test_unfinished_reasoning_is_all_reasoning(client):
    choice = chat(client, max_tokens=10).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and choice.message.reasoning_content


# ---- the parsers on real token streams ------------------------------------------------------
CASES = [
    # parser, prompt ending, output, reasoning, content
    (
        "deepseek_r1",
        "assistant:<think>\n",
        "plan a b</think>\n\nThe answer.",
        "plan a b",
        "The answer.",
    ),
    ("deepseek_r1", "assistant:", "<think>\nplan</think>answer", "plan", "answer"),
    ("deepseek_r1", "assistant:", "plan with no end", "plan with no end", None),
    ("qwen3", "assistant:", "<think>\nsteps</think>\n\nDone <b>.", "steps", "Done <b>."),
    ("qwen3", "assistant:", "No thinking at all.", "", "No thinking at all."),
    ("qwen3", "assistant:<think>\n\n</think>\n\n", "<think>x</think>y", "", "<think>x</think>y"),
]


@pytest.mark.parametrize("name, prompt, output, reasoning, content", CASES)
def test_parsers_split_and_stream_alike(tiny_llama, name, prompt, output, reasoning, content):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = tok.encode(output, add_special_tokens=False)
    parser = get_reasoning_parser(name)(prompt)
    final = parser.split(output, finished=True)
    assert (final.reasoning, final.content) == (reasoning, content)
    # Fed token by token, the pieces add up to the same split and never shrink.
    sent_r, last_content = "", ""
    for i in range(1, len(ids) + 1):
        split = parser.split(tok.decode(ids[:i]), finished=i == len(ids))
        assert split.reasoning.startswith(sent_r)
        sent_r = split.reasoning
        if split.content is not None:
            assert split.content.startswith(last_content)
            last_content = split.content
    assert sent_r == reasoning and (last_content if content is not None else None) == content


def test_responses_api_gives_a_reasoning_item(client):
    """/v1/responses: the block is a reasoning item before the message, streamed as
    reasoning_text deltas."""
    result = client.responses.create(
        model=MODEL,
        input="Who?",
        temperature=0,
        max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert [o.type for o in result.output] == ["message"]  # thinking off: no reasoning item
    cut = client.responses.create(model=MODEL, input="Who?", temperature=0, max_output_tokens=30)
    assert [o.type for o in cut.output] == ["reasoning", "message"]
    (reasoning,) = cut.output[0].content
    assert reasoning.type == "reasoning_text" and reasoning.text
    assert cut.output_text == "" and cut.status == "incomplete"
    events = list(
        client.responses.create(
            model=MODEL, input="Who?", temperature=0, max_output_tokens=30, stream=True
        )
    )
    pieces = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(pieces) >= 2 and "".join(pieces) == reasoning.text
    assert events[-1].response.output[0].content[0].text == reasoning.text
