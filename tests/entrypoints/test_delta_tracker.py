"""DeltaTracker: a stream's DELTA outputs as the per-choice chunks the server sends, and the
usage counted from them."""

from __future__ import annotations

from pagedllm.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.entrypoints.openai.serving import DeltaTracker, streamed_usage

PROMPT_IDS = [1, 2, 3]


def delta(*choices: tuple[str, list[int], str | None], first: bool = False) -> RequestOutput:
    """One step's DELTA output: (text, token ids, finish reason) per choice."""
    outputs = [
        CompletionOutput(
            index=i,
            text=text,
            token_ids=ids,
            cumulative_logprob=None,
            logprobs=[{t: Logprob(-0.5, 1)} for t in ids],
            finish_reason=reason,
        )
        for i, (text, ids, reason) in enumerate(choices)
    ]
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=PROMPT_IDS,
        prompt_logprobs=[None, {2: Logprob(-1.0, 1)}, {3: Logprob(-2.0, 1)}] if first else None,
        outputs=outputs,
        finished=all(reason is not None for _, _, reason in choices),
        metrics=RequestMetrics(0.0),
    )


def test_tokens_without_text_ride_with_the_next_delta() -> None:
    tracker = DeltaTracker(index_offset=4)
    # Step 1: choice 0 has text; choice 1's token is half a character, so it waits.
    step1 = tracker.update(delta(("Hi", [10], None), ("", [20], None), first=True))
    assert [(d.index, d.text, d.token_ids) for d in step1] == [(4, "Hi", [10])]
    # Step 2: choice 1's character completes; its chunk carries both tokens and logprobs.
    step2 = tracker.update(delta(("", [11], None), ("é", [21], None)))
    assert [(d.index, d.text, d.token_ids) for d in step2] == [(5, "é", [20, 21])]
    assert [list(e) for e in step2[0].logprobs] == [[20], [21]]
    # Step 3: choice 0 ends with no new text: the finish carries the held token; choice 1
    # ends too. Step 4: a finished choice is not reported again.
    step3 = tracker.update(delta(("", [12], "length"), ("!", [22], "stop")))
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in step3] == [
        (4, "", [11, 12], "length"),
        (5, "!", [22], "stop"),
    ]
    assert tracker.update(delta(("", [], "length"), ("", [], "stop"))) == []
    # The prompt's logprobs came with the first output only; the tracker keeps them.
    assert tracker.prompt_logprobs is not None and len(tracker.prompt_logprobs) == 3
    usage = streamed_usage([tracker, tracker])
    assert (usage.prompt_tokens, usage.completion_tokens) == (6, 12)
    assert usage.total_tokens == 18
