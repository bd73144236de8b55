"""One validated model id wherever one enters: raw strings (`validate_model_id`),
every pydantic model that carries one (commands, events, the state), and the
path on disk."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from exo.models.store import model_dir
from exo.shared.types.commands import PlaceInstance, command_adapter
from exo.shared.types.events import DownloadRemoved, event_adapter
from exo.shared.types.ids import (
    MODEL_ID_MAX_LENGTH,
    InvalidModelId,
    ModelId,
    NodeId,
    validate_model_id,
)
from exo.shared.types.state import State

GOOD = [
    "m",
    "org/m",
    "mlx-community/Llama-3.2-3B-Instruct-4bit",
    "SmolLM2-135M-Instruct",
    "a.b_c-d/e.f",
    "x" * MODEL_ID_MAX_LENGTH,
]
BAD = [
    "",
    ".",
    "..",
    "../x",
    "org/..",
    "org/.",
    "./m",
    "a..b",
    "/abs",
    "/etc/passwd",
    "a/b/c",
    "a\\b",
    "org/",
    "/m",
    "org//m",
    ".hidden",
    "org/.hidden",
    "a b",
    "a:b",
    "C:/m",
    "m\n",
    "x" * (MODEL_ID_MAX_LENGTH + 1),
]


@pytest.mark.parametrize("text", GOOD)
def test_good_ids_pass_everywhere(text: str, tmp_path: Path) -> None:
    assert validate_model_id(text) == text
    assert isinstance(validate_model_id(text), ModelId)
    place = command_adapter.validate_json(
        f'{{"kind": "place_instance", "instance_id": "i", "model_id": "{text}"}}'
    )
    assert isinstance(place, PlaceInstance) and place.model_id == text
    assert model_dir(tmp_path, ModelId(text)).parent == tmp_path


@pytest.mark.parametrize("text", BAD)
def test_bad_ids_are_refused_everywhere(text: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidModelId):
        validate_model_id(text)
    with pytest.raises(ValidationError):
        PlaceInstance.model_validate({"instance_id": "i", "model_id": text})
    with pytest.raises(ValidationError):
        event_adapter.validate_python(
            {"kind": "download_removed", "node_id": "n", "model_id": text}
        )
    with pytest.raises(ValidationError):  # a key of the state, as a follower reads it
        State.model_validate({"downloads": {"n": {text: {}}}})
    with pytest.raises(InvalidModelId):  # an unchecked cast never reaches the disk
        model_dir(tmp_path, ModelId(text))


def test_a_model_id_serializes_as_a_plain_string() -> None:
    event = DownloadRemoved(node_id=NodeId("n"), model_id=validate_model_id("org/m"))
    assert event.model_dump_json() == '{"kind":"download_removed","node_id":"n","model_id":"org/m"}'
    read = event_adapter.validate_json(event.model_dump_json())
    assert read == event
    assert isinstance(read, DownloadRemoved) and type(read.model_id) is ModelId
