"""lm-evaluation-harness (the real ``lm_eval`` package) against the server, as its users run
it: ``local-completions`` with its default settings, a multiple-choice (loglikelihood) task
and a generate_until task, both written here with a tiny local dataset (no network).

Each score lm-eval reports is checked against the offline engine on the same tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import pytest
from helpers.ci import unavailable

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.entrypoints.openai.server import build_app, serve_in_thread

try:
    import lm_eval
except ImportError:  # the dev extra installs it
    lm_eval = None


@pytest.fixture(autouse=True)
def _lm_eval_installed() -> None:
    if lm_eval is None:
        unavailable("lm_eval is not installed (pip install -e '.[dev]')")


QUESTIONS = [
    ("The quick brown fox jumps over the", ["lazy dog.", "red car.", "blue sky."], 0),
    ("A list is a mutable", ["sequence.", "dictionary.", "fox."], 0),
    ("Dictionaries map keys to", ["values.", "lists.", "dogs."], 0),
]
PROMPTS = [("The quick brown", "fox"), ("A list is", "a"), ("Dictionaries map", "keys")]
MAX_GEN = 6


def engine_args(model: Path) -> EngineArgs:
    return EngineArgs(model=str(model), kv_cache_memory_bytes=1 << 22, max_model_len=128)


@pytest.fixture(scope="module")
def url(tiny_llama) -> Iterator[str]:
    with serve_in_thread(build_app(engine_args(tiny_llama), None, log_stats_interval=None)) as u:
        yield u


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(**vars(engine_args(tiny_llama)))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """Two task YAMLs and their JSONL data in a folder lm-eval's TaskManager includes."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    gen = [{"prompt": p, "target": t} for p, t in PROMPTS]
    for name, rows in (("mc", mc), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: train\n"
    (folder / "tiny_mc.yaml").write_text(
        "task: pagedllm_tiny_mc\n"
        + common
        + f"dataset_kwargs:\n  data_files: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "tiny_gen.yaml").write_text(
        "task: pagedllm_tiny_gen\n"
        + common
        + f"dataset_kwargs:\n  data_files: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {MAX_GEN}\n'
        "  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def evaluate(url: str, model: str, tasks: Path, **model_args: str) -> dict:
    from lm_eval.tasks import TaskManager

    # no network: for this call only, the process's environment is left as it was
    with mock.patch.dict(os.environ, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}):
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": model, "base_url": url + "/v1/completions", **model_args},
            tasks=["pagedllm_tiny_mc", "pagedllm_tiny_gen"],
            task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )


def continuation_logprob(offline: LLM, context: str, continuation: str) -> float:
    """log P(continuation | context) on the tokens lm-eval sends (its _encode_pair)."""
    tok = offline.get_tokenizer()
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tok.encode(context, add_special_tokens=False))
    out = offline.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return sum(out.prompt_logprobs[i][t].logprob for i, t in enumerate(whole) if i >= n_ctx)


def check_results(results: dict, offline: LLM) -> None:
    mc = results["samples"]["pagedllm_tiny_mc"]
    assert len(mc) == len(QUESTIONS)
    correct = 0
    for sample in mc:
        got = [resp[0][0] for resp in sample["resps"]]  # (loglikelihood, is_greedy)
        want = [continuation_logprob(offline, *args) for args in sample["arguments"]]
        assert got == pytest.approx(want, abs=1e-3)
        correct += max(range(len(want)), key=want.__getitem__) == sample["target"]
    assert results["results"]["pagedllm_tiny_mc"]["acc,none"] == pytest.approx(correct / 3)
    gen = results["samples"]["pagedllm_tiny_gen"]
    assert len(gen) == len(PROMPTS)
    tok = offline.get_tokenizer()
    for sample in gen:
        prompt = sample["doc"]["prompt"]
        ids = tok.encode(prompt, add_special_tokens=False)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_GEN, stop=["\n"])
        want = offline.generate([ids], params)[0].outputs[0].text
        assert sample["resps"][0][0] == want


def test_lm_eval_local_completions_defaults(url, tiny_llama, tasks, offline) -> None:
    """Default settings: lm-eval finds the server's /tokenizer_info and tokenizes remotely."""
    check_results(evaluate(url, tiny_llama.name, tasks), offline)


def test_lm_eval_with_a_local_tokenizer_from_the_served_id(url, tiny_llama, tasks, offline) -> None:
    """tokenizer_backend=huggingface loads the tokenizer from the served id: the model folder."""
    served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    assert served == str(tiny_llama)
    check_results(evaluate(url, served, tasks, tokenizer_backend="huggingface"), offline)
