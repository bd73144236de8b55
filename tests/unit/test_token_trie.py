"""TokenTrie: a radix tree over token-id tuples, cross-checked against brute force."""

import random

import pytest

from exo.engine.token_trie import (
    TokenTrie,
    TrieMatch,
    _Node,
    best_usable,
    common_prefix_length,
)

Tokens = tuple[int, ...]


def _lcp(a: Tokens, b: Tokens) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def oracle(stored: dict[int, Tokens], query: Tokens) -> TrieMatch:
    """What `TokenTrie.match` must return, computed by scanning every stored sequence."""
    depth = max((_lcp(query, t) for t in stored.values()), default=0)
    below = (
        frozenset(k for k, t in stored.items() if len(t) >= depth and t[:depth] == query[:depth])
        if depth > 0
        else frozenset()
    )
    endings = tuple(
        sorted(
            (len(t), k)
            for k, t in stored.items()
            if 0 < len(t) <= len(query) and query[: len(t)] == t
        )
    )
    return TrieMatch(depth=depth, below=below, endings=endings)


def build(stored: dict[int, Tokens]) -> TokenTrie:
    trie = TokenTrie()
    for key, tokens in stored.items():
        trie.insert(key, tokens)
    return trie


def count_nodes(node: _Node) -> int:
    return 1 + sum(count_nodes(child) for child in node.children.values())


def check_invariants(node: _Node, is_root: bool = True) -> None:
    """Edge labels are non-empty, keyed by their first token, and `below` covers subtrees."""
    for first, child in node.children.items():
        assert child.label, "an edge with an empty label"
        assert child.label[0] == first
        assert child.below, "an empty subtree was not pruned"
        assert child.ending <= child.below
        for grandchild in child.children.values():
            assert grandchild.below <= child.below
        check_invariants(child, is_root=False)
    if not is_root:
        union = set(node.ending)
        for child in node.children.values():
            union |= child.below
        assert union == node.below


# --- common_prefix_length ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((), (), 0),
        ((1,), (), 0),
        ((), (1,), 0),
        ((1, 2, 3), (1, 2, 3), 3),
        ((1, 2, 3), (1, 2), 2),
        ((1, 2), (1, 2, 3), 2),
        ((1, 2, 3), (4, 5, 6), 0),
        ((1, 2, 3, 4), (1, 2, 9, 4), 2),
        ((1, 2, 3, 4), (1, 2, 3, 9), 3),
        ((7, 2, 3), (1, 2, 3), 0),
        (tuple(range(1000)), (*range(637), -1), 637),
    ],
)
def testcommon_prefix_length(a: Tokens, b: Tokens, expected: int) -> None:
    assert common_prefix_length(a, b) == expected
    assert common_prefix_length(b, a) == expected


# --- match on a fixed trie --------------------------------------------------------

FIXED: dict[int, Tokens] = {
    1: (1, 2, 3, 4, 5),
    2: (1, 2, 3, 9),
    3: (1, 2),
    4: (7, 8, 9),
    5: (1, 2, 3, 4, 5, 6, 7),
}


@pytest.mark.parametrize(
    ("query", "depth", "below", "endings"),
    [
        # Nothing in common.
        ((), 0, set(), ()),
        ((42,), 0, set(), ()),
        ((42, 1, 2), 0, set(), ()),
        # Ends in the middle of the first edge shared by 1, 2, 3, 5.
        ((1,), 1, {1, 2, 3, 5}, ()),
        ((1, 5), 1, {1, 2, 3, 5}, ()),
        # Exactly at the end of key 3.
        ((1, 2), 2, {1, 2, 3, 5}, ((2, 3),)),
        # Past key 3, diverging before the 1/2 split point.
        ((1, 2, 8), 2, {1, 2, 3, 5}, ((2, 3),)),
        ((1, 2, 3), 3, {1, 2, 5}, ((2, 3),)),
        ((1, 2, 3, 9), 4, {2}, ((2, 3), (4, 2))),
        ((1, 2, 3, 9, 9, 9), 4, {2}, ((2, 3), (4, 2))),
        ((1, 2, 3, 4), 4, {1, 5}, ((2, 3),)),
        ((1, 2, 3, 4, 5), 5, {1, 5}, ((2, 3), (5, 1))),
        ((1, 2, 3, 4, 5, 0), 5, {1, 5}, ((2, 3), (5, 1))),
        ((1, 2, 3, 4, 5, 6), 6, {5}, ((2, 3), (5, 1))),
        ((1, 2, 3, 4, 5, 6, 7), 7, {5}, ((2, 3), (5, 1), (7, 5))),
        ((1, 2, 3, 4, 5, 6, 7, 8, 9), 7, {5}, ((2, 3), (5, 1), (7, 5))),
        # The other branch from the root.
        ((7,), 1, {4}, ()),
        ((7, 8, 0), 2, {4}, ()),
        ((7, 8, 9), 3, {4}, ((3, 4),)),
        ((7, 8, 9, 10), 3, {4}, ((3, 4),)),
    ],
)
def test_match_fixed(query: Tokens, depth: int, below: set[int], endings: tuple) -> None:
    trie = build(FIXED)
    found = trie.match(query)
    assert found == TrieMatch(depth=depth, below=frozenset(below), endings=endings)
    assert found == oracle(FIXED, query)


def test_empty_trie_matches_nothing() -> None:
    trie = TokenTrie()
    for query in [(), (1,), (1, 2, 3)]:
        assert trie.match(query) == TrieMatch(depth=0, below=frozenset(), endings=())


def test_match_returns_frozen_copies_not_live_sets() -> None:
    trie = build({1: (1, 2, 3)})
    found = trie.match((1, 2, 3))
    trie.insert(2, (1, 2, 3, 4))
    trie.remove(1, (1, 2, 3))
    assert found.below == frozenset({1})
    assert found.endings == ((3, 1),)


# --- insert: edge splits ----------------------------------------------------------


@pytest.mark.parametrize(
    ("sequences", "expected_nodes"),
    [
        # root + one leaf
        ([(1, 2, 3)], 2),
        # A prefix of an existing edge splits it: root, (1,2), (3,)
        ([(1, 2, 3), (1, 2)], 3),
        # Extension of an existing leaf adds a child: root, (1,2,3), (4,5)
        ([(1, 2, 3), (1, 2, 3, 4, 5)], 3),
        # Divergence mid-edge: root, (1,2), (3,4), (9,9)
        ([(1, 2, 3, 4), (1, 2, 9, 9)], 4),
        # Divergence at the first token: two leaves under the root.
        ([(1, 2), (3, 4)], 3),
        # Duplicate sequences share a node.
        ([(1, 2, 3), (1, 2, 3)], 2),
        # Three-way split at the same point: root, (1,), (2,), (3,), (4,)
        ([(1, 2), (1, 3), (1, 4)], 5),
        # Split twice along the same edge: root, (1,), (2,), (3,4), (9,), (8,)
        ([(1, 2, 3, 4), (1, 2, 9), (1, 8)], 6),
    ],
)
def test_insert_splits_edges(sequences: list[Tokens], expected_nodes: int) -> None:
    stored = dict(enumerate(sequences))
    trie = build(stored)
    assert count_nodes(trie._root) == expected_nodes
    check_invariants(trie._root)
    for tokens in sequences:
        found = trie.match(tokens)
        assert found.depth == len(tokens)
        assert found == oracle(stored, tokens)


def test_insert_same_key_twice_is_idempotent() -> None:
    trie = TokenTrie()
    trie.insert(1, (1, 2, 3))
    trie.insert(1, (1, 2, 3))
    assert trie.match((1, 2, 3)).endings == ((3, 1),)
    trie.remove(1, (1, 2, 3))
    assert trie.match((1, 2, 3)) == TrieMatch(depth=0, below=frozenset(), endings=())


def test_duplicate_sequences_report_all_keys_sorted() -> None:
    trie = build({5: (1, 2), 3: (1, 2), 9: (1, 2, 3)})
    found = trie.match((1, 2, 3))
    assert found.endings == ((2, 3), (2, 5), (3, 9))
    assert found.below == frozenset({9})
    assert trie.match((1, 2)).below == frozenset({3, 5, 9})


def test_long_sequences() -> None:
    base = tuple(range(5000))
    stored = {1: base, 2: (*base[:4000], -1, -2), 3: base[:100]}
    trie = build(stored)
    for query in [base, base[:3999], (*base[:4000], -1), (*base[:4500], 7), base[:100], base[:99]]:
        assert trie.match(query) == oracle(stored, query)


# --- remove: pruning --------------------------------------------------------------


@pytest.mark.parametrize(
    ("sequences", "remove_order"),
    [
        ([(1, 2, 3)], [0]),
        ([(1, 2, 3), (1, 2)], [0, 1]),
        ([(1, 2, 3), (1, 2)], [1, 0]),
        ([(1, 2, 3, 4), (1, 2, 9, 9), (1, 2)], [1, 2, 0]),
        ([(1, 2, 3, 4), (1, 2, 9, 9), (1, 2)], [2, 0, 1]),
        ([(1, 2), (1, 3), (1, 4), (5,)], [3, 1, 0, 2]),
        ([(1, 2, 3), (1, 2, 3)], [0, 1]),
    ],
)
def test_remove_prunes_to_empty(sequences: list[Tokens], remove_order: list[int]) -> None:
    stored = dict(enumerate(sequences))
    trie = build(stored)
    for key in remove_order:
        trie.remove(key, stored.pop(key))
        check_invariants(trie._root)
        for tokens in sequences:
            assert trie.match(tokens) == oracle(stored, tokens)
    assert trie._root.children == {}
    assert count_nodes(trie._root) == 1


def test_remove_leaves_other_keys_matchable() -> None:
    stored = {1: (1, 2, 3, 4), 2: (1, 2, 3, 5), 3: (1, 2)}
    trie = build(stored)
    trie.remove(1, stored.pop(1))
    assert trie.match((1, 2, 3, 4)) == TrieMatch(depth=3, below=frozenset({2}), endings=((2, 3),))
    assert trie.match((1, 2, 3, 5)).endings == ((2, 3), (4, 2))
    # The removed leaf's subtree is gone; only the shared part and key 2's tail remain.
    assert count_nodes(trie._root) == 4  # root, (1,2), (3,), (5,)
    trie.remove(3, stored.pop(3))
    assert trie.match((1, 2)) == TrieMatch(depth=2, below=frozenset({2}), endings=())


def test_remove_one_of_two_duplicates_keeps_the_other() -> None:
    trie = build({1: (4, 5, 6), 2: (4, 5, 6)})
    trie.remove(1, (4, 5, 6))
    assert trie.match((4, 5, 6)) == TrieMatch(depth=3, below=frozenset({2}), endings=((3, 2),))


def test_reinsert_after_remove() -> None:
    trie = build({1: (1, 2, 3), 2: (1, 2, 4)})
    trie.remove(1, (1, 2, 3))
    trie.insert(1, (1, 2, 3, 4, 5))
    stored = {1: (1, 2, 3, 4, 5), 2: (1, 2, 4)}
    for query in [(1, 2, 3), (1, 2, 3, 4, 5, 6), (1, 2, 4), (1, 2)]:
        assert trie.match(query) == oracle(stored, query)


# --- randomized cross-check against the brute-force oracle ------------------------


def _random_tokens(rng: random.Random, pool: list[Tokens], alphabet: int) -> Tokens:
    """Random sequences that often share prefixes with earlier ones."""
    if pool and rng.random() < 0.7:
        base = rng.choice(pool)
        cut = rng.randint(0, len(base))
        tail = tuple(rng.randrange(alphabet) for _ in range(rng.randint(0, 6)))
        tokens = base[:cut] + tail
    else:
        tokens = tuple(rng.randrange(alphabet) for _ in range(rng.randint(1, 12)))
    return tokens or (rng.randrange(alphabet),)


@pytest.mark.parametrize(("seed", "alphabet"), [(0, 2), (1, 3), (2, 4), (3, 16), (4, 1000)])
def test_random_against_oracle(seed: int, alphabet: int) -> None:
    rng = random.Random(seed)
    trie = TokenTrie()
    stored: dict[int, Tokens] = {}
    pool: list[Tokens] = []
    next_key = 0
    for _ in range(300):
        if stored and rng.random() < 0.35:
            key = rng.choice(sorted(stored))
            trie.remove(key, stored.pop(key))
        else:
            tokens = _random_tokens(rng, pool, alphabet)
            pool.append(tokens)
            trie.insert(next_key, tokens)
            stored[next_key] = tokens
            next_key += 1
        for _ in range(5):
            query = _random_tokens(rng, pool, alphabet)
            assert trie.match(query) == oracle(stored, query), (query, stored)
        for tokens in stored.values():
            assert trie.match(tokens) == oracle(stored, tokens)
    check_invariants(trie._root)
    for key in list(stored):
        trie.remove(key, stored.pop(key))
    assert trie._root.children == {}


# --- best_usable: which stored sequence a query restores, and how much of it -------

# key -> (tokens, trimmable); recency is the key itself (higher: more recently used).
USABLE_STORED: dict[int, tuple[Tokens, bool]] = {
    1: ((1, 2, 3, 4, 5, 6, 7, 8), True),
    2: ((1, 2, 3, 4, 9, 9), True),
    3: ((1, 2, 3), False),
    4: ((1, 2, 3, 4, 5, 6), False),
    5: ((7, 7, 7), False),
}


@pytest.mark.parametrize(
    ("query", "stored", "expected"),
    [
        # A trimmable sequence is cut back to the match; the most recent of several wins.
        ((1, 2, 3, 4, 0, 0), [1, 2], (2, 4)),
        ((1, 2, 3, 4, 5, 0), [1, 2], (1, 5)),
        # At most all but the query's last token.
        ((1, 2, 3, 4, 5, 6, 7, 8), [1], (1, 7)),
        ((1, 2), [1], (1, 1)),
        # A non-trimmable one serves only whole, ending before the query's last token.
        ((1, 2, 3, 4, 5, 6, 0), [3, 4], (4, 6)),
        ((1, 2, 3, 4, 5, 6), [3, 4], (3, 3)),
        ((1, 2, 3, 4, 5, 0), [3, 4], (3, 3)),
        ((1, 2, 3), [3], (None, 0)),
        # A non-trimmable checkpoint past the trimmable match is still better.
        ((1, 2, 3, 4, 5, 6, 0), [2, 4], (4, 6)),
        # Nothing shared, or a single-token query.
        ((7, 7, 0), [1, 2, 3], (None, 0)),
        ((7,), [5], (None, 0)),
        ((), [1], (None, 0)),
    ],
)
def test_best_usable(query: Tokens, stored: list[int], expected: tuple[int | None, int]) -> None:
    trie = TokenTrie()
    for key in stored:
        trie.insert(key, USABLE_STORED[key][0])
    found = trie.match(query)
    trimmable = lambda key: USABLE_STORED[key][1]  # noqa: E731
    assert best_usable(found, len(query) - 1, trimmable, recency=lambda key: key) == expected
