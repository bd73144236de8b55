"""KV of attention layers cut into fixed-size chunks that cache entries share.

A chunk holds positions [i*C, (i+1)*C) of every `KVCache` layer. Its KV depends
on every token up to its end, so its key is a digest chained over the token
runs (like a radix tree over token chunks): two sequences share a chunk exactly
when they share all tokens up to its end, and twelve conversations behind one
system prompt hold its chunks once. Chunks are contiguous copies, so a request
that keeps decoding into its own buffers never writes into a stored chunk.
"""

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

CHUNK_TOKENS = 64

ChunkKey = bytes
LayerKV = tuple[mx.array, mx.array]  # keys, values: (batch, heads, positions, dim)


def chunk_keys(tokens: Sequence[int], chunk_tokens: int = CHUNK_TOKENS) -> list[ChunkKey]:
    """One key per full chunk of `tokens`, naming every token up to the chunk's end."""
    keys: list[ChunkKey] = []
    digest = b""
    for end in range(chunk_tokens, len(tokens) + 1, chunk_tokens):
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(array("q", tokens[end - chunk_tokens : end]).tobytes())
        digest = h.digest()
        keys.append(digest)
    return keys


def is_chunked(layer: object) -> bool:
    """Plain attention KV is cut into chunks; every other layer kind (sliding window,
    SSM state, quantized KV) is kept whole, as a checkpoint at an entry's end."""
    return type(layer) is KVCache


def slice_positions(layer: KVCache, start: int, end: int) -> LayerKV:
    """A contiguous copy of positions [start, end) of `layer`."""
    assert layer.keys is not None and layer.values is not None
    return (
        mx.contiguous(layer.keys[..., start:end, :]),
        mx.contiguous(layer.values[..., start:end, :]),
    )


def kv_nbytes(kv: Sequence[LayerKV]) -> int:
    return sum(int(k.nbytes + v.nbytes) for k, v in kv)


def assemble(pieces: Sequence[LayerKV], length: int) -> KVCache:
    """A new `KVCache` holding the first `length` positions of `pieces` in order. Its
    arrays are exactly `length` long, so the next write reallocates (never in place)."""
    layer = KVCache()
    if length == 0 or not pieces:
        return layer
    keys = mx.concatenate([k for k, _ in pieces], axis=2)[..., :length, :]
    values = mx.concatenate([v for _, v in pieces], axis=2)[..., :length, :]
    layer.keys, layer.values, layer.offset = keys, values, length
    return layer


@dataclass
class KVChunk:
    kv: list[LayerKV]  # one per chunked layer
    nbytes: int
    refs: int


class ChunkStore:
    """Chunks by key, counted by the entries that hold them; freed at no holder."""

    def __init__(self) -> None:
        self._chunks: dict[ChunkKey, KVChunk] = {}
        self.nbytes = 0

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, key: ChunkKey) -> KVChunk:
        return self._chunks[key]

    def acquire(self, key: ChunkKey, make: Callable[[], list[LayerKV]]) -> None:
        """Hold the chunk `key`, made by `make` only when no entry holds it yet."""
        chunk = self._chunks.get(key)
        if chunk is None:
            kv = make()
            mx.eval(kv)
            chunk = KVChunk(kv=kv, nbytes=kv_nbytes(kv), refs=0)
            self._chunks[key] = chunk
            self.nbytes += chunk.nbytes
        chunk.refs += 1

    def release(self, key: ChunkKey) -> None:
        chunk = self._chunks[key]
        chunk.refs -= 1
        if chunk.refs == 0:
            del self._chunks[key]
            self.nbytes -= chunk.nbytes

    def sizes(self) -> dict[ChunkKey, int]:
        return {key: chunk.nbytes for key, chunk in self._chunks.items()}
