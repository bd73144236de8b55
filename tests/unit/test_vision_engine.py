"""Images through the node's rendering and the runner's engine, in-process, on
tiny random-weight vision models of two mlx-vlm families: the reply depends on
the image, the prefix cache keys images by their pixels, and requests with
images batch with text-only ones."""

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_config
from PIL import Image

from exo.api.chat_prompt import ChatPrompt, render_prompt
from exo.api.images import decode_image
from exo.engine.mlx.batch import ContinuousBatcher, GenerationFailed
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.multimodal_rope import with_multimodal_rope
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.vision import ImagePrompt, VisionEncoder
from exo.models.chat_tokenizer import ChatTokenizer, load_chat_tokenizer
from exo.models.vision import ImagePrompts, Picture, image_prompts_for
from exo.shared.prompt_images import GRID_FAMILIES, IMAGE_MARKERS, is_image_key, model_ids
from exo.shared.types.chat import ChatImage, ChatRequest, ChatTurn
from exo.shared.types.tasks import GenerationParams, Usage
from tests.batch_drain import drain
from tests.vision_models import MORE_VISION_FAMILIES, VISION_FAMILIES, make_tiny_vision_model


def png(kind: str, size: tuple[int, int] = (40, 32)) -> bytes:
    """A small picture: 'red', 'stripes' (blue and white) or 'noise'."""
    image = Image.new("RGB", size, (220, 30, 30))
    if kind == "stripes":
        for x in range(size[0]):
            for y in range(size[1]):
                image.putpixel((x, y), (20, 40, 230) if (x // 4) % 2 else (255, 255, 255))
    elif kind == "noise":
        image = Image.effect_noise(size, 80).convert("RGB")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@dataclass
class VisionSetup:
    model_dir: Path
    tokenizer: ChatTokenizer
    prompts: ImagePrompts
    local: LocalModel
    vision: VisionEncoder

    def generator(self, cache: KVPrefixCache | None = None, step: int = 512) -> TextGenerator:
        return TextGenerator(
            self.local, self.local.tokenizer, cache, prefill_step_tokens=step, vision=self.vision
        )

    def prompt(self, turns: Sequence[ChatTurn]) -> ChatPrompt:
        request = ChatRequest(model="tiny", turns=tuple(turns))
        pictures = []
        for turn in turns:
            for image in turn.images:
                decoded = decode_image(image.data)
                pictures.append(Picture(decoded.image, decoded.digest, image.data))
        return render_prompt(self.tokenizer, request, pictures, self.prompts)


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path
) -> VisionSetup:
    return _setup(request.param, tmp_path_factory, smollm_dir)


@pytest.fixture(scope="module", params=MORE_VISION_FAMILIES)
def more_setup(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path
) -> VisionSetup:
    """Families tested for their logits only (their paths are the others')."""
    return _setup(request.param, tmp_path_factory, smollm_dir)


def _setup(family: str, tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> VisionSetup:
    model_dir = make_tiny_vision_model(family, tmp_path_factory.mktemp(family) / family, smollm_dir)
    model, tokenizer = load_for_inference(model_dir)
    chat_tokenizer = load_chat_tokenizer(model_dir)
    return VisionSetup(
        model_dir,
        chat_tokenizer,
        ImagePrompts(model_dir, chat_tokenizer),
        LocalModel(with_multimodal_rope(model, load_config(model_dir)), tokenizer),
        VisionEncoder(model_dir, model),
    )


def asking(image: bytes, text: str = "What is in this picture?") -> ChatTurn:
    return ChatTurn(role="user", content=text, images=(ChatImage(offset=0, data=image),))


GREEDY = GenerationParams(max_tokens=12, temperature=0.0)


def reply(generator: TextGenerator, prompt: ChatPrompt) -> tuple[str, Usage]:
    text, usage = "", None
    for output in generator.generate(prompt.tokens, GREEDY, images=prompt.images):
        if isinstance(output, TextDelta):
            text += output.text
        elif isinstance(output, Finished):
            usage = output.usage
    assert usage is not None
    return text, usage


def test_an_image_becomes_its_keyed_placeholders_within_its_span(setup: VisionSetup) -> None:
    prompt = setup.prompt([asking(png("red"))])
    (image,) = prompt.images
    keys = [t for t in prompt.tokens if is_image_key(t)]
    assert keys and len(set(keys)) == 1
    assert is_image_key(prompt.tokens[image.start]) and is_image_key(prompt.tokens[image.end - 1])
    assert prompt.tokens.index(keys[0]) == image.start
    # The same pixels give the same keys; other pixels other keys.
    again = setup.prompt([asking(png("red"))])
    other = setup.prompt([asking(png("stripes"))])
    assert again.tokens == prompt.tokens
    assert other.tokens != prompt.tokens
    assert len(other.tokens) == len(prompt.tokens) or setup.prompts.family == "mistral3"


def test_the_reply_depends_on_the_image(setup: VisionSetup) -> None:
    generator = setup.generator()
    red, _ = reply(generator, setup.prompt([asking(png("red"))]))
    red_again, _ = reply(generator, setup.prompt([asking(png("red"))]))
    stripes, _ = reply(generator, setup.prompt([asking(png("stripes"))]))
    assert red == red_again
    assert red != stripes


def test_an_image_read_across_prefill_chunks_reads_as_in_one(setup: VisionSetup) -> None:
    prompt = setup.prompt([asking(png("noise"))])
    whole, _ = reply(setup.generator(step=512), prompt)
    chunked, _ = reply(setup.generator(step=3), prompt)
    assert whole == chunked


def test_the_next_turn_restores_the_image_from_the_prefix_cache(setup: VisionSetup) -> None:
    cache = KVPrefixCache(64 * 1024 * 1024, decode=setup.local.tokenizer.decode)
    generator = setup.generator(cache)
    first_turn = [asking(png("stripes"))]
    first = setup.prompt(first_turn)
    answer, _ = reply(generator, first)
    second = setup.prompt(
        [
            *first_turn,
            ChatTurn(role="assistant", content=answer),
            ChatTurn(role="user", content="And?"),
        ]
    )
    _, usage = reply(generator, second)
    (image,) = second.images
    assert usage.cached_tokens >= image.end  # the image's tokens came from the cache

    # Another picture in its place misses there, and says why.
    swapped = setup.prompt(
        [
            asking(png("red")),
            ChatTurn(role="assistant", content=answer),
            ChatTurn(role="user", content="And?"),
        ]
    )
    _, usage = reply(generator, swapped)
    assert usage.cached_tokens <= swapped.images[0].start
    miss = cache.stats().recent_misses[-1]
    assert miss.reason == "image_changed"
    assert miss.diverged_at == swapped.images[0].start


def test_a_request_with_an_image_batches_with_text_requests(setup: VisionSetup) -> None:
    alone = setup.generator()
    image_prompt = setup.prompt([asking(png("noise"))])
    text_prompt = setup.prompt([ChatTurn(role="user", content="Say something long.")])
    expected = {"image": reply(alone, image_prompt)[0], "text": reply(alone, text_prompt)[0]}

    batcher = ContinuousBatcher(setup.generator(), max_batch=4)
    batcher.add("text", text_prompt.tokens, GREEDY)
    batcher.add("image", image_prompt.tokens, GREEDY, images=image_prompt.images)
    outputs = drain(batcher)
    assert not [o for o in outputs.values() if any(isinstance(x, GenerationFailed) for x in o)]
    texts = {
        task: "".join(o.text for o in out if isinstance(o, TextDelta))
        for task, out in outputs.items()
    }
    assert texts == expected


def test_a_prompt_cut_inside_an_image_is_refused(setup: VisionSetup) -> None:
    prompt = setup.prompt([asking(png("red"))])
    (image,) = prompt.images
    with pytest.raises(ValueError, match="inside an image"):
        list(setup.generator().generate(prompt.tokens[: image.start + 2], GREEDY, images=()))


def test_the_prompt_and_its_embeddings_are_those_mlx_vlm_makes(setup: VisionSetup) -> None:
    """The node's expansion of the image marker gives the ids mlx-vlm's processor
    gives, and the runner's embeddings (an image's span at a time) equal mlx-vlm's
    merge over the whole prompt."""
    from mlx_vlm.utils import load as load_vlm

    loaded_vlm, loaded = load_vlm(str(setup.model_dir))
    vlm: Any = loaded_vlm
    processor: Any = loaded  # mlx-vlm's processor: its own keyword arguments
    data = png("noise", (50, 20))  # not square: the Pixtral grid has unequal sides
    turn = asking(data, "Describe it.")
    prompt = setup.prompt([turn])
    text = setup.tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}],
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    with Image.open(io.BytesIO(data)) as opened:
        batch = dict(
            processor(text=[text], images=[opened.convert("RGB")], add_special_tokens=False)
        )
    theirs = [int(t) for t in np.array(batch.pop("input_ids"))[0]]
    assert model_ids(prompt.tokens, setup.vision.placeholder) == theirs

    mask = mx.array(np.array(batch.pop("attention_mask")))
    pixel_values = mx.array(np.array(batch.pop("pixel_values")))
    extras = {key: mx.array(np.array(value)) for key, value in batch.items()}
    expected = vlm.get_input_embeddings(
        input_ids=mx.array([theirs]), pixel_values=pixel_values, mask=mask, **extras
    ).inputs_embeds
    ours = ImagePrompt(
        prompt.tokens, prompt.images, setup.vision.placeholder, setup.vision
    ).embeddings(0, len(theirs))
    assert ours is not None and expected is not None
    assert np.allclose(np.array(ours), np.array(expected), atol=1e-5)


def test_the_next_turn_from_the_cache_replies_as_without_it(setup: VisionSetup) -> None:
    """The cache restores the image's tokens and, where images shift the
    positions of the text after them (M-RoPE), their deltas too."""
    cache = KVPrefixCache(64 * 1024 * 1024, decode=setup.local.tokenizer.decode)
    first_turn = [asking(png("noise", (48, 24)), "One.")]
    answer, _ = reply(setup.generator(cache), setup.prompt(first_turn))
    turns = [*first_turn, ChatTurn(role="assistant", content=answer)]
    second = setup.prompt([*turns, asking(png("stripes"), "Two?")])
    cached, usage = reply(setup.generator(cache), second)
    assert usage.cached_tokens > second.images[0].end
    fresh, usage = reply(setup.generator(), second)
    assert usage.cached_tokens == 0
    assert cached == fresh


def test_the_logits_are_mlx_vlms_for_images_in_two_dimensions(setup: VisionSetup) -> None:
    """Families that place image tokens in 2-D (M-RoPE): the prompt read in
    chunks that cut through its images gives the logits mlx-vlm's whole model
    gives (its positions computed over the whole prompt; Qwen3-VL's deepstack
    features added)."""
    if setup.prompts.family not in GRID_FAMILIES:
        pytest.skip("1-D positions: test_vision_models compares the logits")
    _assert_logits_are_mlx_vlms(setup)


def test_the_logits_are_mlx_vlms_in_more_families(more_setup: VisionSetup) -> None:
    """Qwen2-VL and Qwen3-VL MoE, as above."""
    _assert_logits_are_mlx_vlms(more_setup)


def _assert_logits_are_mlx_vlms(setup: VisionSetup) -> None:
    from mlx_vlm.utils import load as load_vlm

    loaded_vlm, loaded = load_vlm(str(setup.model_dir))
    vlm: Any = loaded_vlm
    processor: Any = loaded
    pictures = [png("noise", (50, 20)), png("stripes", (24, 40))]
    turn = ChatTurn(
        role="user",
        content="Compare this and that.",
        images=(ChatImage(offset=8, data=pictures[0]), ChatImage(offset=17, data=pictures[1])),
    )
    prompt = setup.prompt([turn])
    ids = model_ids(prompt.tokens, setup.vision.placeholder)
    # The rendered prompt with each image's placeholders back to the one marker
    # the chat template wrote (Qwen's marker is its image token).
    marker = IMAGE_MARKERS[setup.prompts.family]
    text = re.sub(f"(?:{re.escape(marker)})+", marker, setup.tokenizer.decode(ids))
    opened = [Image.open(io.BytesIO(data)).convert("RGB") for data in pictures]
    batch = dict(processor(text=[text], images=opened, add_special_tokens=False))
    theirs_ids = [int(t) for t in np.array(batch.pop("input_ids"))[0]]
    assert theirs_ids == ids
    mask = mx.array(np.array(batch.pop("attention_mask")))
    expected = vlm(
        mx.array([ids]),
        pixel_values=mx.array(np.array(batch.pop("pixel_values"))),
        mask=mask,
        **{key: mx.array(np.array(value)) for key, value in batch.items()},
    ).logits[0, -1]

    local = setup.local
    layers = local.make_cache()
    image_prompt = ImagePrompt(prompt.tokens, prompt.images, setup.vision.placeholder, setup.vision)
    chunks = setup.generator(step=5).prefill_chunks(prompt.tokens[:-1], 0, layers, 0, image_prompt)
    for _ in chunks:
        pass
    ours = local.model(mx.array([[ids[-1]]]), cache=layers)[0, -1]
    assert np.allclose(np.array(ours), np.array(expected), atol=1e-4)


def test_which_instances_take_images_and_why_not(setup: VisionSetup) -> None:
    family = setup.prompts.family
    whole = image_prompts_for(setup.model_dir, "tiny", setup.tokenizer, None)
    assert isinstance(whole, ImagePrompts)
    tensor = image_prompts_for(setup.model_dir, "tiny", setup.tokenizer, "tensor")
    assert isinstance(tensor, str) and "split by tensors" in tensor
    # A pipeline whose first rank holds no layer: only Qwen3-VL's deepstack
    # layers must be there (the tiny one has one).
    pipeline = image_prompts_for(setup.model_dir, "tiny", setup.tokenizer, "pipeline", 0)
    if family == "qwen3_vl":
        assert isinstance(pipeline, str) and "first 1 layers" in pipeline
    else:
        assert isinstance(pipeline, ImagePrompts)


def test_a_qwen_image_too_narrow_is_refused(setup: VisionSetup) -> None:
    if setup.prompts.family not in GRID_FAMILIES:
        pytest.skip("only Qwen's image processor bounds the sides' ratio")
    with pytest.raises(ValueError, match="ratio must be under 200"):
        setup.prompt([asking(png("red", (401, 2)))])
