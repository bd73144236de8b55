"""A model this node serves: the first rank's runner and what the API needs with it."""

from dataclasses import dataclass, field
from typing import Any

from exo.models.chat_tokenizer import ChatTokenizer
from exo.models.sampling_defaults import SamplingDefaults
from exo.models.vision import ImagePrompts
from exo.shared.types.chat import ChatRequest
from exo.shared.types.ids import ModelId
from exo.worker.runner.supervisor import RunnerSupervisor


@dataclass
class ServedModel:
    model_id: ModelId
    tokenizer: ChatTokenizer
    context_length: int
    runner: RunnerSupervisor
    created: int
    # The most bytes of text one token stands for (`longest_token_bytes`):
    # a prompt's size bounds its tokens from below before it is tokenized.
    max_token_bytes: int
    # What a request leaves out of its sampling (the model's generation_config.json).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # What reads its requests' images, or why it takes none (`models/vision.py`).
    images: ImagePrompts | str = "the model reads text only"
    # The node's `--draft-model` where it drafts for this model, else why not
    # (`models/draft_models.py`); both None without one.
    draft_model: ModelId | None = None
    draft_refused: str | None = None
    # The last request the API rendered, and its prompt (`api.generation.render`:
    # an `api.chat_prompt.ChatPrompt`, which this layer does not import).
    last_prompt: tuple[ChatRequest, Any] | None = None

    @property
    def vocabulary_size(self) -> int:
        return len(self.tokenizer)
