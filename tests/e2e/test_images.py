"""Images end to end: tiny random-weight vision models of two mlx-vlm families,
placed on the shared node beside the built-in model, asked about pictures with
the official `openai` (chat and Responses), `anthropic` and `ollama` clients."""

import base64
import io
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from PIL import Image

from exo.api.images import MAX_IMAGE_PIXELS
from exo.models.builtin import DEFAULT_MODEL_ID
from exo.models.store import model_dir
from exo.shared.types.ids import ModelId
from tests.e2e.lan_cluster import runner_pids
from tests.e2e.node_process import NodeProcess, await_instance
from tests.vision_models import VISION_FAMILIES, make_tiny_vision_model

pytestmark = pytest.mark.slow

MODELS = {family: f"tiny-vision-{family}" for family in VISION_FAMILIES}


def picture(kind: str) -> bytes:
    """A small PNG: 'red', 'green', 'stripes' (blue and white) or 'checks'."""
    image = Image.new("RGB", (48, 36), (30, 200, 60) if kind == "green" else (220, 30, 30))
    for x in range(48):
        for y in range(36):
            if kind == "stripes":
                image.putpixel((x, y), (20, 40, 230) if (x // 4) % 2 else (255, 255, 255))
            elif kind == "checks":
                image.putpixel((x, y), (0, 0, 0) if (x // 6 + y // 6) % 2 else (250, 250, 0))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vision_models(node: NodeProcess, models_dir: Path, smollm_dir: Path) -> Iterator[None]:
    """Both tiny vision models served by the shared node, for this module only."""
    placed: list[str] = []
    folders = [model_dir(models_dir, ModelId(name)) for name in MODELS.values()]
    runners = set(runner_pids(node))
    try:
        for family, folder in zip(MODELS, folders, strict=True):
            make_tiny_vision_model(family, folder, smollm_dir)
        # The node notices folders put into its models directory while it runs.
        deadline = time.monotonic() + 20
        while not set(MODELS.values()) <= node.get("/state")["cards"].keys():
            assert time.monotonic() < deadline, "the new model folders were not noticed"
            time.sleep(0.2)
        for name in MODELS.values():
            answer = httpx.post(
                f"{node.base_url}/place_instance", json={"model_id": name}, timeout=30
            )
            assert answer.status_code == 201, answer.text
            placed.append(answer.json()["instance_id"])
        for name in MODELS.values():
            assert await_instance(node.base_url, name)[-1]["status"] == "ready"
        yield
    finally:
        for instance_id in placed:
            httpx.delete(f"{node.base_url}/instance/{instance_id}", timeout=30)
        # Left as found: the models' instances and runner processes gone.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            set(MODELS.values()) & {i["model_id"] for i in node.get("/state")["instances"].values()}
            or set(runner_pids(node)) != runners
        ):
            time.sleep(0.2)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def openai_client(node: NodeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", timeout=120)


def ask_chat(node: NodeProcess, model: str, png: bytes) -> str:
    completion = openai_client(node).chat.completions.create(
        model=model,
        max_tokens=8,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": data_url(png)}},
                ],
            }
        ],
    )
    return completion.choices[0].message.content or ""


def ask_responses(node: NodeProcess, model: str, png: bytes) -> str:
    response = openai_client(node).responses.create(
        model=model,
        max_output_tokens=8,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(png), "detail": "auto"},
                    {"type": "input_text", "text": "What is in this picture?"},
                ],
            }
        ],
    )
    return response.output_text


def ask_anthropic(node: NodeProcess, model: str, png: bytes) -> str:
    client = anthropic.Anthropic(base_url=node.base_url, api_key="unused", timeout=120)
    message = client.messages.create(
        model=model,
        max_tokens=8,
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(png).decode(),
                        },
                    },
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
    )
    return "".join(block.text for block in message.content if block.type == "text")


def ask_ollama(node: NodeProcess, model: str, png: bytes) -> str:
    client = ollama.Client(host=node.base_url, timeout=120)
    answer = client.chat(
        model=model,
        messages=[{"role": "user", "content": "What is in this picture?", "images": [png]}],
        options={"temperature": 0, "num_predict": 8},
    )
    return answer.message.content or ""


ASKERS: dict[str, Callable[[NodeProcess, str, bytes], str]] = {
    "openai chat": ask_chat,
    "openai responses": ask_responses,
    "anthropic": ask_anthropic,
    "ollama": ask_ollama,
}


@pytest.mark.usefixtures("vision_models")
@pytest.mark.parametrize("family", VISION_FAMILIES)
@pytest.mark.parametrize("api", ASKERS)
def test_the_image_reaches_the_model_in_every_api(node: NodeProcess, family: str, api: str) -> None:
    ask = ASKERS[api]
    red = ask(node, MODELS[family], picture("red"))
    assert red  # greedy, random weights: some text
    assert ask(node, MODELS[family], picture("red")) == red
    assert ask(node, MODELS[family], picture("stripes")) != red


def cache_stats(node: NodeProcess, model: str) -> dict[str, Any]:
    stats = httpx.get(f"{node.base_url}/v1/cache/stats", timeout=5).json()["data"]
    return next(entry for entry in stats if entry["model"] == model)


@pytest.mark.usefixtures("vision_models")
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_the_next_turn_reads_the_image_from_the_cache(node: NodeProcess, family: str) -> None:
    client, model = openai_client(node), MODELS[family]
    png = picture("checks")  # pictures no other test sends: no entry shares them
    first: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(png)}},
                {"type": "text", "text": "Describe the picture in one word."},
            ],
        }
    ]
    turn = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=first)
    assert turn.usage is not None
    image_tokens = 16  # the tiny models' image: 16 features (and Pixtral's row breaks)
    assert turn.usage.prompt_tokens > image_tokens
    history = [
        *first,
        {"role": "assistant", "content": turn.choices[0].message.content or ""},
        {"role": "user", "content": "And the colours?"},
    ]
    second = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0, messages=history
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    # The whole first prompt, its image included, came from the cache.
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= turn.usage.prompt_tokens - 1

    # The same conversation with another picture misses at the image, and says so.
    swapped = [
        {
            **history[0],
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture("green"))}},
                history[0]["content"][1],
            ],
        },
        *history[1:],
    ]
    third = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0, messages=swapped
    )
    assert third.usage is not None and third.usage.prompt_tokens_details is not None
    cached = third.usage.prompt_tokens_details.cached_tokens or 0
    assert cached < turn.usage.prompt_tokens - image_tokens
    reasons = [miss["reason"] for miss in cache_stats(node, model)["recent_misses"]]
    assert reasons[-1] == "image_changed", cache_stats(node, model)["recent_misses"]


def test_a_text_only_model_answers_400_naming_it(node: NodeProcess) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ask_chat(node, DEFAULT_MODEL_ID, picture("red"))
    assert refused.value.status_code == 400
    assert f"{DEFAULT_MODEL_ID} reads text only" in str(refused.value)
    with pytest.raises(anthropic.BadRequestError) as refused_too:
        ask_anthropic(node, DEFAULT_MODEL_ID, picture("red"))
    assert "reads text only" in str(refused_too.value)


@pytest.mark.usefixtures("vision_models")
def test_a_malformed_or_oversized_image_is_a_400_naming_why(node: NodeProcess) -> None:
    model = MODELS[VISION_FAMILIES[0]]
    with pytest.raises(openai.BadRequestError) as malformed:
        ask_chat(node, model, b"\x89PNG\r\n\x1a\n but not really")
    assert "not a readable image" in str(malformed.value)

    huge = io.BytesIO()  # ~60 MP in a few kB: refused from its header, before decoding
    Image.new("1", (10_000, 6_000)).save(huge, format="PNG")
    assert len(huge.getvalue()) < 100_000
    with pytest.raises(openai.BadRequestError) as oversized:
        ask_chat(node, model, huge.getvalue())
    assert f"{MAX_IMAGE_PIXELS} pixels limit" in str(oversized.value)
    # The node goes on answering.
    assert ask_chat(node, model, picture("red"))
