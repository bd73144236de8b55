"""Pipeline shards and agreed eviction, in one process (the ring itself is tested in
tests/integration/test_pipeline.py): shards chained in layer order compute exactly
what the whole model does, and hold only their part of the weights."""

import gc
import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from pydantic import ValidationError

from exo.engine.mlx.load import load_for_inference, parameter_bytes, prepare_for_backend
from exo.engine.mlx.prefix_cache import KVPrefixCache, PrefixMatch
from exo.engine.mlx.shard import ShardModel, UnsupportedShard, load_shard
from exo.shared.types.shard import LayerRange
from tests.model_factory import make_tiny_llama
from tests.unit.test_prefix_cache import kv_layers

PROMPT = [[5, 17, 300, 42, 9, 1000, 77, 3, 250, 8, 61, 2000, 14, 15]]


def layers(start: int, end: int, total: int = 6) -> LayerRange:
    return LayerRange(start=start, end=end, total=total)


def chained_logits(model_dir: Path, bounds: list[int]) -> list[mx.array]:
    """Logits of a prefill and two decode steps, run through shards in order."""
    shards = [load_shard(model_dir, layers(a, b)) for a, b in itertools.pairwise(bounds)]
    caches = [shard.make_cache() for shard in shards]
    outputs = []
    for tokens in (PROMPT, [[123]], [[4]]):
        h = mx.array(tokens)
        for shard, cache in zip(shards, caches, strict=True):
            h = shard.run(h, cache)
        outputs.append(h)
    mx.eval(outputs)
    return outputs


def whole_logits(model_dir: Path) -> list[mx.array]:
    model, config = load_model(model_dir)
    model = prepare_for_backend(model, config)
    cache = make_prompt_cache(model)
    outputs = [model(mx.array(tokens), cache=cache) for tokens in (PROMPT, [[123]], [[4]])]
    mx.eval(outputs)
    return outputs


def tiny_qwen3(target: Path) -> Path:
    config = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": 3000,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    mx.random.seed(1)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    target.mkdir(parents=True)
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    return {
        "tied": make_tiny_llama(root / "tied", smollm_dir, n_layers=6),
        "untied, 3 weight files": make_tiny_llama(
            root / "untied", smollm_dir, n_layers=6, weight_files=3, tie_word_embeddings=False
        ),
        "qwen3": tiny_qwen3(root / "qwen3"),
    }


@pytest.mark.parametrize("model", ["tied", "untied, 3 weight files", "qwen3"])
@pytest.mark.parametrize("bounds", [[0, 3, 6], [0, 2, 4, 6], [0, 1, 5, 6]])
def test_chained_shards_compute_exactly_what_the_whole_model_does(
    model_dirs: dict[str, Path], model: str, bounds: list[int]
) -> None:
    model_dir = model_dirs[model]
    for ours, reference in zip(
        chained_logits(model_dir, bounds), whole_logits(model_dir), strict=True
    ):
        assert mx.array_equal(ours, reference).item()


def held(shard: ShardModel) -> dict[str, mx.array]:
    """The weights the shard holds, by name."""
    arrays = cast(list[tuple[str, mx.array]], tree_flatten(shard.model.parameters()))
    return {name: array for name, array in arrays if name in shard.weights}


def parts(shard: ShardModel) -> set[str]:
    """The top-level parts whose weights the shard holds (`model.layers` -> "layers")."""
    return {name.removeprefix("model.").split(".")[0] for name in shard.weights}


def test_a_shard_holds_only_its_layers_and_ends(model_dirs: dict[str, Path]) -> None:
    tied, untied = model_dirs["tied"], model_dirs["untied, 3 weight files"]
    first, middle, last = (load_shard(untied, layers(a, b)) for a, b in [(0, 2), (2, 4), (4, 6)])
    assert parts(first) == {"embed_tokens", "layers"}
    assert parts(middle) == {"layers"}
    assert parts(last) == {"layers", "norm", "lm_head"}
    # With tied embeddings the head is the embedding matrix: the last rank loads it.
    assert parts(load_shard(tied, layers(4, 6))) == {"embed_tokens", "layers", "norm"}
    held = [
        {int(n.split(".")[2]) for n in s.weights if ".layers." in n} for s in (first, middle, last)
    ]
    assert held == [{0, 1}, {2, 3}, {4, 5}]
    whole, config = load_model(untied)
    whole_bytes = parameter_bytes(prepare_for_backend(whole, config))
    assert sum(s.weight_bytes for s in (first, middle, last)) == whole_bytes


@pytest.mark.parametrize(("start", "end"), [(3, 3), (4, 2), (-1, 2), (0, 7)])
def test_a_layer_range_outside_the_model_is_refused(start: int, end: int) -> None:
    with pytest.raises(ValidationError, match="not inside the model's 6 layers"):
        layers(start, end)


@pytest.mark.parametrize(
    ("start", "end", "first", "last"),
    [(0, 6, True, True), (0, 2, True, False), (2, 4, False, False), (4, 6, False, True)],
)
def test_a_layer_range_knows_its_ends(start: int, end: int, first: bool, last: bool) -> None:
    assert (layers(start, end).is_first, layers(start, end).is_last) == (first, last)


def test_an_architecture_that_cannot_be_split_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rwkv7"}))
    with pytest.raises(UnsupportedShard, match="hand on more than their hidden states"):
        load_shard(tmp_path, layers(0, 1))


def test_a_layer_count_other_than_the_models_is_refused(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedShard, match="the model has 6 layers"):
        load_shard(model_dirs["tied"], layers(0, 4, total=8))


def weights_and_peak(load: Callable[[], Any]) -> tuple[int, int]:
    """Parameter bytes of what `load` returns, and MLX's peak allocation while loading."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    loaded = load()
    held = loaded.weight_bytes if isinstance(loaded, ShardModel) else parameter_bytes(loaded)
    return held, mx.get_peak_memory() - before


def test_a_third_of_the_layers_loads_on_a_share_of_the_memory(smollm_dir: Path) -> None:
    # A third of the layers (and the embedding, for the ends): the weights and the
    # peak memory while loading stay within half the whole model's.
    whole_weights, whole_peak = weights_and_peak(lambda: load_for_inference(smollm_dir)[0])
    for part in [layers(0, 10, total=30), layers(10, 20, total=30), layers(20, 30, total=30)]:
        weights, peak = weights_and_peak(lambda part=part: load_shard(smollm_dir, part))
        assert weights <= 0.5 * whole_weights
        assert peak <= 0.5 * whole_peak


class UnionExchange:
    """Two caches in two threads agree on evictions the way ranks do: the union."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=10)
        self._proposals: list[list[int]] = [[], []]

    def agreement(self, side: int) -> Any:
        def agree(victims: list[int]) -> list[int]:
            self._proposals[side] = victims
            self._barrier.wait()
            union = sorted(set(self._proposals[0]) | set(self._proposals[1]))
            self._barrier.wait()  # both read before the next round writes
            return union

        return agree


def test_ranks_with_different_budgets_evict_the_same_entries() -> None:
    exchange = UnionExchange()
    entry = 2 * 2 * 20 * 2 * 4 * 4  # bytes of a kv_layers(20) entry (see test_prefix_cache)
    # One rank fits two entries, the other ten; memory pressure only on the second.
    pressured = iter([False, False, False, True, False, False])
    caches = [
        KVPrefixCache(2 * entry, agree=exchange.agreement(0)),
        KVPrefixCache(10 * entry, lambda: next(pressured, False), exchange.agreement(1)),
    ]
    prompts = [tuple(range(start, start + 20)) for start in (0, 100, 200, 300, 400)]
    seen: list[list[list[int]]] = [[], []]

    def run(side: int) -> None:
        cache = caches[side]
        for prompt in prompts:
            cache.lookup((*prompt, -1))
            cache.store(prompt, kv_layers(len(prompt)))
            seen[side].append(cache.entry_ids())

    threads = [threading.Thread(target=run, args=(side,)) for side in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen[0] == seen[1]
    assert seen[0][-1] == [3, 4]
    assert caches[0].stats().evictions == caches[1].stats().evictions == 3
    assert caches[1].lookup(prompts[0]) == PrefixMatch(None, 0, len(prompts[0]))


def test_a_shard_loads_from_a_folder_with_only_its_own_weight_files(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # 3 weight files: layers 0-1 and the embedding, layers 2-3, layers 4-5 and the ends.
    source = model_dirs["untied, 3 weight files"]
    partial = tmp_path / "middle-only"
    partial.mkdir()
    for path in source.iterdir():
        if not path.name.startswith("model-") or path.name.startswith("model-00002-"):
            (partial / path.name).symlink_to(path)
    middle = held(load_shard(partial, layers(2, 4)))
    reference = held(load_shard(source, layers(2, 4)))
    assert middle.keys() == reference.keys()
    for name, array in middle.items():
        assert mx.array_equal(array, reference[name]).item(), name
    with pytest.raises(FileNotFoundError, match=r"layers \[1, 3\)"):
        load_shard(partial, layers(1, 3))
