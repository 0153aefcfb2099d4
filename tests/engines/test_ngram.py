"""Prompt lookup's n-gram index against a scan of the whole context."""

import random

import pytest

from engines.proposers.ngram import NgramIndex


def scan(context: list[int], gamma: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """What the index must return: the latest earlier occurrence of the longest matching suffix."""
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = context[L - n:]
        for i in range(L - 1 - n, -1, -1):  # occurrences ending before the last position, latest first
            if context[i:i + n] == suffix:
                return context[i + n:i + n + gamma], n
    return [], 0


@pytest.mark.parametrize("seed", range(6))
def test_the_index_finds_what_a_scan_of_the_context_finds_as_the_context_grows(seed):
    rng = random.Random(seed)
    vocab, max_n = rng.choice([2, 3, 5, 50]), rng.choice([1, 2, 3, 4])
    min_n = rng.randint(1, max_n)
    index = NgramIndex(max_n)
    context = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    for _ in range(60):
        gamma = rng.randint(1, 9)
        assert index.continuation(context, gamma, min_n) == scan(context, gamma, min_n, max_n)
        # a round commits one to nine tokens, sometimes copied from earlier (what prompt lookup meets)
        if rng.random() < 0.5 and len(context) > 4:
            at = rng.randrange(len(context) - 3)
            context = context + context[at:at + rng.randint(1, 9)]
        else:
            context = context + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]


def test_a_context_that_is_not_the_one_indexed_is_indexed_afresh():
    index = NgramIndex(3)
    assert index.continuation([1, 2, 3, 9, 1, 2], 4) == ([3, 9, 1, 2], 2)
    # shorter, and then as long but with another last token: neither may use the old entries
    assert index.continuation([5, 6, 5], 4) == scan([5, 6, 5], 4, 1, 3) == ([6, 5], 1)
    assert index.continuation([5, 6, 7], 4) == scan([5, 6, 7], 4, 1, 3) == ([], 0)
    assert index.continuation([7, 6, 7, 4, 4], 2) == scan([7, 6, 7, 4, 4], 2, 1, 3)
