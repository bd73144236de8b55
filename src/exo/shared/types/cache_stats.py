"""Counters of a runner's KV prefix cache: kept by the cache, reported to the node."""

from typing import Literal

from pydantic import BaseModel, ConfigDict

CacheMissReason = Literal[
    "new",  # nothing cached shares a token with the prompt
    "evicted",  # an entry that matched further was evicted
    "diverged",  # the prompt differs from the best entry inside it
    "template_changed",  # same text, other tokens: the template or tokenizer changed
    "image_changed",  # another image where the best entry has one (`shared/prompt_images.py`)
    "no_checkpoint",  # a non-trimmable cache has no checkpoint at or before the divergence
    "too_short",  # the prompt has a single token: nothing to reuse
]


class CacheMiss(BaseModel):
    """Why a lookup reused less than the prompt shares with what was cached."""

    model_config = ConfigDict(frozen=True)

    reason: CacheMissReason
    prompt_tokens: int
    reused_tokens: int
    best_entry_tokens: int  # the stored entry sharing the longest prefix (0: none)
    diverged_at: int  # first position where the prompt and that entry differ
    context_text: str  # decoded text just before `diverged_at`
    cached_text: str  # decoded text of the entry from `diverged_at`
    prompt_text: str  # decoded text of the prompt from `diverged_at`


class CacheStats(BaseModel):
    """Mutable: the cache counts into it and hands out copies."""

    lookups: int = 0
    hits_exact: int = 0
    hits_partial: int = 0
    misses: int = 0
    tokens_reused: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    entries: int = 0
    chunks: int = 0
    bytes: int = 0
    evictions: int = 0
    byte_budget: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_byte_budget: int = 0
    recent_misses: list[CacheMiss] = []
