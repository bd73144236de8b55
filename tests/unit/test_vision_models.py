"""The tiny vision-language models of `tests/vision_models.py`: mlx-lm loads each
as a text model and mlx-vlm whole, every weight in place; the chat template
and the processors turn an image into the family's image tokens, as many as
the vision tower and projector give features; the logits depend on the image;
and mlx-lm's text model fed mlx-vlm's merged embeddings gives mlx-vlm's logits
(for the Qwen families, whose image tokens mlx-vlm positions in 3-D, for a
text-only prompt).

mlx-vlm's models are run as its `generate` runs them: `get_input_embeddings`,
then the language model with a fresh cache and what `get_input_embeddings`
returned besides the embeddings (the Qwen families' M-RoPE positions, Qwen3-VL's
deepstack features). (Gemma 3's `Model.__call__` instead hands the language
model the all-ones 4-D mask `get_input_embeddings` returns, which MLX adds to
the attention scores: no causal mask, no sliding window.)"""

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import transformers
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load  # pyright: ignore[reportAttributeAccessIssue]  # not in the stubs
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_vlm.models.cache import make_prompt_cache as make_vlm_prompt_cache
from mlx_vlm.utils import load as mlx_vlm_load
from mlx_vlm.utils import load_model as mlx_vlm_load_model
from PIL import Image

from tests.vision_models import (
    MORE_VISION_FAMILIES,
    VISION_FAMILIES,
    image_marker,
    image_token,
    make_tiny_vision_model,
)

# The rows and columns of image tokens `red()` (48 x 40 pixels) becomes: gemma3's
# and mistral3's processors make it a square image, the Qwen families' resize
# it to 32 x 24 pixels (at most 32 x 32, sides multiples of 8), 3 x 4 tokens.
RED_GRID: dict[str, tuple[int, int]] = {
    "gemma3": (4, 4),
    "mistral3": (4, 4),
    "qwen2_5_vl": (3, 4),
    "qwen3_vl": (3, 4),
}
# Families whose language models position image tokens in 3-D (M-RoPE)
MROPE_FAMILIES = ("qwen2_5_vl", "qwen3_vl", *MORE_VISION_FAMILIES)
# The ids `make_tiny_vision_model` gives the added tokens, after SmolLM2's 49152
# (SmolLM2 has `<|im_start|>` and `<|im_end|>` already: Qwen's are those).
QWEN_TOKEN_IDS = {
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<|vision_start|>": 49152,
    "<|vision_end|>": 49153,
    "<|image_pad|>": 49154,
    "<|video_pad|>": 49155,
}
TOKEN_IDS: dict[str, dict[str, int]] = {
    "gemma3": {
        "<start_of_turn>": 49152,
        "<end_of_turn>": 49153,
        "<start_of_image>": 49154,
        "<end_of_image>": 49155,
        "<image_soft_token>": 49156,
    },
    "mistral3": {
        "[INST]": 49152,
        "[/INST]": 49153,
        "[SYSTEM_PROMPT]": 49154,
        "[/SYSTEM_PROMPT]": 49155,
        "[IMG]": 49156,
        "[IMG_BREAK]": 49157,
        "[IMG_END]": 49158,
    },
    "qwen2_5_vl": QWEN_TOKEN_IDS,
    "qwen3_vl": QWEN_TOKEN_IDS,
    "qwen2_vl": QWEN_TOKEN_IDS,
    "qwen3_vl_moe": QWEN_TOKEN_IDS,
}
# How the hub's checkpoints name the weights: prefixes each family's names all
# have one of and each of which some names have.
HUB_PREFIXES: dict[str, tuple[str, ...]] = {
    "gemma3": ("language_model.", "vision_tower.", "multi_modal_projector."),
    "mistral3": ("language_model.", "vision_tower.", "multi_modal_projector."),
    "qwen2_5_vl": ("model.", "visual."),  # tied: no lm_head
    "qwen3_vl": ("model.language_model.", "model.visual.", "lm_head."),
    "qwen2_vl": ("model.", "visual."),  # tied: no lm_head
    "qwen3_vl_moe": ("model.language_model.", "model.visual.", "lm_head."),
}
QUESTION: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
]


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def model_path(family: str, smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_vision_model(family, tmp_path_factory.mktemp(family) / family, smollm_dir)


@pytest.fixture(scope="module")
def vlm(model_path: Path) -> tuple[Any, Any]:
    """mlx-vlm's model and processor."""
    model, processor = mlx_vlm_load(str(model_path))
    return model, processor


def red() -> Image.Image:
    return Image.new("RGB", (48, 40), (255, 0, 0))


def blue_stripes() -> Image.Image:
    pixels = np.full((40, 56, 3), 255, np.uint8)
    pixels[::4] = (0, 0, 255)
    pixels[1::4] = (0, 0, 255)
    return Image.fromarray(pixels)


def prompt_of(tokenizer: Any) -> str:
    rendered: str = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    )
    return rendered


def process(
    processor: Any, image: Image.Image | None
) -> tuple[mx.array, mx.array | None, dict[str, mx.array]]:
    """input_ids, pixel_values and the other image inputs (pixtral's
    image_sizes, the Qwen families' image_grid_thw); with no image, those of a
    text-only prompt."""
    if image is None:
        text = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is this?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out = processor(text=text, images=None, return_tensors="np")
    else:
        out = processor(text=prompt_of(processor.tokenizer), images=[image], return_tensors="np")
    extras = {
        key: mx.array(np.array(value))
        for key, value in out.items()
        if key not in ("input_ids", "attention_mask", "token_type_ids", "pixel_values")
    }
    pixel_values = None if image is None else mx.array(np.array(out["pixel_values"]))
    return mx.array(np.array(out["input_ids"])), pixel_values, extras


def input_features(
    model: Any, ids: mx.array, pixel_values: mx.array | None, extras: dict[str, mx.array]
) -> Any:
    # gemma3's get_input_embeddings needs the attention mask
    return model.get_input_embeddings(ids, pixel_values, mask=mx.ones(ids.shape), **extras)


def merged_embeddings(
    model: Any, ids: mx.array, pixel_values: mx.array | None, extras: dict[str, mx.array]
) -> mx.array:
    embeddings: mx.array = input_features(model, ids, pixel_values, extras).inputs_embeds
    return embeddings


def vlm_last_logits(
    model: Any, ids: mx.array, pixel_values: mx.array | None, extras: dict[str, mx.array]
) -> mx.array:
    features = input_features(model, ids, pixel_values, extras)
    # As mlx-vlm's generate: the processor's image inputs and whatever else
    # get_input_embeddings returned (the Qwen families' M-RoPE position ids,
    # Qwen3-VL's deepstack features and their positions).
    metadata = {
        key: value
        for key, value in features.to_dict().items()
        if key != "inputs_embeds" and value is not None
    }
    language_model = model.language_model
    # A copy: Gemma 3's language models scale the embeddings they are given in place.
    logits: mx.array = language_model(
        ids,
        inputs_embeds=mx.array(features.inputs_embeds),
        cache=make_vlm_prompt_cache(language_model),
        **{**extras, **metadata},
    ).logits
    return logits[0, -1]


def image_features(
    model: Any, family: str, pixel_values: mx.array, extras: dict[str, mx.array]
) -> int:
    """How many features the vision tower and projector give for the images."""
    if family in ("qwen2_5_vl", "qwen2_vl"):
        merged: mx.array = model.vision_tower(pixel_values, extras["image_grid_thw"])
        return merged.shape[0]
    if family in ("qwen3_vl", "qwen3_vl_moe"):
        merged, deepstack = model.vision_tower(pixel_values, extras["image_grid_thw"])
        assert [layer.shape for layer in deepstack] == [merged.shape]
        return merged.shape[0]
    pixels = pixel_values.transpose(0, 2, 3, 1)
    if family == "gemma3":
        hidden, _, _ = model.vision_tower(pixels, output_hidden_states=True)
        features: mx.array = model.multi_modal_projector(hidden)
        return features.shape[0] * features.shape[1]
    *_, hidden_states = model.vision_tower(
        pixels, output_hidden_states=True, image_sizes=extras["image_sizes"]
    )
    features = model.multi_modal_projector(hidden_states[-1].squeeze(0), extras["image_sizes"])
    return features.shape[0]


def expected_image_ids(family: str, rows: int, columns: int) -> list[int]:
    ids = TOKEN_IDS[family]
    if family == "gemma3":
        return (
            [ids["<start_of_image>"]]
            + [ids["<image_soft_token>"]] * (rows * columns)
            + [ids["<end_of_image>"]]
        )
    if family in MROPE_FAMILIES:
        return (
            [ids["<|vision_start|>"]]
            + [ids["<|image_pad|>"]] * (rows * columns)
            + [ids["<|vision_end|>"]]
        )
    row = [ids["[IMG]"]] * columns
    return [*([*row, ids["[IMG_BREAK]"]] * (rows - 1)), *row, ids["[IMG_END]"]]


def token_ids(ids: mx.array) -> list[int]:
    return [int(token) for token in np.array(ids[0])]


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i : i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def text_config(model_path: Path) -> dict[str, Any]:
    """config.json's text parameters: Qwen2.5-VL's are at its top level."""
    config: dict[str, Any] = json.loads((model_path / "config.json").read_text())
    text: dict[str, Any] = config.get("text_config", config)
    return text


def test_mlx_lm_loads_the_text_model(family: str, model_path: Path) -> None:
    model, tokenizer = mlx_lm_load(str(model_path))
    names = [name for name, _ in tree_flatten(model.parameters())]
    assert names and all(name.startswith("language_model.") for name in names)
    vocab_size = text_config(model_path)["vocab_size"]
    assert vocab_size >= len(tokenizer.vocab)
    assert max(TOKEN_IDS[family].values()) < vocab_size

    ids = mx.array([tokenizer.encode(prompt_of(tokenizer))])
    logits = model(ids, cache=make_prompt_cache(model))
    assert logits.shape == (1, ids.shape[1], vocab_size)
    embeddings = model.language_model.model.embed_tokens(ids)
    from_embeddings = model(ids, cache=make_prompt_cache(model), input_embeddings=embeddings)
    assert from_embeddings.shape == logits.shape


def test_mlx_vlm_loads_every_weight_as_written(family: str, model_path: Path) -> None:
    model = mlx_vlm_load_model(model_path, strict=True)
    loaded = dict(tree_flatten(model.parameters()))
    saved = mx.load(str(model_path / "model.safetensors"))
    assert isinstance(saved, dict)
    prefixes = HUB_PREFIXES[family]
    assert all(name.startswith(prefixes) for name in saved)
    for prefix in prefixes:
        assert any(name.startswith(prefix) for name in saved)
    for name, array in saved.items():
        if array.ndim == 4:  # PyTorch's convolutions
            array = array.transpose(0, 2, 3, 1)
        if array.ndim == 5:  # the Qwen families' Conv3d patch embedding
            array = array.transpose(0, 2, 3, 4, 1)
        assert mx.array_equal(loaded.pop(mlx_vlm_name(family, name)), array), name
    # What is left is gemma3's output head, tied to its embedding.
    tied = ["language_model.lm_head.weight"] if family == "gemma3" else []
    assert sorted(loaded) == tied


def mlx_vlm_name(family: str, name: str) -> str:
    """mlx-vlm's name of the weight the hub's checkpoints name `name`."""
    if family == "mistral3":
        return name.replace("vision_tower.", "vision_tower.vision_model.")
    if family in ("qwen2_5_vl", "qwen2_vl"):  # model.*, lm_head.*, visual.*
        if name.startswith("visual."):
            return "vision_tower." + name.removeprefix("visual.")
        return "language_model." + name
    if family in ("qwen3_vl", "qwen3_vl_moe"):  # model.language_model.*, lm_head.*, model.visual.*
        if name.startswith("model.visual."):
            return "vision_tower." + name.removeprefix("model.visual.")
        return "language_model." + name.replace("model.language_model.", "model.")
    return name


def test_the_chat_template_renders_images_the_family_s_way(family: str, model_path: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        *QUESTION,
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "And now?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if family == "gemma3":
        assert rendered == (
            f"{bos}<start_of_turn>user\nBe brief.\n\n<start_of_image>What is this?<end_of_turn>\n"
            "<start_of_turn>model\nA red square.<end_of_turn>\n"
            "<start_of_turn>user\nAnd now?<end_of_turn>\n<start_of_turn>model\n"
        )
    elif family == "mistral3":
        assert rendered == (
            f"{bos}[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST][IMG]What is this?[/INST]"
            f"A red square.{eos}[INST]And now?[/INST]"
        )
    else:
        assert rendered == (
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
            "<|im_start|>assistant\nA red square.<|im_end|>\n"
            "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"
        )
        assert eos == "<|im_end|>"
    assert rendered.count(image_marker(family)) == 1
    # Each added token is one special token.
    for token, token_id in TOKEN_IDS[family].items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert (
        tokenizer.convert_tokens_to_ids(image_token(family))
        == TOKEN_IDS[family][image_token(family)]
    )


def test_gemma3_s_tokenizer_names_its_image_tokens(model_path: Path, family: str) -> None:
    if family != "gemma3":
        pytest.skip("only Gemma3Processor reads image tokens off the tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    assert (tokenizer.boi_token, tokenizer.boi_token_id) == ("<start_of_image>", 49154)
    assert (tokenizer.eoi_token, tokenizer.eoi_token_id) == ("<end_of_image>", 49155)
    assert (tokenizer.image_token, tokenizer.image_token_id) == ("<image_soft_token>", 49156)


def test_the_image_processor_is_the_pil_one(family: str, model_path: Path) -> None:
    image_processor = transformers.AutoImageProcessor.from_pretrained(model_path)
    assert type(image_processor).__name__.endswith("ImageProcessorPil")
    out = image_processor(images=[blue_stripes()], return_tensors="np")
    if family in MROPE_FAMILIES:
        # 56 x 40 pixels resized to 32 x 24: 8 x 6 patches of 3 x 2 x 4 x 4 values
        assert np.array(out["image_grid_thw"]).tolist() == [[1, 6, 8]]
        assert out["pixel_values"].shape == (48, 96)
        return
    assert out["pixel_values"].shape[:2] == (1, 3)
    assert max(out["pixel_values"].shape[2:]) == 32


def processors(family: str, model_path: Path, vlm: tuple[Any, Any]) -> list[Any]:
    """mlx-vlm's processor; AutoProcessor's, which is mlx-vlm's too once mlx-vlm
    has patched AutoProcessor (importing its model modules does); and
    transformers' own Gemma3Processor. (transformers' PixtralProcessor, which
    mistral3 uses, and its Qwen2.5-VL and Qwen3-VL processors, whose video
    processors need them, require torch and torchvision.)"""
    found = [vlm[1], transformers.AutoProcessor.from_pretrained(model_path)]
    if family == "gemma3":
        found.append(transformers.Gemma3Processor.from_pretrained(model_path))
    return found


def test_the_processors_expand_an_image_into_image_tokens(
    family: str, model_path: Path, vlm: tuple[Any, Any]
) -> None:
    rows, columns = RED_GRID[family]
    for processor in processors(family, model_path, vlm):
        ids, pixel_values, extras = process(processor, red())
        assert pixel_values is not None
        assert contains(token_ids(ids), expected_image_ids(family, rows, columns)), type(processor)
        assert token_ids(ids).count(TOKEN_IDS[family][image_token(family)]) == rows * columns
        if family in MROPE_FAMILIES:  # 2 x 2 patches a token
            assert np.array(extras["image_grid_thw"]).tolist() == [[1, 2 * rows, 2 * columns]]
            assert pixel_values.shape == (4 * rows * columns, 96)
            continue
        assert pixel_values.shape == (1, 3, 32, 32)
        if family == "mistral3":
            assert np.array(extras["image_sizes"]).tolist() == [[32, 32]]


# transformers' AutoProcessor before mlx-vlm patches it: the input ids of a
# prompt with one image, or the error loading the processor.


@pytest.mark.parametrize("size", [(48, 40), (20, 50), (90, 30), (7, 7)])
def test_the_image_tokens_are_as_many_as_the_image_features(
    family: str, vlm: tuple[Any, Any], size: tuple[int, int]
) -> None:
    model, processor = vlm
    ids, pixel_values, extras = process(processor, Image.new("RGB", size, (0, 128, 0)))
    assert pixel_values is not None
    tokens = token_ids(ids).count(TOKEN_IDS[family][image_token(family)])
    assert tokens == image_features(model, family, pixel_values, extras)
    if family == "gemma3":
        assert tokens == 16  # every image resized to 32 x 32
    elif family in MROPE_FAMILIES:
        _, height, width = (int(side) for side in np.array(extras["image_grid_thw"]).reshape(-1))
        assert tokens == (height // 2) * (width // 2) <= 16
        assert contains(token_ids(ids), expected_image_ids(family, height // 2, width // 2))
    else:
        height, width = (int(side) for side in np.array(extras["image_sizes"]).reshape(-1))
        assert tokens == (height // 8) * (width // 8)
        assert contains(token_ids(ids), expected_image_ids(family, height // 8, width // 8))


def test_the_logits_depend_on_the_image(family: str, vlm: tuple[Any, Any]) -> None:
    model, processor = vlm
    first = vlm_last_logits(model, *process(processor, red()))
    again = vlm_last_logits(model, *process(processor, red()))
    other = vlm_last_logits(model, *process(processor, blue_stripes()))
    assert mx.array_equal(first, again)
    assert float(mx.abs(first - other).max()) > 1.0
    assert int(first.argmax()) != int(other.argmax())


def test_mlx_lm_given_mlx_vlm_s_embeddings_gives_mlx_vlm_s_logits(
    family: str, model_path: Path, vlm: tuple[Any, Any]
) -> None:
    """For a text-only prompt and, but for the Qwen families, prompts with an
    image: mlx-vlm's Qwen language models position image tokens with 3-D M-RoPE
    positions (and Qwen3-VL adds deepstack features after layer 0), which
    mlx-lm's text model, given embeddings alone, cannot; the engine's tests
    cover running them split."""
    model, processor = vlm
    text_model, _ = mlx_lm_load(str(model_path))
    images = [None] if family in MROPE_FAMILIES else [None, red(), blue_stripes()]
    for image in images:
        ids, pixel_values, extras = process(processor, image)
        embeddings = merged_embeddings(model, ids, pixel_values, extras)
        expected = vlm_last_logits(model, ids, pixel_values, extras)
        logits = text_model(
            ids, cache=make_prompt_cache(text_model), input_embeddings=mx.array(embeddings)
        )[0, -1]
        assert np.allclose(np.array(logits), np.array(expected), atol=1e-4, rtol=1e-4)


def test_only_gemma3_scales_the_embeddings_it_is_given_in_place(
    family: str, model_path: Path, vlm: tuple[Any, Any]
) -> None:
    """mlx-lm's and mlx-vlm's Gemma 3 language models do `h *= sqrt(hidden)`
    on the embeddings array they are given, multiplying the caller's: a caller
    that uses the embeddings again must pass a copy."""
    model, processor = vlm
    text_model, _ = mlx_lm_load(str(model_path))
    ids, pixel_values, extras = process(processor, red())
    scale = 8.0 if family == "gemma3" else 1.0  # sqrt(64)
    for run in (
        lambda embeddings: text_model(ids, input_embeddings=embeddings),
        lambda embeddings: model.language_model(ids, inputs_embeds=embeddings),
    ):
        embeddings = merged_embeddings(model, ids, pixel_values, extras)
        original = mx.array(embeddings)
        mx.eval(run(embeddings))
        assert mx.array_equal(embeddings, original * scale)


def mlx_vlm_weights(family: str, saved: dict[str, mx.array]) -> dict[str, mx.array]:
    """The weights mlx-vlm's model should hold, named as it names them, given
    those `make_tiny_vision_model` saved: the Conv3d in MLX's layout and
    Qwen3-VL-MoE's fused experts (`gate_up_proj`, `(experts, hidden, 2 *
    intermediate)`, the gate's columns first; `down_proj`, `(experts,
    intermediate, hidden)`) as `switch_mlp`'s `(experts, out, in)` ones."""
    expected: dict[str, mx.array] = {}
    for name, array in saved.items():
        if array.ndim == 5:
            array = array.transpose(0, 2, 3, 4, 1)
        name = mlx_vlm_name(family, name)
        if name.endswith(".experts.gate_up_proj"):
            switch = name.removesuffix(".experts.gate_up_proj") + ".switch_mlp"
            gate, up = mx.split(array, 2, axis=-1)
            expected[f"{switch}.gate_proj.weight"] = gate.swapaxes(1, 2)
            expected[f"{switch}.up_proj.weight"] = up.swapaxes(1, 2)
        elif name.endswith(".experts.down_proj"):
            switch = name.removesuffix(".experts.down_proj") + ".switch_mlp"
            expected[f"{switch}.down_proj.weight"] = array.swapaxes(1, 2)
        else:
            expected[name] = array
    return expected


@pytest.mark.parametrize("more_family", MORE_VISION_FAMILIES)
def test_more_families_load_whole_and_see_the_image(
    more_family: str, smollm_dir: Path, tmp_path: Path
) -> None:
    """Qwen2-VL and Qwen3-VL-MoE, which `VISION_FAMILIES`'s tests leave out:
    mlx-lm loads the language model strictly, mlx-vlm the whole model with
    every weight in place (the MoE's fused experts split into its
    `switch_mlp`), the processor expands the image marker into as many image
    tokens as the vision tower gives features, and the logits depend on the
    image."""
    family = more_family
    path = make_tiny_vision_model(family, tmp_path / family, smollm_dir)
    saved = mx.load(str(path / "model.safetensors"))
    assert isinstance(saved, dict)
    prefixes = HUB_PREFIXES[family]
    assert all(name.startswith(prefixes) for name in saved)
    for prefix in prefixes:
        assert any(name.startswith(prefix) for name in saved)
    if family == "qwen3_vl_moe":  # 4 experts of width 32 on a hidden size of 64
        experts = "model.language_model.layers.0.mlp.experts"
        assert saved[f"{experts}.gate_up_proj"].shape == (4, 64, 2 * 32)
        assert saved[f"{experts}.down_proj"].shape == (4, 32, 64)
        assert not any("switch_mlp" in name for name in saved)

    expected = mlx_vlm_weights(family, saved)
    vlm_model = mlx_vlm_load_model(path, strict=True)
    loaded = dict(tree_flatten(vlm_model.parameters()))
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        assert mx.array_equal(loaded[name], array), name

    # mlx-lm: the language model alone, strictly, with mlx-vlm's weights
    text_model, _ = mlx_lm_load_model(path, strict=True)
    text_weights = dict(tree_flatten(text_model.parameters()))
    assert text_weights and all(name.startswith("language_model.") for name in text_weights)
    for name, array in text_weights.items():
        assert mx.array_equal(array, loaded[name]), name

    model, processor = mlx_vlm_load(str(path))
    rows, columns = 3, 4  # red() resized to 32 x 24 pixels
    ids, pixel_values, extras = process(processor, red())
    assert pixel_values is not None
    assert np.array(extras["image_grid_thw"]).tolist() == [[1, 2 * rows, 2 * columns]]
    assert contains(token_ids(ids), expected_image_ids(family, rows, columns))
    tokens = token_ids(ids).count(TOKEN_IDS[family][image_token(family)])
    assert tokens == rows * columns == image_features(model, family, pixel_values, extras)
    assert prompt_of(processor.tokenizer).count(image_marker(family)) == 1

    first = vlm_last_logits(model, ids, pixel_values, extras)
    again = vlm_last_logits(model, *process(processor, red()))
    other = vlm_last_logits(model, *process(processor, blue_stripes()))
    assert mx.array_equal(first, again)
    # (By about 12 and 14: Qwen2-VL's greedy tokens happen to be the same.)
    assert float(mx.abs(first - other).max()) > 1.0
