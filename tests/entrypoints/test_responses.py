"""/v1/responses through the openai client's ``responses.create`` / ``responses.stream``:
instructions, text and item input, text.format, tools and function-call items,
max_output_tokens, previous_response_id, on a tiny random model (greedy, so a streamed
response can be compared with its non-streamed twin)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread
from pagedllm.entrypoints.openai.serving_responses import ResponseStore

MODEL = "tiny-responses"
# Lists the tools and writes earlier calls and their results back into the prompt.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PERSON = {
    "type": "object",
    "properties": {"name": {"enum": ["ada", "bob"]}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "name": "get_time", "parameters": TIME}]


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("responses-model")
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
    app = build_app(args, [MODEL], log_stats_interval=None, tool_call_parser="hermes")
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def create(client, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_output_tokens", 12)
    return client.responses.create(model=MODEL, **kwargs)


def test_text_input_instructions_and_length(client):
    plain = create(client, input="Tell me a story.")
    assert plain.object == "response" and plain.model == MODEL
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 12 and plain.output_text
    (item,) = plain.output
    assert item.type == "message" and item.content[0].type == "output_text"
    told = create(client, input="Tell me a story.", instructions="Be brief.")
    assert told.instructions == "Be brief."
    assert told.usage.input_tokens > plain.usage.input_tokens  # the system message
    items = create(client, input=[{"role": "user", "content": "Tell me a story."}])
    assert items.output_text == plain.output_text  # text input is one user message
    typed = create(
        client,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me a story."}],
            }
        ],
    )
    assert typed.output_text == plain.output_text


def test_text_format_json_schema(client):
    result = create(
        client,
        input="Who?",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
    )
    assert result.status == "completed" and result.text.format.type == "json_schema"
    jsonschema.validate(json.loads(result.output_text), PERSON)
    # the client's own helper: a pydantic model as text_format, parsed back
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: Literal["ada", "bob"]
        age: int = Field(ge=0)

    parsed = client.responses.parse(
        model=MODEL, input="Who?", temperature=0, max_output_tokens=60, text_format=Person
    )
    assert isinstance(parsed.output_parsed, Person)


def test_function_calls_and_their_outputs_continue_the_conversation(client):
    first = create(
        client,
        input="What time is it?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")
    assert first.status == "completed"
    # The call's output, after the stored conversation: the prompt holds both turns.
    second = create(
        client,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "noon"}],
        tools=TOOLS,
        tool_choice="none",
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The same conversation sent as items gives the same prompt.
    explicit = create(
        client,
        input=[
            {"role": "user", "content": "What time is it?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "noon"},
        ],
        tools=TOOLS,
        tool_choice="none",
    )
    assert explicit.usage.input_tokens == second.usage.input_tokens
    assert explicit.output_text == second.output_text
    named = create(
        client,
        input="Time?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=120,
    )
    assert [o.name for o in named.output] == ["get_time"]
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id


JSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}


def test_stream_events_and_final_response(client):
    whole = create(client, input="Who?", text=JSON_FORMAT, max_output_tokens=100)
    assert whole.status == "completed"
    kinds, text = [], ""
    with client.responses.stream(
        model=MODEL, input="Who?", temperature=0, max_output_tokens=100, text=JSON_FORMAT
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") >= 2
    assert text == whole.output_text == final.output_text
    jsonschema.validate(json.loads(text), PERSON)
    assert final.usage.output_tokens == whole.usage.output_tokens
    # a stored streamed response continues like any other
    after = create(client, previous_response_id=final.id, input="More.")
    assert after.usage.input_tokens > final.usage.input_tokens + final.usage.output_tokens


def test_stream_cut_by_max_output_tokens_ends_incomplete(client):
    whole = create(client, input="Tell me a story.")
    events = list(
        client.responses.create(
            model=MODEL,
            input="Tell me a story.",
            temperature=0,
            max_output_tokens=12,
            stream=True,
        )
    )
    assert events[-1].type == "response.incomplete"
    last = events[-1].response
    assert last.incomplete_details.reason == "max_output_tokens"
    assert last.output_text == whole.output_text and last.usage.output_tokens == 12


def test_streamed_function_call(client):
    events = list(
        client.responses.create(
            model=MODEL,
            input="Time?",
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=120,
            stream=True,
        )
    )
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_time"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments and json.loads(pieces)["zone"] in ("UTC", "CET")
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == pieces
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_unknown_previous_response_and_bad_items_are_client_errors(client):
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        create(client, input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        create(
            client,
            input=[
                {"type": "function_call", "call_id": "c", "name": "get_time", "arguments": "{oops"}
            ],
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")


def test_store_keeps_the_newest():
    store = ResponseStore(max_stored=2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert len(store) == 2 and store.get("r2")[0][0]["content"] == "2"
    with pytest.raises(Exception, match="no stored response"):
        store.get("r0")
