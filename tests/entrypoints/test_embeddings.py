"""/v1/embeddings on decoder models (``--runner pooling``) through the openai client,
checked against the model's final hidden states in transformers: last-token and mean
pooling, normalize, dimensions, base64 and float encodings, a long input chunked over
several steps batched with short ones, and the real model through ``pagedllm serve``."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from helpers.real_model import smollm2_hf_folder
from helpers.serve import pagedllm_serve

from pagedllm import EngineArgs
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

TEXTS = ["The quick brown fox.", "A list is a mutable sequence of things", "naïve café"]
LONG = "Dictionaries map keys to values. " * 6  # longer than one step's token budget


def hf_hidden(folder, texts: list[str]) -> list[torch.Tensor]:
    """The final (normed) hidden state of every token of each text, as transformers has it."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    states = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids
            states.append(model(ids).last_hidden_state[0])
    return states


def serve(folder, **options):
    args = EngineArgs(
        model=str(folder),
        kv_cache_memory_bytes=1 << 22,
        max_model_len=256,
        max_num_batched_tokens=32,  # LONG is prefilled in chunks
        enable_prefix_caching=options.pop("prefix_caching", True),
    )
    app = build_app(args, ["tiny"], log_stats_interval=None, runner="pooling", **options)
    return serve_in_thread(app), app


@pytest.fixture(scope="module")
def last_client(tiny_llama):
    server, app = serve(tiny_llama)
    with server as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), app


@pytest.fixture(scope="module")
def matryoshka_model(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("matryoshka")
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def mean_client(matryoshka_model):
    server, _ = serve(matryoshka_model, pooling_type="mean", prefix_caching=False)
    with server as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def vectors(result) -> list[torch.Tensor]:
    assert [d.index for d in result.data] == list(range(len(result.data)))
    return [torch.tensor(d.embedding) for d in result.data]


def test_last_token_pooling_matches_transformers(last_client, tiny_llama):
    client, app = last_client
    expected = [h[-1] for h in hf_hidden(tiny_llama, TEXTS + [LONG])]
    # the client asks for base64 unless told; both encodings give the same floats
    for fmt in ({}, {"encoding_format": "float"}):
        result = client.embeddings.create(model="tiny", input=TEXTS + [LONG], **fmt)
        got = vectors(result)
        assert result.model == "tiny" and len(got) == 4
        for v, e in zip(got, expected):
            assert v.shape == (64,)
            torch.testing.assert_close(
                v, torch.nn.functional.normalize(e, dim=0), atol=1e-4, rtol=1e-4
            )
    raw = client.embeddings.create(model="tiny", input=TEXTS[0], extra_body={"normalize": False})
    torch.testing.assert_close(vectors(raw)[0], expected[0], atol=1e-4, rtol=1e-4)
    ids = app.state.engine.get_tokenizer().encode(TEXTS[1])
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    torch.testing.assert_close(vectors(by_ids)[0], vectors(result)[1], atol=1e-5, rtol=1e-5)
    assert by_ids.usage.prompt_tokens == len(ids) == by_ids.usage.total_tokens


def test_a_repeated_input_hits_the_prefix_cache_and_pools_the_same(last_client, tiny_llama):
    client, app = last_client
    blocks = app.state.engine.engine.block_manager
    first = client.embeddings.create(model="tiny", input=LONG, encoding_format="float")
    hits = blocks.prefix_cache_hits
    again = client.embeddings.create(model="tiny", input=LONG, encoding_format="float")
    assert blocks.prefix_cache_hits > hits  # only the uncached tail was computed
    torch.testing.assert_close(vectors(again)[0], vectors(first)[0], atol=1e-5, rtol=1e-5)
    expected = hf_hidden(tiny_llama, [LONG])[0][-1]
    torch.testing.assert_close(
        vectors(again)[0], torch.nn.functional.normalize(expected, dim=0), atol=1e-4, rtol=1e-4
    )


def test_mean_pooling_and_dimensions(mean_client, matryoshka_model):
    states = hf_hidden(matryoshka_model, TEXTS + [LONG])
    result = mean_client.embeddings.create(
        model="tiny", input=TEXTS + [LONG], extra_body={"normalize": False}
    )
    for v, h in zip(vectors(result), states):
        torch.testing.assert_close(v, h.mean(dim=0), atol=1e-4, rtol=1e-4)
    cut = mean_client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16)
    (v,) = vectors(cut)
    assert v.shape == (16,)
    torch.testing.assert_close(
        v, torch.nn.functional.normalize(states[0].mean(dim=0)[:16], dim=0), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(openai.BadRequestError, match="dimensions must be one of"):
        mean_client.embeddings.create(model="tiny", input="x", dimensions=20)


def test_dimensions_refused_for_a_model_not_trained_for_them(last_client):
    client, _ = last_client
    with pytest.raises(openai.BadRequestError, match="does not support dimensions"):
        client.embeddings.create(model="tiny", input="x", dimensions=16)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    # generation still works next to the pooling
    assert client.completions.create(model="tiny", prompt="The", max_tokens=3).usage


def test_serve_runner_pooling_on_the_real_model():
    folder = smollm2_hf_folder()
    texts = ["What is the capital of France?", "Paris is the capital of France."]
    expected = [h[-1] for h in hf_hidden(folder, texts)]
    with pagedllm_serve(
        str(folder),
        "--served-model-name=smollm2",
        "--runner=pooling",
        "--max-model-len=512",
        "--kv-cache-memory-bytes=33554432",
    ) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        got = vectors(client.embeddings.create(model="smollm2", input=texts))
    for v, e in zip(got, expected):
        assert torch.nn.functional.cosine_similarity(v, e, dim=0) > 0.9999
