"""The digest summary of a prefix cache: chained, bounded, and read back as
the length of the longest cached prefix."""

import random

from exo.shared.prefix_digests import (
    DIGEST_TOKENS,
    MAX_SUMMARY_DIGESTS,
    Summarizer,
    cached_prefix_tokens,
    prefix_digests,
)

D = DIGEST_TOKENS


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_a_digest_stands_for_the_whole_prefix_before_it() -> None:
    a = tokens(3 * D + 5, 1)
    assert len(prefix_digests(a)) == 3  # the tail after the last whole block has none
    b = a.copy()
    b[5] += 1  # a change in the first block changes every later digest
    assert not set(prefix_digests(a)) & set(prefix_digests(b))
    c = a[: 2 * D] + tokens(D, 2)  # same first two blocks
    assert prefix_digests(c)[:2] == prefix_digests(a)[:2]
    assert prefix_digests(c)[2] != prefix_digests(a)[2]


def test_the_cached_prefix_is_read_to_within_a_block() -> None:
    system = tokens(4 * D, 3)
    session = system + tokens(6 * D + 40, 4)
    other = system + tokens(5 * D, 5)
    summary = frozenset(Summarizer().summarize([tuple(session)]))
    next_turn = session + tokens(3 * D, 6)
    assert cached_prefix_tokens(prefix_digests(next_turn), summary) == 10 * D
    assert cached_prefix_tokens(prefix_digests(other), summary) == 4 * D  # the system prompt
    assert cached_prefix_tokens(prefix_digests(tokens(8 * D, 7)), summary) == 0
    assert cached_prefix_tokens([], summary) == 0


def test_the_summary_is_bounded_and_keeps_the_first_sequences_first() -> None:
    recent = tuple(tokens(10 * D, 8))
    older = [tuple(tokens(200 * D, 100 + i)) for i in range(30)]  # 6000 blocks
    summarizer = Summarizer()
    summary = summarizer.summarize([recent, *older])
    assert len(summary) == MAX_SUMMARY_DIGESTS
    assert len(set(summary)) == len(summary)
    assert set(prefix_digests(recent)) <= set(summary)
    assert summarizer.summarize([recent, *older], limit=5) == summary[:5]


def test_false_positives_are_rare() -> None:
    """Digests of 10,000 unrelated prompts' blocks never match a full summary."""
    summary = frozenset(
        Summarizer().summarize([tuple(tokens(100 * D, 200 + i)) for i in range(41)])
    )
    assert len(summary) == MAX_SUMMARY_DIGESTS
    hits = sum(
        cached_prefix_tokens(prefix_digests(tokens(D, 1000 + i)), summary) > 0
        for i in range(10_000)
    )
    assert hits == 0
