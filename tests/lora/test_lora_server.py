"""`pagedllm serve --enable-lora --lora-modules`: adapters picked by `model`, listed in
/v1/models, loaded and unloaded at run time, with the openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers.generation import greedy_params, random_prompts
from helpers.lora import ALL, build_adapter
from helpers.serve import pagedllm_serve

from pagedllm import LLM
from pagedllm.lora.request import LoRARequest

pytest.importorskip("peft")
MAX_TOKENS = 8


def test_serve_adapters_by_model_name(tiny_llama, tmp_path):
    a = build_adapter(tiny_llama, tmp_path / "a", seed=1, r=4, targets=["q_proj", "v_proj"])
    b = build_adapter(tiny_llama, tmp_path / "b", seed=2, r=8, targets=ALL)
    prompts = random_prompts(3, 8, 20, seed=4)
    llm = LLM(str(tiny_llama), enable_lora=True, max_loras=2, max_lora_rank=8)
    reqs = [None, LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]
    want = [
        llm.generate({"prompt_token_ids": p}, greedy_params(MAX_TOKENS), False, r)[0]
        .outputs[0]
        .text
        for p, r in zip(prompts, reqs)
    ]
    assert len(set(want)) == 3
    args = ["--enable-lora", "--max-loras=2", "--max-lora-rank=8", "--served-model-name=base"]
    with pagedllm_serve(str(tiny_llama), *args, "--lora-modules", f"a={a}") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"base", "a"}
        assert models["a"].parent == "base" and models["a"].root == str(a)

        load = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(b)}
        )
        assert load.status_code == 200, load.text
        assert "b" in {m.id for m in client.models.list().data}

        def complete(i: int) -> str:
            name = ["base", "a", "b"][i]
            out = client.completions.create(
                model=name, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0.0
            )
            assert out.model == name
            return out.choices[0].text

        with ThreadPoolExecutor(3) as pool:  # the three in flight at once
            assert list(pool.map(complete, range(3))) == want

        chunks = client.completions.create(
            model="a", prompt=prompts[1], max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want[1]

        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="nope", prompt=[5, 6], max_tokens=2)
        assert e.value.code == "model_not_found"
        bad = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(tmp_path)}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        dup = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(a)}
        )
        assert dup.status_code == 400

        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert gone.status_code == 200, gone.text
        assert {m.id for m in client.models.list().data} == {"base", "a"}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="b", prompt=prompts[2], max_tokens=2)
        again = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"


def test_serve_refuses_adapters_without_enable_lora(tiny_llama, tmp_path):
    from pagedllm.config import EngineArgs
    from pagedllm.entrypoints.openai.server import build_app

    a = build_adapter(tiny_llama, tmp_path / "a", seed=1, r=4, targets=["q_proj"])
    with pytest.raises(ValueError, match="--enable-lora"):
        build_app(EngineArgs(model=str(tiny_llama)), lora_modules=[f"a={a}"])
    with pytest.raises(ValueError, match="name=path"):
        build_app(EngineArgs(model=str(tiny_llama), enable_lora=True), lora_modules=["a"])
