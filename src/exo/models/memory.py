"""RAM a model takes on a node, from its card.

Memory depends on the node's MLX backend: the CPU runner dequantizes quantized
weights and casts every weight to float32 at load (`exo.engine.mlx.load`),
Metal and CUDA keep the weights as stored. A rank also needs room for the KV
cache of its layers: a reserve of `KV_RESERVE_TOKENS` tokens (or the model's
context, if shorter). The prefix cache budget is separate.
"""

from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import MlxBackend

KV_RESERVE_TOKENS = 8192
_FLOAT32_BYTES = 4
_FLOAT16_BYTES = 2


def _loaded_bytes(stored_bytes: int, params: int, backend: MlxBackend) -> int:
    return params * _FLOAT32_BYTES if backend == "cpu" else stored_bytes


def memory_per_layer(card: ModelCard, backend: MlxBackend) -> int:
    """Bytes one layer takes in RAM once loaded on `backend` (weights only)."""
    return _loaded_bytes(card.layer_bytes, card.layer_params, backend)


def memory_other(
    card: ModelCard, backend: MlxBackend, *, first: bool = True, last: bool = True
) -> int:
    """Bytes of the non-layer weights a rank holds once loaded on `backend`.

    The first rank holds the embedding, the last the final norm and head; with
    tied embeddings the head is the embedding, so a last rank that is not also
    the first holds the embedding too. The defaults describe a single rank.
    """
    total = 0
    if first or (last and card.tie_word_embeddings):
        total += _loaded_bytes(card.embedding_bytes, card.embedding_params, backend)
    if last:
        total += _loaded_bytes(card.head_bytes, card.head_params, backend)
    return total


def kv_bytes_per_token(card: ModelCard, backend: MlxBackend) -> int:
    """KV cache bytes per token over all layers: keys and values of every KV head,
    float32 on the CPU backend, float16 otherwise."""
    dtype = _FLOAT32_BYTES if backend == "cpu" else _FLOAT16_BYTES
    return 2 * card.n_kv_heads * card.head_dim * card.n_layers * dtype


def kv_reserve_tokens(card: ModelCard) -> int:
    """Tokens of KV cache a rank reserves room for."""
    return min(card.context_length, KV_RESERVE_TOKENS)


def kv_reserve_per_layer(card: ModelCard, backend: MlxBackend) -> int:
    return -(-kv_bytes_per_token(card, backend) * kv_reserve_tokens(card) // card.n_layers)


def layer_cost(card: ModelCard, backend: MlxBackend) -> int:
    """RAM one layer needs on `backend`: its weights and its KV reserve."""
    return memory_per_layer(card, backend) + kv_reserve_per_layer(card, backend)


def rank_memory(card: ModelCard, backend: MlxBackend, start: int, end: int) -> int:
    """RAM a rank serving layers [start, end) needs on `backend`: the layers'
    weights and KV reserve, plus the embedding (first rank) and head (last)."""
    first, last = start == 0, end == card.n_layers
    return (end - start) * layer_cost(card, backend) + memory_other(
        card, backend, first=first, last=last
    )


def layers_that_fit(
    card: ModelCard, backend: MlxBackend, free: int, *, first: bool, last: bool
) -> int:
    """How many layers a rank with `free` bytes of RAM on `backend` holds next to
    its non-layer weights (the embedding when `first`, the head when `last`)."""
    room = free - memory_other(card, backend, first=first, last=last)
    if room < 0:
        return 0
    cost = layer_cost(card, backend)
    return card.n_layers if cost == 0 else min(card.n_layers, room // cost)
