"""A radix tree over token-id sequences, for longest-prefix lookup.

Lookup walks edges comparing whole token runs (C-speed tuple compares), so its
cost grows with the number of edges on the path, never with a per-entry device
sync or a scan over all entries.
"""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Node:
    label: tuple[int, ...] = ()
    children: dict[int, "_Node"] = field(default_factory=dict)
    # Keys whose sequence ends exactly here / passes through or ends below here.
    ending: set[int] = field(default_factory=set)
    below: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class TrieMatch:
    """`depth`: longest common prefix with any stored sequence.

    `below`: keys sharing that whole prefix. `endings`: (length, key) for every
    stored sequence that is itself a prefix of the query, shortest first.
    """

    depth: int
    below: frozenset[int]
    endings: tuple[tuple[int, int], ...]


def common_prefix_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    if a[: len(b)] == b:
        return min(len(a), len(b))
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on prefix equality: O(log n) slice compares
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TokenTrie:
    def __init__(self) -> None:
        self._root = _Node()

    def match(self, tokens: tuple[int, ...]) -> TrieMatch:
        node, depth = self._root, 0
        endings: list[tuple[int, int]] = []
        below = node.below
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            run = common_prefix_length(tokens[depth : depth + len(child.label)], child.label)
            depth += run
            below = child.below
            if run < len(child.label):
                break
            node = child
            endings.extend((depth, key) for key in sorted(node.ending))
        if depth == 0:
            below = set()
        return TrieMatch(depth=depth, below=frozenset(below), endings=tuple(endings))

    def insert(self, key: int, tokens: tuple[int, ...]) -> None:
        node, depth = self._root, 0
        node.below.add(key)
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(label=tokens[depth:], ending={key}, below={key})
                node.children[tokens[depth]] = leaf
                return
            run = common_prefix_length(tokens[depth : depth + len(child.label)], child.label)
            if run < len(child.label):
                # Split the edge: `child` keeps the tail of its label below a new node.
                middle = _Node(label=child.label[:run], below=set(child.below))
                child.label = child.label[run:]
                middle.children[child.label[0]] = child
                node.children[tokens[depth]] = middle
                child = middle
            child.below.add(key)
            depth += run
            node = child
        node.ending.add(key)

    def remove(self, key: int, tokens: tuple[int, ...]) -> None:
        path = [self._root]
        node, depth = self._root, 0
        while depth < len(tokens):
            node = node.children[tokens[depth]]
            depth += len(node.label)
            path.append(node)
        node.ending.discard(key)
        for n in path:
            n.below.discard(key)
        # Prune emptied nodes bottom-up (the root stays).
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:]), strict=True):
            if not child.below:
                del parent.children[child.label[0]]


def best_usable(
    found: TrieMatch,
    limit: int,
    trimmable: Callable[[int], bool],
    recency: Callable[[int], int],
) -> tuple[int | None, int]:
    """The key to restore and how many tokens of it, for a query whose match is
    `found` and of which at most `limit` tokens may be reused.

    A trimmable sequence sharing the matched prefix can be cut back to it (the most
    recently used of them wins); any sequence ending at or before the match point
    is usable whole, the only option for one that cannot be cut back."""
    best_key: int | None = None
    best = 0
    shared = min(found.depth, limit)
    cuttable = [key for key in found.below if trimmable(key)]
    if shared > 0 and cuttable:
        best_key, best = max(cuttable, key=recency), shared
    for length, key in found.endings:
        if best < length <= limit:
            best_key, best = key, length
    return best_key, best
