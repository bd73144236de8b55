"""Images through the node's rendering and the runner's engine, in-process, on
tiny random-weight vision models of two mlx-vlm families: the reply depends on
the image, the prefix cache keys images by their pixels, and requests with
images batch with text-only ones."""

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from exo.api.chat_prompt import ChatPrompt, render_prompt
from exo.api.images import decode_image
from exo.engine.mlx.batch import ContinuousBatcher, GenerationFailed
from exo.engine.mlx.generate import Finished, LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.engine.mlx.prefix_cache import KVPrefixCache
from exo.engine.mlx.vision import ImagePrompt, VisionEncoder
from exo.models.chat_tokenizer import ChatTokenizer, load_chat_tokenizer
from exo.models.vision import ImagePrompts, Picture
from exo.shared.prompt_images import is_image_key, model_ids
from exo.shared.types.chat import ChatImage, ChatRequest, ChatTurn
from exo.shared.types.tasks import GenerationParams, Usage
from tests.batch_drain import drain
from tests.vision_models import VISION_FAMILIES, make_tiny_vision_model


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
) -> Iterator[VisionSetup]:
    family: str = request.param
    model_dir = make_tiny_vision_model(family, tmp_path_factory.mktemp(family) / family, smollm_dir)
    model, tokenizer = load_for_inference(model_dir)
    chat_tokenizer = load_chat_tokenizer(model_dir)
    yield VisionSetup(
        model_dir,
        chat_tokenizer,
        ImagePrompts(model_dir, chat_tokenizer),
        LocalModel(model, tokenizer),
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
    ours = ImagePrompt(setup.vision, prompt.tokens, prompt.images).embeddings(0, len(theirs))
    assert ours is not None and expected is not None
    assert np.allclose(np.array(ours), np.array(expected), atol=1e-5)
