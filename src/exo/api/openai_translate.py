"""OpenAI chat completions and legacy completions requests -> the internal
`ChatRequest`. Validation happened on the request types (a 400 naming the
field); translating a valid request cannot fail."""

from collections.abc import Sequence

from exo.api.openai_types import (
    AssistantMessageParam,
    ChatCompletionRequest,
    ChatMessage,
    CommonRequestFields,
    CompletionRequest,
    JsonObjectResponseFormat,
    JsonSchemaResponseFormat,
    NamedToolChoiceParam,
    ResponseFormatParam,
    SystemMessageParam,
    ToolChoiceParam,
    ToolMessageParam,
    ToolParam,
    UserMessageParam,
    parts_text,
    user_content,
)
from exo.shared.types.chat import (
    ChatRequest,
    ChatTurn,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Sampling,
    TextFormat,
    TextPrompt,
    TokenPrompt,
    ToolCall,
    ToolChoice,
    ToolFunction,
)
from exo.shared.types.ids import ModelId


def to_turns(messages: Sequence[ChatMessage]) -> tuple[ChatTurn, ...]:
    """The conversation as the chat template sees it: `developer` is a system
    turn, text parts are joined (a user message's images at their place among
    them), a tool result carries the name of its call."""
    call_names: dict[str, str] = {}
    turns: list[ChatTurn] = []
    for message in messages:
        match message:
            case SystemMessageParam():
                turns.append(ChatTurn(role="system", content=parts_text(message.content)))
            case UserMessageParam():
                text, images = user_content(message.content)
                turns.append(ChatTurn(role="user", content=text, images=images))
            case AssistantMessageParam():
                calls = tuple(
                    ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
                    for call in message.tool_calls or ()
                )
                call_names.update((call.id, call.name) for call in calls)
                turns.append(
                    ChatTurn(
                        role="assistant",
                        content=message.text(),
                        tool_calls=calls,
                        reasoning=message.reasoning_text(),
                    )
                )
            case ToolMessageParam():
                turns.append(
                    ChatTurn(
                        role="tool",
                        content=parts_text(message.content),
                        tool_call_id=message.tool_call_id,
                        name=call_names.get(message.tool_call_id, message.name),
                    )
                )
    return tuple(turns)


def _tool(tool: ToolParam) -> ToolFunction:
    function = tool.function
    return ToolFunction(
        name=function.name,
        description=function.description or "",
        strict=bool(function.strict),
        **({} if function.parameters is None else {"parameters": function.parameters}),
    )


def _tool_choice(choice: ToolChoiceParam | None) -> ToolChoice:
    if isinstance(choice, NamedToolChoiceParam):
        return NamedToolChoice(name=choice.function.name)
    return choice or "auto"


def _response_format(format_: ResponseFormatParam | None) -> ResponseFormat:
    match format_:
        case JsonObjectResponseFormat():
            return JsonObjectFormat()
        case JsonSchemaResponseFormat(json_schema=spec):
            # No schema: any JSON value, as OpenAI reads it.
            return JsonSchemaFormat(
                name=spec.name, json_schema=spec.schema_ or {}, strict=bool(spec.strict)
            )
        case _:
            return TextFormat()


def _sampling(body: CommonRequestFields) -> Sampling:
    return Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=None if body.top_k is None else max(body.top_k, 0),  # -1: all tokens, as 0
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
        seed=body.seed,
    )


def to_chat_request(body: ChatCompletionRequest) -> ChatRequest:
    return ChatRequest(
        model=ModelId(body.model),
        turns=to_turns(body.messages),
        tools=tuple(_tool(tool) for tool in body.tools or ()),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=_response_format(body.response_format),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stop=body.stop_sequences(),
        sampling=_sampling(body),
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        template_kwargs=body.chat_template_kwargs or {},
        reasoning_effort=body.reasoning_effort,
        stream=bool(body.stream),
        include_usage=body.include_usage(),
        speculation=body.speculation is not False,
        prediction=body.prediction.text() if body.prediction is not None else None,
        continue_final_message=bool(body.continue_final_message),
    )


def completion_to_chat_request(body: CompletionRequest) -> ChatRequest:
    """A legacy completion: the prompt is used as is, without a chat template."""
    prompt = (
        TextPrompt(text=body.prompt)
        if isinstance(body.prompt, str)
        else TokenPrompt(tokens=tuple(body.prompt))
    )
    return ChatRequest(
        model=ModelId(body.model),
        prompt=prompt,
        max_tokens=body.max_tokens,
        stop=body.stop_sequences(),
        sampling=_sampling(body),
        # Legacy `logprobs: N` asks for the sampled token's logprob and N alternatives.
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        stream=bool(body.stream),
        include_usage=body.include_usage(),
        speculation=body.speculation is not False,
    )
