"""A model's recommended sampling, read from its `generation_config.json`."""

import json
from pathlib import Path

import pytest

from exo.models.sampling_defaults import (
    GENERATION_CONFIG_FILE,
    SamplingDefaults,
    read_sampling_defaults,
)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, SamplingDefaults()),
        (
            {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": [1, 2]},
            SamplingDefaults(temperature=0.6, top_p=0.9),
        ),
        (
            {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0, "repetition_penalty": 1.05},
            SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
        ),
        ({"top_k": None, "min_p": 0.05}, SamplingDefaults(min_p=0.05)),
        # A value out of range or of the wrong kind is dropped; the rest still count.
        ({"temperature": 0.3, "top_p": 0.0}, SamplingDefaults(temperature=0.3)),
        ({"temperature": "warm", "top_k": -1, "top_p": 0.5}, SamplingDefaults(top_p=0.5)),
        ([0.5], SamplingDefaults()),
        ("{not json", SamplingDefaults()),
    ],
)
def test_defaults_come_from_what_the_file_sets(
    tmp_path: Path, content: object, expected: SamplingDefaults
) -> None:
    if isinstance(content, str):
        (tmp_path / GENERATION_CONFIG_FILE).write_text(content)
    elif content is not None:
        (tmp_path / GENERATION_CONFIG_FILE).write_text(json.dumps(content))
    assert read_sampling_defaults(tmp_path) == expected


def test_the_builtin_model_recommends_its_sampling(smollm_dir: Path) -> None:
    assert read_sampling_defaults(smollm_dir) == SamplingDefaults(temperature=0.2, top_p=0.9)
