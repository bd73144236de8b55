"""Why a prefix-cache lookup missed or reused less than it could have."""

from collections.abc import Callable

from exo.engine.token_trie import common_prefix_length
from exo.shared.prompt_images import is_image_key
from exo.shared.types.cache_stats import CacheMiss, CacheMissReason

# Tokens of decoded text shown on each side of a divergence.
CONTEXT_TOKENS = 16

Decode = Callable[[list[int]], str]


def _no_text(tokens: list[int]) -> str:
    return ""


def explain_lookup(
    prompt: tuple[int, ...],
    reused: int,
    best_entry: tuple[int, ...] | None,
    evicted_depth: int,
    decode: Decode = _no_text,
) -> CacheMiss | None:
    """A miss or short hit explained; None when the lookup reused all it could
    (the whole prompt but its last token, or every token of the entry it extends).

    `best_entry`: the stored sequence sharing the longest prefix with `prompt`;
    `evicted_depth`: the longest prefix an evicted entry shared with it."""
    decode = _text_of(decode)
    limit = max(len(prompt) - 1, 0)
    depth = common_prefix_length(prompt, best_entry) if best_entry else 0
    if len(prompt) > 1 and (reused >= limit or (best_entry and reused == len(best_entry))):
        return None
    reason: CacheMissReason
    if len(prompt) <= 1:
        reason = "too_short"
    elif evicted_depth > depth:
        reason = "evicted"
    elif best_entry is None or depth == 0:
        reason = "new"
    elif reused < min(depth, limit):
        # Shared further than reused: only a checkpoint before the divergence was usable.
        reason = "no_checkpoint"
    else:
        reason = "diverged"
    cached = best_entry[depth : depth + CONTEXT_TOKENS] if best_entry else ()
    cached_text = decode(list(cached)) if cached else ""
    prompt_text = decode(list(prompt[depth : depth + CONTEXT_TOKENS]))
    if reason in ("diverged", "no_checkpoint") and _image_at(depth, prompt, best_entry):
        reason = "image_changed"  # what diverged, before what could be reused of it
    elif reason == "diverged" and _same_text(cached_text, prompt_text):
        reason = "template_changed"
    return CacheMiss(
        reason=reason,
        prompt_tokens=len(prompt),
        reused_tokens=reused,
        best_entry_tokens=len(best_entry) if best_entry else 0,
        diverged_at=depth,
        context_text=decode(list(prompt[max(depth - CONTEXT_TOKENS, 0) : depth])) if depth else "",
        cached_text=cached_text,
        prompt_text=prompt_text,
    )


def _text_of(decode: Decode) -> Decode:
    """`decode` for prompts with images: their keys are no vocabulary's tokens."""
    return lambda tokens: decode([token for token in tokens if not is_image_key(token)])


def _image_at(depth: int, prompt: tuple[int, ...], entry: tuple[int, ...] | None) -> bool:
    return any(
        len(tokens) > depth and is_image_key(tokens[depth]) for tokens in (prompt, entry or ())
    )


def _same_text(a: str, b: str) -> bool:
    """Both sides read alike where both have text: other tokens for the same text."""
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]
