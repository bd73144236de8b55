"""A model's recommended sampling, from its `generation_config.json`.

These fill what a request leaves out. Only the values the file sets count (as
vLLM reads them); the rest stay at OpenAI's defaults, where a filter is off. A
value the file sets out of range is ignored with a warning rather than keeping
the model from being served.
"""

import json
from pathlib import Path

from loguru import logger
from pydantic import ValidationError

from exo.shared.types.frozen import FrozenModel
from exo.shared.types.tasks import MinP, RepetitionPenalty, Temperature, TopK, TopP

GENERATION_CONFIG_FILE = "generation_config.json"


class SamplingDefaults(FrozenModel):
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty | None = None


def read_sampling_defaults(model_path: Path) -> SamplingDefaults:
    path = model_path / GENERATION_CONFIG_FILE
    if not path.exists():
        return SamplingDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        logger.warning(f"ignoring {path}: {error}")
        return SamplingDefaults()
    if not isinstance(config, dict):
        logger.warning(f"ignoring {path}: not a JSON object")
        return SamplingDefaults()
    values = {}
    for name in SamplingDefaults.model_fields:
        value = config.get(name)
        if value is None:
            continue
        try:
            SamplingDefaults.model_validate({name: value})
        except ValidationError:
            logger.warning(f"ignoring {name}={value!r} in {path}: not a valid value")
            continue
        values[name] = value
    return SamplingDefaults.model_validate(values)
