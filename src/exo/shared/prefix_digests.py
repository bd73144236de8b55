"""What a runner's prefix cache holds, small enough to send to every node.

A token sequence is summed up by chained digests, one per `DIGEST_TOKENS`
tokens: digest k is a hash of digest k-1 and the k-th block of tokens, so it
stands for the whole prefix up to the end of that block. A runner publishes the
digests of the sequences it has cached (memory and disk tiers, most recently
used first, at most `MAX_SUMMARY_DIGESTS`); a node that receives a request
computes its prompt's digests and finds, for each replica, the longest prefix
whose digest the replica has (`cached_prefix_tokens`).

Bounds: the summary holds at most `MAX_SUMMARY_DIGESTS` 64-bit digests (32 KiB
as raw bytes); a prompt block's digest matches an unrelated one with
probability about `MAX_SUMMARY_DIGESTS / 2**64` per replica. The estimate
undercounts by less than one block (the tail after the last whole block), and
counts a prefix the cache can only restore at a checkpoint as cached.
"""

import hashlib
from array import array
from collections.abc import Iterable, Sequence

DIGEST_TOKENS = 128
MAX_SUMMARY_DIGESTS = 4096
_SEED = b"exo-prefix"


def prefix_digests(tokens: Sequence[int]) -> list[int]:
    """The chained digest of every whole block of `tokens`: element k stands
    for `tokens[: (k + 1) * DIGEST_TOKENS]`."""
    digests: list[int] = []
    previous = _SEED
    for start in range(0, len(tokens) - DIGEST_TOKENS + 1, DIGEST_TOKENS):
        block = array("q", tokens[start : start + DIGEST_TOKENS]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        digests.append(int.from_bytes(previous, "little"))
    return digests


class Summarizer:
    """`summarize` with each sequence's digests remembered from the last call
    (a cache's entries rarely change between two summaries)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, ...], list[int]] = {}

    def summarize(
        self, sequences: Iterable[tuple[int, ...]], limit: int = MAX_SUMMARY_DIGESTS
    ) -> list[int]:
        """The digests of `sequences` (most important first), each once, at most
        `limit`: a sequence that does not fit whole gives its first blocks, which
        the sequences after it likely share (a system prompt, earlier turns)."""
        known: dict[tuple[int, ...], list[int]] = {}
        summary: dict[int, None] = {}
        for tokens in sequences:
            digests = known.get(tokens) or self._known.get(tokens) or prefix_digests(tokens)
            known[tokens] = digests
            for digest in digests:
                if len(summary) >= limit:
                    break
                summary.setdefault(digest)
        self._known = known
        return list(summary)


def cached_prefix_tokens(prompt_digests: Sequence[int], summary: frozenset[int]) -> int:
    """How many of a prompt's first tokens a cache with `summary` holds, to
    within a block: the end of the last prompt block whose digest it has."""
    for k in range(len(prompt_digests) - 1, -1, -1):
        if prompt_digests[k] in summary:
            return (k + 1) * DIGEST_TOKENS
    return 0
