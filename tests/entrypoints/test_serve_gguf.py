"""``pagedllm serve SmolLM2-135M-Instruct.Q4_1.gguf`` through the official openai client:
prompts tokenized as transformers' GGUF tokenizer does, the answer a real one."""

from __future__ import annotations

import openai
from helpers.real_model import smollm2_gguf
from helpers.serve import pagedllm_serve

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_served_gguf_answers_chat_requests():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    flags = ["--served-model-name=smollm2", "--max-model-len=512"]
    with pagedllm_serve(str(gguf), *flags, "--kv-cache-memory-bytes=67108864") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        reply = client.chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0, max_tokens=16
        )
        assert "Paris" in reply.choices[0].message.content
        theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        ids = theirs.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
        assert reply.usage.prompt_tokens == len(ids)
        text = client.completions.create(
            model="smollm2", prompt="The capital of France is", temperature=0, max_tokens=3
        )
        assert text.usage.prompt_tokens == len(theirs.encode("The capital of France is"))
        assert "Paris" in text.choices[0].text
