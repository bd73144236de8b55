"""A vision model split by layers reads images on its first rank: real runner
processes on a loopback ring answer a prompt with an image as one runner does,
and the next turn finds the image in every rank's prefix cache (and, where
images shift the positions of the text after them, its position deltas)."""

import io
from pathlib import Path

import pytest
from PIL import Image

from exo.api.chat_prompt import ChatPrompt, render_prompt
from exo.api.images import decode_image
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.models.vision import ImagePrompts, Picture
from exo.shared.types.chat import ChatImage, ChatRequest, ChatTurn
from exo.shared.types.ids import TaskId
from exo.shared.types.tasks import GenerationParams, Usage
from exo.worker.runner.protocol import Generate
from tests.pipeline_harness import RunnerProcess, even_bounds, running_pipeline
from tests.vision_models import make_tiny_vision_model

pytestmark = pytest.mark.slow

GREEDY = GenerationParams(max_tokens=10, temperature=0.0)
LAYERS = 2  # the tiny vision models' text layers


def png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(out, format="PNG")
    return out.getvalue()


def prompt(model_dir: Path, turns: list[ChatTurn]) -> ChatPrompt:
    tokenizer = load_chat_tokenizer(model_dir)
    pictures = []
    for turn in turns:
        for image in turn.images:
            decoded = decode_image(image.data)
            pictures.append(Picture(decoded.image, decoded.digest, image.data))
    request = ChatRequest(model="tiny", turns=tuple(turns))
    return render_prompt(tokenizer, request, pictures, ImagePrompts(model_dir, tokenizer))


def generate(runner: RunnerProcess, task_id: str, asked: ChatPrompt) -> tuple[str, Usage]:
    runner.send(
        Generate(
            task_id=TaskId(task_id), tokens=asked.tokens, params=GREEDY, images=list(asked.images)
        )
    )
    result = runner.collect(task_id, timeout=120)
    assert result.finished is not None, f"{result.failed}; log: {runner.log_path}"
    return result.text, result.finished.usage


# Gemma 3: 1-D positions; Qwen3-VL: 2-D ones (every rank computes them) and
# deepstack features added on the first rank.
@pytest.mark.parametrize("family", ["gemma3", "qwen3_vl"])
def test_a_pipeline_reads_images_on_its_first_rank(
    tmp_path: Path, smollm_dir: Path, family: str
) -> None:
    model_dir = make_tiny_vision_model(family, tmp_path / "tiny-vision", smollm_dir)
    asking = ChatTurn(
        role="user", content="What is it?", images=(ChatImage(data=png((200, 30, 30))),)
    )
    first = prompt(model_dir, [asking])
    other = prompt(
        model_dir,
        [asking.model_copy(update={"images": (ChatImage(data=png((20, 40, 230))),)})],
    )
    replies: dict[int, list[tuple[str, Usage]]] = {}
    for ranks in (1, 2):
        work = tmp_path / f"ranks-{ranks}"
        work.mkdir()
        with running_pipeline(model_dir, work, even_bounds(LAYERS, ranks)) as pipeline:
            entry = pipeline.entry
            answer, usage = generate(entry, "first", first)
            follow_up = prompt(
                model_dir,
                [
                    asking,
                    ChatTurn(role="assistant", content=answer),
                    ChatTurn(role="user", content="Sure?"),
                ],
            )
            replies[ranks] = [
                (answer, usage),
                generate(entry, "other", other),
                generate(entry, "follow-up", follow_up),
            ]
    assert [text for text, _ in replies[2]] == [text for text, _ in replies[1]]
    assert replies[1][0][0] != replies[1][1][0]  # the image decides the reply
    (image,) = first.images
    for ranks in (1, 2):
        # The follow-up found the first turn, its image included, in the cache.
        assert replies[ranks][2][1].cached_tokens >= image.end
