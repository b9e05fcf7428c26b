"""``pagedllm serve --num-scheduler-steps N``: the openai client streams the same text as the
whole completion, in bursts of up to N tokens, and a stop string inside a burst ends the text
where it starts."""

from __future__ import annotations

import openai
from helpers.serve import pagedllm_serve

PROMPT = "The quick brown fox jumps over the lazy dog."


def test_serve_streams_bursts_of_decode_steps(tiny_llama) -> None:
    with pagedllm_serve(
        str(tiny_llama), "--served-model-name=tiny", "--num-scheduler-steps=4"
    ) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        greedy = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0.0)
        plain = client.completions.create(**greedy)
        assert plain.usage.completion_tokens == 40
        chunks = [c.choices[0].text for c in client.completions.create(**greedy, stream=True)]
        assert "".join(chunks) == plain.choices[0].text
        # the prompt's step gives the first token, then bursts of 4: 1 + 39 / 4 -> 11 steps
        assert len([c for c in chunks if c]) <= 11
        text = plain.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = client.completions.create(**greedy, stop=[stop])
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
