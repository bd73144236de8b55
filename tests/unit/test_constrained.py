"""Grammar-constrained sampling with llguidance, on the built-in model's tokenizer
and, where text is generated, the built-in model itself (greedy, <= 40 tokens)."""

import json
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import TokenizerWrapper
from pydantic import ValidationError

from exo.api.chat_prompt import render_prompt, tool_call_format
from exo.api.errors import APIError
from exo.api.generation import constraint_for
from exo.engine.constraint_grammar import ConstraintError, check_constraint
from exo.engine.mlx.constrained import (
    CompiledConstraint,
    ConstraintMatcher,
    compile_constraint,
)
from exo.engine.mlx.load import load_for_inference
from exo.engine.tool_calls.formats import MISTRAL_FORMAT, ToolCallFamily
from exo.engine.tool_calls.parser import parse_tool_calls
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.shared.types.chat import ChatRequest, ChatTurn, ToolFunction
from exo.shared.types.constraints import (
    Constraint,
    JsonObject,
    JsonSchema,
    ToolCalls,
    ToolSpec,
)

MAX_NEW_TOKENS = 40
WEATHER_ARGUMENTS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = ToolSpec(name="get_weather", parameters=WEATHER_ARGUMENTS)
CLOCK = ToolSpec(name="get_time")
HERMES = ToolCalls(tools=(WEATHER, CLOCK), prefix="<tool_call>\n", suffix="\n</tool_call>")
# tool_choice auto with a strict tool: text, or text then schema-valid calls
HERMES_OR_TEXT = HERMES.model_copy(update={"text_allowed": True, "markers": ("<tool_call>",)})
LLAMA_OR_TEXT = HERMES.model_copy(
    update={
        "prefix": "",
        "suffix": "",
        "arguments_key": "parameters",
        "markers": ("<|python_tag|>",),
        "bare_json_start": True,
        "text_allowed": True,
    }
)
MISTRAL_LIKE = HERMES.model_copy(update={"prefix": "[CALLS]", "suffix": "", "list_form": True})
COUNT = JsonSchema(
    json_schema={
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
)
WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CLOCK_CALL = '{"name": "get_time", "arguments": {}}'
BAD_WEATHER_CALL = '{"name": "get_weather", "arguments": {"town": "Paris"}}'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def loaded(smollm_dir: Path) -> tuple[nn.Module, TokenizerWrapper]:
    return load_for_inference(smollm_dir)


@pytest.fixture(scope="module")
def tokenizer(loaded: tuple[nn.Module, TokenizerWrapper]) -> TokenizerWrapper:
    return loaded[1]


def _row(matcher: ConstraintMatcher, tokens: list[int], width: int) -> np.ndarray:
    return np.array(matcher(mx.array(tokens), mx.zeros((1, width)))[0])


def _mask(
    compiled: CompiledConstraint, tokenizer: TokenizerWrapper, text: str
) -> np.ndarray | None:
    """The mask after feeding `text` token by token (None: a token was refused)."""
    matcher = compiled.matcher()
    vocab = len(tokenizer._tokenizer)
    tokens = [0]
    for token in tokenizer.encode(text, add_special_tokens=False):
        if np.isinf(_row(matcher, tokens, vocab)[token]):
            return None
        tokens.append(token)
    return _row(matcher, tokens, vocab)


def _allowed(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(~np.isinf(mask)).tolist()


def _starts_an_object(tokenizer: TokenizerWrapper, tokens: list[int]) -> bool:
    texts = [tokenizer.decode([token]) for token in tokens]
    return "{" in texts and all(text.startswith("{") for text in texts)


def _admits(constraint: Constraint, tokenizer: TokenizerWrapper, text: str) -> bool:
    """Whether the constraint lets the model write exactly `text`, then EOS."""
    mask = _mask(compile_constraint(tokenizer, constraint), tokenizer, text)
    return mask is not None and not np.isinf(mask[sorted(tokenizer.eos_token_ids)]).all()


@pytest.mark.parametrize(
    ("constraint", "text", "admitted"),
    [
        (JsonObject(), '{"a": [1, {"b": null}], "c": "}"}', True),
        (JsonObject(), '{\n  "a": 1\n}', True),
        (JsonObject(), "[1, 2]", False),
        (JsonObject(), '{"a": 1} and more', False),
        (JsonObject(), '{"a": 1', False),
        (COUNT, '{"n": 12}', True),
        (COUNT, '{"n":12}', True),
        (COUNT, '{"n": "12"}', False),
        (COUNT, "{}", False),
        (COUNT, '{"n": 1, "m": 2}', False),
        (HERMES, f"<tool_call>\n{WEATHER_CALL}\n</tool_call>", True),
        (HERMES, f"<tool_call>\n{CLOCK_CALL}\n</tool_call>", True),
        (HERMES, f"{WEATHER_CALL}", False),
        (HERMES, f"Sure! <tool_call>\n{WEATHER_CALL}\n</tool_call>", False),
        (HERMES, '<tool_call>\n{"name": "get_wind", "arguments": {}}\n</tool_call>', False),
        (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', False),
        (
            HERMES,
            f"<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{CLOCK_CALL}\n</tool_call>",
            False,
        ),
        (
            HERMES.model_copy(update={"parallel": True}),
            f"<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{CLOCK_CALL}\n</tool_call>",
            True,
        ),
        (
            HERMES.model_copy(update={"named": "get_time"}),
            f"<tool_call>\n{CLOCK_CALL}\n</tool_call>",
            True,
        ),
        (
            HERMES.model_copy(update={"named": "get_time"}),
            f"<tool_call>\n{WEATHER_CALL}\n</tool_call>",
            False,
        ),
        (
            HERMES.model_copy(update={"arguments_key": "parameters"}),
            '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>',
            True,
        ),
        (MISTRAL_LIKE, f"[CALLS][{WEATHER_CALL}]", True),
        (MISTRAL_LIKE, f"[CALLS][{WEATHER_CALL}, {CLOCK_CALL}]", False),
        (
            MISTRAL_LIKE.model_copy(update={"parallel": True}),
            f"[CALLS][{WEATHER_CALL}, {CLOCK_CALL}]",
            True,
        ),
        (HERMES_OR_TEXT, "It is sunny in Paris {today} <b>", True),
        (HERMES_OR_TEXT, "", True),
        (HERMES_OR_TEXT, f"<tool_call>\n{WEATHER_CALL}\n</tool_call>", True),
        (HERMES_OR_TEXT, f"Let me check.\n<tool_call>\n{WEATHER_CALL}\n</tool_call>", True),
        (HERMES_OR_TEXT, f"<tool_call>\n{BAD_WEATHER_CALL}\n</tool_call>", False),
        (HERMES_OR_TEXT, '<tool_call>\n{"name": "get_wind", "arguments": {}}\n</tool_call>', False),
        (HERMES_OR_TEXT, "a <tool_call> that is no call", False),
        (HERMES_OR_TEXT, f"<tool_call>\n{WEATHER_CALL}\n</tool_call> and text", False),
        (
            HERMES_OR_TEXT,
            f"<tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{CLOCK_CALL}\n</tool_call>",
            False,
        ),
        (
            HERMES_OR_TEXT.model_copy(update={"parallel": True}),
            f"So: <tool_call>\n{WEATHER_CALL}\n</tool_call>\n<tool_call>\n{CLOCK_CALL}\n</tool_call>",
            True,
        ),
        (LLAMA_OR_TEXT, "Paris is {sunny}", True),
        (LLAMA_OR_TEXT, LLAMA_CALL, True),
        (LLAMA_OR_TEXT, f"\n {LLAMA_CALL}", True),
        (LLAMA_OR_TEXT, f"Checking <|python_tag|>{LLAMA_CALL}", True),
        (LLAMA_OR_TEXT, '{"name": "get_weather", "parameters": {"town": "Paris"}}', False),
        (LLAMA_OR_TEXT, " {not a call}", False),
        (
            HERMES.model_copy(update={"prefix": 'say "hi" \\ é\t'}),
            f'say "hi" \\ é\t{WEATHER_CALL}\n</tool_call>',
            True,
        ),
    ],
)
def test_constraint_admits_exactly_its_texts(
    tokenizer: TokenizerWrapper, constraint: Constraint, text: str, admitted: bool
) -> None:
    assert _admits(constraint, tokenizer, text) == admitted


def test_with_text_allowed_a_special_token_marker_is_asked_for_as_that_token(
    tokenizer: TokenizerWrapper,
) -> None:
    constraint = HERMES_OR_TEXT.model_copy(
        update={"prefix": "<|im_start|>\n", "markers": ("<|im_start|>",)}
    )
    assert _admits(constraint, tokenizer, "No call needed.")
    assert _admits(constraint, tokenizer, f"Sure <|im_start|>\n{WEATHER_CALL}\n</tool_call>")
    assert not _admits(constraint, tokenizer, f"<|im_start|>\n{BAD_WEATHER_CALL}\n</tool_call>")


def test_only_eos_follows_a_complete_reply(tokenizer: TokenizerWrapper) -> None:
    compiled = compile_constraint(tokenizer, COUNT)
    mask = _mask(compiled, tokenizer, '{"n": 7}')
    assert mask is not None
    assert _allowed(mask) == sorted(tokenizer.eos_token_ids)


def test_a_marker_that_is_a_special_token_is_asked_for_as_that_token(
    tokenizer: TokenizerWrapper,
) -> None:
    # SmolLM2's `<|im_start|>` is special token 1: the grammar asks for the token,
    # not for the characters that spell it.
    constraint = HERMES.model_copy(update={"prefix": "<|im_start|>"})
    compiled = compile_constraint(tokenizer, constraint)
    first = _row(compiled.matcher(), [0], len(tokenizer._tokenizer))
    assert _allowed(first) == [1]
    assert _admits(constraint, tokenizer, f"<|im_start|>{WEATHER_CALL}\n</tool_call>")


def test_a_head_wider_than_the_vocabulary_never_samples_past_it(
    tokenizer: TokenizerWrapper,
) -> None:
    vocab = len(tokenizer._tokenizer)
    matcher = compile_constraint(tokenizer, JsonObject()).matcher()
    masked = _row(matcher, [0], vocab + 64)
    assert masked.shape == (vocab + 64,)
    assert np.isinf(masked[vocab:]).all()
    assert _starts_an_object(tokenizer, _allowed(masked))


def test_matchers_of_one_compilation_are_independent(tokenizer: TokenizerWrapper) -> None:
    compiled = compile_constraint(tokenizer, COUNT)
    assert compile_constraint(tokenizer, COUNT) is compiled
    assert compile_constraint(tokenizer, JsonObject()) is not compiled
    done = _mask(compiled, tokenizer, '{"n": 7}')
    fresh = _row(compiled.matcher(), [0], len(tokenizer._tokenizer))
    assert done is not None and _allowed(done) == sorted(tokenizer.eos_token_ids)
    assert _starts_an_object(tokenizer, _allowed(fresh))


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (JsonSchema(json_schema={"type": "foo"}), "json_schema: .*Invalid type: foo"),
        (
            JsonSchema(json_schema={"type": "array", "uniqueItems": True}),
            r'json_schema: .*Unimplemented keys: \["uniqueItems"\]',
        ),
        (
            JsonSchema(json_schema={"type": "integer", "minimum": 5, "maximum": 1}),
            "json_schema: .*minimum .5. is greater than maximum .1.",
        ),
        (
            JsonSchema(json_schema={"$ref": "#/$defs/missing"}),
            "json_schema: .*/[$]defs/missing.* does not exist",
        ),
        (
            ToolCalls(
                tools=(
                    WEATHER,
                    ToolSpec(
                        name="grep",
                        parameters={"properties": {"p": {"type": "string", "pattern": "(?=a)"}}},
                    ),
                ),
                prefix="",
                suffix="",
            ),
            "(?s)parameters of tool 'grep': .*look-around",
        ),
    ],
)
def test_an_uncompilable_constraint_is_refused_naming_the_problem(
    tokenizer: TokenizerWrapper, constraint: Constraint, message: str
) -> None:
    with pytest.raises(ConstraintError, match=message) as checked:
        check_constraint(constraint)
    assert " | " not in str(checked.value)  # no grammar excerpt in a user's error
    with pytest.raises(ConstraintError, match=message):
        compile_constraint(tokenizer, constraint)


def test_without_strict_an_unimplemented_keyword_is_ignored(tokenizer: TokenizerWrapper) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    constraint = JsonSchema(json_schema=schema, strict=False)
    check_constraint(constraint)
    assert _admits(constraint, tokenizer, "[1, 2]")


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"tools": ()}, "at least 1 item"),
        ({"tools": (WEATHER, WEATHER)}, "tool names must be unique, repeated: get_weather"),
        ({"named": "get_wind"}, "named tool 'get_wind' is not among the tools"),
        (
            {"text_allowed": True, "markers": ("<call>",)},
            "with text allowed, a prefix starts with one of the markers",
        ),
    ],
)
def test_tool_calls_are_checked_when_built(fields: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ToolCalls.model_validate(HERMES.model_dump() | fields)


def _generate(
    loaded: tuple[nn.Module, TokenizerWrapper], constraint: Constraint, question: str
) -> str:
    """Greedy decoding under `constraint`, until EOS; fails past MAX_NEW_TOKENS."""
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(prompt, str)
    matcher = compile_constraint(tokenizer, constraint).matcher()
    tokens: list[int] = []
    for token, _ in generate_step(
        mx.array(tokenizer.encode(prompt, add_special_tokens=False)),
        model,
        max_tokens=MAX_NEW_TOKENS,
        logits_processors=[matcher],
    ):
        if token in tokenizer.eos_token_ids:
            assert matcher.is_finished()
            return tokenizer.decode(tokens)
        tokens.append(token)
    pytest.fail(f"no EOS within {MAX_NEW_TOKENS} tokens: {tokenizer.decode(tokens)!r}")


def test_generated_json_validates_against_the_schema(
    loaded: tuple[nn.Module, TokenizerWrapper],
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["city", "temperature", "unit"],
        "additionalProperties": False,
    }
    text = _generate(loaded, JsonSchema(json_schema=schema), "What is the weather in Paris?")
    jsonschema.validate(json.loads(text), schema)


def test_generated_json_object_is_an_object(loaded: tuple[nn.Module, TokenizerWrapper]) -> None:
    text = _generate(loaded, JsonObject(), "Describe a cat as a JSON object with its name and age.")
    assert isinstance(json.loads(text), dict)


def test_a_named_tool_call_is_the_markers_around_a_valid_call(
    loaded: tuple[nn.Module, TokenizerWrapper],
) -> None:
    constraint = HERMES.model_copy(update={"named": "get_weather"})
    text = _generate(loaded, constraint, "What is the weather in Paris?")
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert list(call) == ["name", "arguments"] and call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER_ARGUMENTS)


STRICT_WEATHER = ToolFunction(
    name="get_weather",
    description="The current weather in a city",
    parameters=WEATHER_ARGUMENTS,
    strict=True,
)
ASK_WEATHER = (ChatTurn(role="user", content="What is the weather in Paris?"),)


def test_a_strict_tool_under_auto_is_constrained_to_text_or_a_valid_call(
    loaded: tuple[nn.Module, TokenizerWrapper], smollm_dir: Path
) -> None:
    model, tokenizer = loaded
    chat_tokenizer = load_chat_tokenizer(smollm_dir)
    request = ChatRequest(model="m", turns=ASK_WEATHER, tools=(STRICT_WEATHER,))
    fmt = tool_call_format(chat_tokenizer)
    assert fmt.family == ToolCallFamily.FALLBACK  # SmolLM2's template has no tools
    constraint = constraint_for(request, fmt)
    assert isinstance(constraint, ToolCalls) and constraint.text_allowed
    check_constraint(constraint)
    matcher = compile_constraint(tokenizer, constraint).matcher()
    tokens: list[int] = []
    for token, _ in generate_step(
        mx.array(render_prompt(chat_tokenizer, request).tokens),
        model,
        max_tokens=60,
        logits_processors=[matcher],
    ):
        if token in tokenizer.eos_token_ids:
            break
        tokens.append(token)
    reply = parse_tool_calls(fmt, tokenizer.decode(tokens))
    # Text, or calls whose arguments validate; never a call returned as text.
    assert "<tool_call>" not in reply.content
    for call in reply.tool_calls:
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER_ARGUMENTS)


def test_a_tool_that_is_not_strict_leaves_auto_unconstrained() -> None:
    tool = STRICT_WEATHER.model_copy(update={"strict": False})
    request = ChatRequest(model="m", turns=ASK_WEATHER, tools=(tool,))
    assert constraint_for(request, MISTRAL_FORMAT) is None


def test_a_strict_tool_in_a_syntax_exo_cannot_constrain_is_a_400() -> None:
    request = ChatRequest(model="m", turns=ASK_WEATHER, tools=(STRICT_WEATHER,))
    with pytest.raises(APIError) as caught:
        constraint_for(request, MISTRAL_FORMAT)
    assert caught.value.status == 400 and caught.value.param == "tools"
    assert "tools[0] asks for strict arguments" in caught.value.message
