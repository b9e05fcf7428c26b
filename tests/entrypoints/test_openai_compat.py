"""What third-party OpenAI clients rely on beyond plain generation: echo + logprobs scoring
(lm-evaluation-harness's loglikelihood), model retrieval and 404s (openai.NotFoundError), the
default served names (the model folder, so that clients find its tokenizer, and its name),
and HTTP details (/health's body, 405's Allow)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

PROMPT = "The quick brown fox"


def engine_args(model: Path) -> EngineArgs:
    return EngineArgs(model=str(model), kv_cache_memory_bytes=1 << 22, max_model_len=128)


@pytest.fixture(scope="module")
def url(tiny_llama) -> Iterator[str]:
    app = build_app(engine_args(tiny_llama), None, log_stats_interval=None)  # default names
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(**vars(engine_args(tiny_llama)))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


# ---- echo + logprobs ---------------------------------------------------------------------
def test_echo_with_max_tokens_0_is_the_engines_prompt_logprobs(url, tiny_llama, offline) -> None:
    result = client(url).completions.create(
        model=str(tiny_llama), prompt=PROMPT, max_tokens=0, echo=True, logprobs=2
    )
    (choice,) = result.choices
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    ids, plp = expected.prompt_token_ids, expected.prompt_logprobs
    assert len(ids) >= 4 and plp[0] is None and len(plp) == len(ids)
    lp = choice.logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == 0
    tokenizer = offline.get_tokenizer()
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [entry[t].logprob for t, entry in zip(ids[1:], plp[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for top, entry in zip(lp.top_logprobs[1:], plp[1:]):
        want_top: dict[str, float] = {}
        for t, p in sorted(entry.items(), key=lambda kv: kv[1].rank):
            want_top.setdefault(tokenizer.decode([t]), p.logprob)  # texts may repeat
        assert top.keys() == want_top.keys() and 1 <= len(top) <= 3  # top-2 + the prompt's
        assert top == pytest.approx(want_top, abs=1e-4)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def test_echo_logprobs_then_generated_ones(url, tiny_llama) -> None:
    kwargs = dict(model=tiny_llama.name, prompt=PROMPT, temperature=0.0, logprobs=1)
    echoed = client(url).completions.create(**kwargs, max_tokens=5, echo=True)
    plain = client(url).completions.create(**kwargs, max_tokens=5)
    scored = client(url).completions.create(**kwargs, max_tokens=0, echo=True)
    n_prompt = len(scored.choices[0].logprobs.tokens)
    e, p, s = echoed.choices[0], plain.choices[0], scored.choices[0]
    assert e.text == PROMPT + p.text
    assert e.logprobs.tokens == s.logprobs.tokens + p.logprobs.tokens
    assert e.logprobs.token_logprobs[1:n_prompt] == pytest.approx(s.logprobs.token_logprobs[1:])
    assert e.logprobs.token_logprobs[n_prompt:] == pytest.approx(p.logprobs.token_logprobs)
    assert e.logprobs.text_offset[n_prompt] == len("".join(s.logprobs.tokens))
    assert echoed.usage.completion_tokens == 5


def test_streamed_echo_logprobs_equal_the_plain_response(url) -> None:
    # n=2: the stream's outputs are deltas, and only the first carries the prompt's logprobs;
    # the second choice's echo must still have them, whichever output starts it.
    body = {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 2, "n": 2, "seed": 3}
    plain = httpx.post(url + "/v1/completions", json=body).json()["choices"]
    chunks: dict[int, list[dict]] = {0: [], 1: []}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    chunks[choice["index"]].append(choice)
    for index, want in enumerate(plain):
        got = chunks[index]
        assert "".join(c["text"] for c in got) == want["text"] and want["text"].startswith(PROMPT)
        for key in ("tokens", "token_logprobs", "text_offset"):
            joined = [v for c in got if c["logprobs"] for v in c["logprobs"][key]]
            assert joined == pytest.approx(want["logprobs"][key]), key


def test_token_id_prompts_are_scored_each(url, tiny_llama, offline) -> None:
    """lm-evaluation-harness sends batches of token-id prompts with max_tokens 0 or 1."""
    ids = [offline.get_tokenizer().encode(p) for p in ("A list is", "Dictionaries map keys")]
    result = client(url).completions.create(
        model=tiny_llama.name, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0.0
    )
    for choice, prompt in zip(result.choices, ids):
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1  # the prompt, then the generated token
        assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


# ---- models ------------------------------------------------------------------------------
def test_default_names_are_the_folder_and_its_name(url, tiny_llama) -> None:
    models = client(url).models.list()
    assert [m.id for m in models.data] == [str(tiny_llama), tiny_llama.name]
    assert all(m.root == str(tiny_llama) for m in models.data)
    for name in (str(tiny_llama), tiny_llama.name, str(tiny_llama) + "/"):
        result = client(url).completions.create(model=name, prompt="x", max_tokens=2)
        assert result.model == name  # the name the request used (as OpenAI and vLLM)


def test_models_retrieve_and_not_found(url, tiny_llama) -> None:
    card = client(url).models.retrieve(tiny_llama.name)
    assert card.id == tiny_llama.name and card.object == "model"
    assert client(url).models.retrieve(str(tiny_llama)).id == str(tiny_llama)
    with pytest.raises(openai.NotFoundError) as e:
        client(url).models.retrieve("missing")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(url).completions.create(model="missing", prompt="x")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(url).chat.completions.create(
            model="missing", messages=[{"role": "user", "content": "x"}]
        )


# ---- HTTP details ------------------------------------------------------------------------
def test_health_has_a_json_body(url) -> None:
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}


def test_wrong_method_is_405_with_allow(url) -> None:
    r = httpx.delete(url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
