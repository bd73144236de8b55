"""The prefix cache across the turns of conversations: the reply is reused through the
chat template we ship, checkpoints serve caches that cannot be cut back (tiny random
sliding-window and SSM models), and miss diagnostics explain what was lost."""

import importlib
import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.api.chat_prompt import render_prompt
from exo.engine.cache_diagnostics import explain_lookup
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.prefix_cache import KVPrefixCache, needs_checkpoints
from exo.models.builtin import DEFAULT_MODEL_ID
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.shared.types.cache_stats import CacheMissReason
from exo.shared.types.chat import ChatRequest, ChatTurn
from exo.shared.types.tasks import GenerationParams

BIG = 1 << 40
# (no type stubs for these model modules)
gemma3_text = importlib.import_module("mlx_lm.models.gemma3_text")
mamba = importlib.import_module("mlx_lm.models.mamba")
GREEDY = GenerationParams(max_tokens=8, temperature=0)


def run(
    generator: TextGenerator,
    tokens: list[int],
    params: GenerationParams = GREEDY,
    system_prompt_length: int = 0,
) -> tuple[str, Finished]:
    outputs = list(generator.generate(tokens, params, system_prompt_length))
    done = outputs[-1]
    assert isinstance(done, Finished)
    return "".join(o.text for o in outputs if isinstance(o, TextDelta)), done


# --- the reply, re-rendered by the chat template, hits through the cache -------------


@pytest.mark.parametrize("eager", [True, False])
def test_smollm2_template_echoes_the_generated_reply_token_for_token(
    smollm_dir: Path, eager: bool
) -> None:
    """Turn 2 of a conversation, rendered as the API renders it, starts with every token
    turn 1 stored: the prompt and the reply, with its end-of-turn token where the loop
    computed a step ahead (it fed that token in); a lone row on the CPU hands its token
    out before feeding it (`cpu_few_rows`), so there the stored reply stops before it."""
    model, tokenizer = load_for_inference(smollm_dir)
    chat = load_chat_tokenizer(smollm_dir)
    cache = KVPrefixCache(BIG)
    forward = LocalModel(model, tokenizer)
    forward.eager_rows = 1 if eager else 0
    generator = TextGenerator(forward, tokenizer, cache)
    system = ChatTurn(role="system", content="You are a terse assistant.")
    question = ChatTurn(role="user", content="Name a colour.")
    first = render_prompt(chat, ChatRequest(model=DEFAULT_MODEL_ID, turns=(system, question)))
    params = GenerationParams(max_tokens=24, temperature=0)
    reply, done = run(generator, first.tokens, params)
    assert done.finish_reason == "stop"  # ended with the end-of-turn token
    (entry_id,) = cache.entry_ids()
    stored = cache.entry_tokens(entry_id)
    # Prompt, reply and end-of-turn token: the reply's tokens are all but that one.
    assert len(stored) == len(first.tokens) + done.usage.completion_tokens - (1 if eager else 0)
    assert (stored[-1] in tokenizer.eos_token_ids) is not eager

    follow_up = (system, question, ChatTurn(role="assistant", content=reply))
    follow_up += (ChatTurn(role="user", content="Another."),)
    second = render_prompt(chat, ChatRequest(model=DEFAULT_MODEL_ID, turns=follow_up))
    assert tuple(second.tokens[: len(stored)]) == stored
    _, second_done = run(generator, second.tokens, GenerationParams(max_tokens=2, temperature=0))
    assert second_done.usage.cached_tokens == len(stored)


# --- checkpoints: sliding-window and SSM caches ---------------------------------------


def tiny_gemma3(vocab: int) -> nn.Module:
    """Sliding-window attention every other layer (RotatingKVCache), global between."""
    args: dict[str, Any] = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "head_dim": 32,
        "num_key_value_heads": 1,
        "vocab_size": vocab,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 32,
    }
    mx.random.seed(3)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    return model


def tiny_mamba(vocab: int) -> nn.Module:
    """State-space layers only (ArraysCache): nothing to cut back, nothing counted."""
    args: dict[str, Any] = {
        "model_type": "mamba",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
    }
    mx.random.seed(4)
    model = mamba.Model(mamba.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> TokenizerWrapper:
    return load_for_inference(tiny_model_dir)[1]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40_000) for _ in range(n)]


@pytest.mark.parametrize("architecture", ["gemma3_text", "mamba"])
def test_checkpoints_serve_non_trimmable_caches_exactly(
    tokenizer: TokenizerWrapper, architecture: str
) -> None:
    vocab = tokenizer.vocab_size
    model = tiny_gemma3(vocab) if architecture == "gemma3_text" else tiny_mamba(vocab)
    local = LocalModel(model, tokenizer)
    assert needs_checkpoints(local.make_cache())
    cache = KVPrefixCache(BIG)
    warm = TextGenerator(local, tokenizer, cache, prefill_step_tokens=16)
    cold = TextGenerator(LocalModel(model, tokenizer), tokenizer, None, prefill_step_tokens=16)
    system = tokens(30, seed=1)
    prompt = [*system, *tokens(20, seed=2)]
    text, done = run(warm, prompt, system_prompt_length=len(system))
    assert (text, done.usage.cached_tokens) == (run(cold, prompt)[0], 0)
    # Checkpoints: the system prompt's end (on the way), the prompt's end and, where the
    # cache counts tokens, the reply's end.
    ends = sorted(len(cache.entry_tokens(i)) for i in cache.entry_ids())
    assert ends[:2] == [len(system), len(prompt)]
    reply = list(cache.entry_tokens(cache.entry_ids()[-1])[len(prompt) :])

    cases = [
        # The next turn echoes the reply: the deepest checkpoint is the reply's end.
        ([*prompt, *reply, *tokens(6, seed=3)], ends[-1]),
        # The template rewrote the previous reply (e.g. stripped its thinking).
        ([*prompt, *tokens(9, seed=4)], len(prompt)),
        # Another conversation with the same system prompt.
        ([*system, *tokens(12, seed=5)], len(system)),
        # Diverging inside the system prompt: nothing is usable, never wrong state.
        ([*system[:20], *tokens(12, seed=6)], 0),
    ]
    for query, reused in cases:
        text, done = run(warm, query, system_prompt_length=len(system))
        assert done.usage.cached_tokens == reused
        assert text == run(cold, query)[0]


# --- miss diagnostics -------------------------------------------------------------------

SYS = tuple(range(100, 140))


def words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def same_text(tokens: list[int]) -> str:
    """A decoder for which 7 and 8 read as the same text (a re-tokenization)."""
    return "".join("x" if t in (7, 8) else f"<{t}>" for t in tokens)


@pytest.mark.parametrize(
    ("prompt", "reused", "entry", "evicted", "reason", "diverged_at"),
    [
        # Full use: the whole prompt but its last token, or the whole entry it extends.
        ((*SYS, 1, 2), 41, (*SYS, 1, 2, 3), 0, None, 0),
        ((*SYS, 1, 2, 3, 4), 43, (*SYS, 1, 2, 3), 0, None, 0),
        # Nothing shared at all.
        ((1, 2, 3), 0, None, 0, "new", 0),
        ((1, 2, 3), 0, (9, 9), 0, "new", 0),
        # Two sessions sharing the system prompt and a word: diverged after both.
        ((*SYS, 5, 6, 1), 41, (*SYS, 5, 9, 9), 0, "diverged", 41),
        # An evicted entry had matched further.
        ((*SYS, 5, 6, 1), 40, (*SYS, 9), 44, "evicted", 40),
        # Same text in other tokens: the template or tokenizer changed.
        ((*SYS, 7, 1), 40, (*SYS, 8, 1), 0, "template_changed", 40),
        # A non-trimmable cache restored its last checkpoint before the divergence.
        ((*SYS, 5, 6, 1), 30, (*SYS, 5, 9), 0, "no_checkpoint", 41),
        # A single token: nothing to reuse.
        ((5,), 0, None, 0, "too_short", 0),
    ],
)
def test_explain_lookup(
    prompt: tuple[int, ...],
    reused: int,
    entry: tuple[int, ...] | None,
    evicted: int,
    reason: CacheMissReason | None,
    diverged_at: int,
) -> None:
    decode = same_text if reason == "template_changed" else words
    miss = explain_lookup(prompt, reused, entry, evicted, decode)
    if reason is None:
        assert miss is None
        return
    assert miss is not None
    assert (miss.reason, miss.diverged_at, miss.reused_tokens) == (reason, diverged_at, reused)
    assert miss.prompt_tokens == len(prompt)
    assert miss.best_entry_tokens == (len(entry) if entry else 0)
    if reason == "diverged":
        assert miss.cached_text == "w9 w9"
        assert miss.prompt_text == "w6 w1"
        assert miss.context_text.endswith("w139 w5")


def test_misses_are_kept_in_the_stats_with_their_text() -> None:
    from tests.unit.test_prefix_cache import kv_layers

    cache = KVPrefixCache(BIG, decode=words)
    first = (*SYS, 1, 2, 3)
    cache.lookup(first)
    cache.store(first, kv_layers(len(first)))
    cache.lookup((*SYS, 1, 7, 7))
    misses = cache.stats().recent_misses
    assert [m.reason for m in misses] == ["new", "diverged"]
    assert (misses[1].diverged_at, misses[1].cached_text, misses[1].prompt_text) == (
        41,
        "w2 w3",
        "w7 w7",
    )
