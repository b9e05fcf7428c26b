"""Prompt-lookup proposals: longest suffix n-gram, latest occurrence, bounded length."""

from __future__ import annotations

import random

import pytest

from pagedllm.worker.spec_decode.ngram import NgramProposer


def test_proposes_what_followed_the_latest_match() -> None:
    prop = NgramProposer(k=3, min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    # suffix [5, 6] (n=2; [1, 5, 6] never occurred): matches at 0 and 5; latest is 5 -> 7, 1, 5
    assert prop.propose(tokens) == [7, 1, 5]


def test_prefers_the_longest_ngram() -> None:
    prop = NgramProposer(k=2, min_n=1, max_n=3)
    # suffix 3-gram [1, 2, 3] occurred at 0 (-> 4, 4); the 1-gram [3] also at 7 (-> 9)
    tokens = [1, 2, 3, 4, 4, 0, 0, 3, 9, 1, 2, 3]
    assert prop.propose(tokens) == [4, 4]


def test_no_match_or_too_short_proposes_nothing() -> None:
    prop = NgramProposer(k=4, min_n=2, max_n=4)
    assert prop.propose([1, 2, 3, 4, 5]) == []
    assert prop.propose([7]) == []
    assert prop.propose([1, 2, 1, 2], k=0) == []


def test_overlapping_run_and_end_of_history() -> None:
    prop = NgramProposer(k=5, min_n=2, max_n=3)
    # a run: the suffix [7, 7, 7] matches one step back; the run is assumed to go on
    assert prop.propose([1, 7, 7, 7, 7]) == [7] * 5
    # fewer than k tokens follow the match: the period-3 loop continues
    assert prop.propose([4, 5, 6, 4, 5]) == [6, 4, 5, 6, 4]


def test_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(k=2, min_n=3, max_n=2)


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        for start in range(num - 1 - n, -1, -1):  # latest first; must end before the last
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                while len(extended) < start + n + k:  # repeat with the match's period
                    extended.append(extended[len(extended) - (num - start - n)])
                return extended[start + n : start + n + k]
    return []


def test_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        prop = NgramProposer(k=3, min_n=min_n, max_n=max_n)
        expected = brute_force(tokens, 3, min_n, max_n)
        assert prop.propose(tokens) == expected, (tokens, min_n, max_n)
        checked += bool(expected)
    assert checked > 500
