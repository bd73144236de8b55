"""What a runner is asked to do, and what it reports back."""

from typing import Annotated, Literal, Self

from pydantic import Field, model_validator

from exo.shared.types.constraints import Constraint
from exo.shared.types.frozen import FrozenModel

FinishReason = Literal["stop", "length"]

# OpenAI's limits: a logit bias lies in [-100, 100] (±100 bans or forces a
# token), penalties in [-2, 2], at most 20 alternatives per token.
LOGIT_BIAS_LIMIT = 100.0
PENALTY_LIMIT = 2.0
MAX_TOP_LOGPROBS = 20
# Tokens of prompt and reply the repetition penalty looks back over, unless asked otherwise.
REPETITION_CONTEXT_SIZE = 20

# The sampling values a model's defaults may also set (`generation_config.json`).
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0)]
Penalty = Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)]


class GenerationParams(FrozenModel):
    """How to pick each token of a reply, fully resolved: the API has already
    filled in what a request left out (model defaults, the remaining context).

    A filter or penalty at its neutral value (`top_k=0`, `min_p=0`,
    `repetition_penalty` None or 1, a zero penalty) is off."""

    max_tokens: int = Field(ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    # Multiplicative (the CTRL paper's, as Hugging Face and mlx-lm apply it) on
    # the tokens among the last `repetition_context_size` of prompt and reply.
    repetition_penalty: RepetitionPenalty | None = None
    repetition_context_size: int = Field(default=REPETITION_CONTEXT_SIZE, ge=1)
    # Additive (OpenAI's) on the tokens of the reply so far.
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # The reply's required shape, enforced by a token mask where it is sampled.
    constraint: Constraint | None = None
    # Speculative decoding (`engine/speculation.py`): drafts verified in the
    # batch, from the predicted output's tokens (OpenAI's `prediction`) and the
    # prompt. Off: one token per step.
    speculation: bool = True
    prediction: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Self:
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias: {bias} for token {token} is outside "
                    f"[{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
                )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        return self


class Usage(FrozenModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Speculative decoding: draft tokens checked, and of them those accepted
    # (all sources); of the predicted output (`GenerationParams.prediction`),
    # the tokens taken from it and those not.
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class TokenAlternative(FrozenModel):
    token: int
    logprob: float


class SampledLogprob(FrozenModel):
    """A generated token's log-probability and the most likely alternatives."""

    token: int
    logprob: float
    top_logprobs: tuple[TokenAlternative, ...] = ()


class SampledLogprobs(FrozenModel):
    """The log-probabilities of the tokens behind one piece of streamed text."""

    tokens: tuple[SampledLogprob, ...]
