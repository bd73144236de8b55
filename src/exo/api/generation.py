"""The generation service below the API adapters: a `ChatRequest` in, one
reply as a stream of `ReplyEvent`s out.

Everything the three APIs share is decided here once: volatile text removed,
the prompt rendered (tools through the template or exo's fallback), the
context checked and `max_tokens` clamped to it, the model's sampling defaults
filled in, the constraint built (structured output, forced tool calls, strict
tools) and checked, the runner's text read through the reasoning split and the
tool-call parser, and the reasoning's tokens counted. 4xx errors are raised
before anything runs; what costs work (tokenizing, compiling a grammar) waits
for a slot of the model, so the queue's bound bounds it, and runs off the
event loop.
"""

import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
from jinja2 import TemplateError
from loguru import logger

from exo.api.admission import Slot, admit
from exo.api.canonical import canonical_request
from exo.api.chat_prompt import ChatPrompt, chat_template_text, render_prompt, tool_call_format
from exo.api.errors import APIError, internal_error, invalid
from exo.api.images import decode_image, request_images
from exo.api.images import fetch_images as fetch_request_images
from exo.api.metrics import GenerationObserver, observe_generation, observe_retry
from exo.api.reply_retry import MAX_ATTEMPTS, ReplyRetry, lost_unanswered, no_retry
from exo.api.reply_stream import (
    KeepAlive,
    PreparedReply,
    ReplyEvent,
    ReplyFinished,
    ReplyFinishReason,
    TokenLogprob,
    TokenLogprobs,
    TopLogprob,
)
from exo.api.schema_instances import has_finite_instance
from exo.engine.constraint_grammar import ConstraintError, check_constraint
from exo.engine.reasoning import ReasoningPiece, ThinkingMarkers, detect_thinking_markers
from exo.engine.reply import ReplyParser
from exo.engine.tool_calls.formats import ToolCallFormat
from exo.engine.tool_calls.parser import ToolCallEnd
from exo.models.chat_tokenizer import ChatTokenizer
from exo.models.vision import ImagePrompts, Picture
from exo.shared.prompt_images import is_image_key
from exo.shared.types.chat import (
    ChatRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    TextPrompt,
    TokenPrompt,
    ToolFunction,
)
from exo.shared.types.constraints import Constraint, JsonObject, JsonSchema, ToolCalls, ToolSpec
from exo.shared.types.ids import new_task_id
from exo.shared.types.tasks import REPETITION_CONTEXT_SIZE, GenerationParams, SampledLogprobs
from exo.worker.runner.protocol import (
    Generate,
    MemoryRefusal,
    TaskFailed,
    TaskFinished,
    TaskMessage,
    TaskText,
)
from exo.worker.runner.supervisor import RunnerUnavailable
from exo.worker.served_model import ServedModel


def runner_unavailable(reason: str) -> APIError:
    return APIError(
        503, f"the model runner is unavailable: {reason}", "server_error", "runner_unavailable"
    )


def memory_refused(message: str, refusal: MemoryRefusal) -> APIError:
    """The runner's memory admission refused the request: a 400 when it could
    never fit (the message names the largest max_tokens that does), else a 503
    to retry after running requests finish."""
    if refusal.never_fits:
        return invalid(message, "max_tokens", "insufficient_memory")
    retry = {"Retry-After": str(refusal.retry_after_seconds)}
    return APIError(503, message, "server_error", "insufficient_memory", headers=retry)


def generation_failed(reason: str) -> APIError:
    return internal_error(f"generation failed: {reason}", "generation_failed")


class PromptModel(Protocol):
    """What rendering a request's prompt needs of a model: a served one, or a
    routing one (`routing_tokenizers`: a model whose replicas are elsewhere)."""

    @property
    def tokenizer(self) -> ChatTokenizer: ...
    @property
    def context_length(self) -> int: ...
    @property
    def max_token_bytes(self) -> int: ...
    @property
    def images(self) -> ImagePrompts | str: ...

    last_prompt: tuple[ChatRequest, Any] | None


async def render(model: PromptModel, request: ChatRequest, *, fetch_images: bool) -> ChatPrompt:
    """The request's prompt tokens (volatile text removed first), or a 400.
    Its images are fetched (`fetch_images`: from http(s) addresses too) and
    decoded first; a model that takes none answers 400 naming it. The last
    prompt is kept: routing among replicas renders a request before it is
    answered, which renders it again (a 50k-token prompt is ~0.1 s of work)."""
    last = model.last_prompt
    if last is not None and last[0] == request:
        return last[1]
    prompt = await _render(model, request, fetch_images=fetch_images)
    model.last_prompt = (request, prompt)
    return prompt


async def _render(model: PromptModel, request: ChatRequest, *, fetch_images: bool) -> ChatPrompt:
    pictures: list[Picture] = []
    if request_images(request):
        if isinstance(model.images, str):
            raise invalid(model.images, "messages", "model_without_vision")
        request = await fetch_request_images(request, fetch_images)
        for image in request_images(request):
            decoded = await anyio.to_thread.run_sync(decode_image, image.data)
            pictures.append(Picture(decoded.image, decoded.digest, image.data))
    vision = model.images if isinstance(model.images, ImagePrompts) else None
    try:
        return await anyio.to_thread.run_sync(
            render_prompt, model.tokenizer, canonical_request(request), pictures, vision
        )
    except TemplateError as error:
        raise invalid(
            f"the model's chat template rejected the messages: {error}",
            "messages",
            "invalid_messages",
        ) from error
    except ValueError as error:  # the processor could not place the images
        raise invalid(
            f"the model's processor rejected the images: {error}", "messages", "invalid_messages"
        ) from error


def _tools_offered(request: ChatRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def constraint_for(request: ChatRequest, fmt: ToolCallFormat) -> Constraint | None:
    """What the reply must look like, enforced token by token in the runner."""
    forced = request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)
    structured = isinstance(request.response_format, JsonObjectFormat | JsonSchemaFormat)
    if _tools_offered(request) and structured:
        raise invalid(
            "response_format and tools cannot be combined (the reply is either a tool "
            "call or the structured answer); send tool_choice 'none' or no response_format",
            "response_format",
        )
    match request.response_format:
        case JsonObjectFormat():
            return JsonObject()
        case JsonSchemaFormat(json_schema=schema, strict=strict):
            return JsonSchema(json_schema=schema, strict=strict)
        case _:
            pass
    strict = [i for i, tool in enumerate(request.tools) if tool.strict]
    if not _tools_offered(request) or not (forced or strict):
        return None
    if fmt.args_marker is not None or fmt.id_key is not None:
        if forced:
            raise invalid(
                f"this model's tool-call syntax ({fmt.family}) cannot be forced; "
                "use tool_choice 'auto'",
                "tool_choice",
            )
        raise invalid(
            f"tools[{strict[0]}] asks for strict arguments, which this model's tool-call "
            f"syntax ({fmt.family}) cannot enforce; send strict false",
            "tools",
        )
    named = request.tool_choice.name if isinstance(request.tool_choice, NamedToolChoice) else None
    return ToolCalls(
        tools=tuple(_tool_spec(tool, forced) for tool in request.tools),
        prefix=fmt.prefix,
        suffix=fmt.suffix,
        arguments_key=fmt.arguments_key,
        list_form=fmt.list_form,
        named=named,
        parallel=request.parallel_tool_calls and named is None,
        # tool_choice auto: text, or calls whose strict tools' arguments are checked
        text_allowed=not forced,
        markers=fmt.markers,
        bare_json_start=fmt.bare_json_start,
    )


def _tool_spec(tool: ToolFunction, forced: bool) -> ToolSpec:
    # Under auto, a tool not asked to be strict keeps what the parser accepts
    # without a grammar: any arguments object.
    parameters = tool.parameters if forced or tool.strict else {"type": "object"}
    return ToolSpec(name=tool.name, parameters=parameters, strict=tool.strict)


def _context_exceeded(model: PromptModel, why: str) -> APIError:
    return invalid(
        f"This model's maximum context length is {model.context_length} tokens. {why}",
        "messages",
        "context_length_exceeded",
    )


def check_prompt_size(model: PromptModel, request: ChatRequest) -> None:
    """A 400 for a prompt that its size alone shows is longer than the context,
    before anything is tokenized: no token spans more than `max_token_bytes`
    bytes of text, and a template shows every message but the assistant's whole
    (those it may shorten), so their text needs at least bytes / that many tokens."""
    match request.prompt:
        case TokenPrompt():
            return  # counted exactly, without tokenizing (`generation_params`)
        case TextPrompt(text=text):
            size = len(text.encode())
        case None:
            texts = (turn.content for turn in request.turns if turn.role != "assistant")
            size = sum(len(text.strip().encode()) for text in texts)
    least = math.ceil(size / model.max_token_bytes)
    if least >= model.context_length:
        raise _context_exceeded(
            model,
            f"Your prompt holds {size} bytes of text: at least {least} tokens "
            f"(no token of this model is longer than {model.max_token_bytes} bytes).",
        )


def text_tokens(prompt: ChatPrompt) -> list[int]:
    """The prompt's tokens but its images' (whose keys are no vocabulary's)."""
    if not prompt.images:
        return prompt.tokens
    return [token for token in prompt.tokens if not is_image_key(token)]


def check_vocabulary(tokens: Iterable[int], vocabulary: int, param: str) -> None:
    """A 400 for a token id outside the model's vocabulary (the runner would
    index past its embedding table)."""
    for token in tokens:
        if not 0 <= token < vocabulary:
            raise invalid(
                f"{param}: token id {token} is not in the vocabulary (0..{vocabulary - 1})", param
            )


def prediction_tokens(model: ServedModel, text: str) -> tuple[int, ...]:
    """A predicted output's tokens (speculative decoding drafts from them), or a
    400 when it is longer than the context: by its size alone before tokenizing
    (as `check_prompt_size`), else by its tokens."""
    if math.ceil(len(text.encode()) / model.max_token_bytes) <= model.context_length:
        tokens = tuple(model.tokenizer.encode(text, add_special_tokens=False))
        if len(tokens) <= model.context_length:
            check_vocabulary(tokens, model.vocabulary_size, "prediction")
            return tokens
    raise invalid(
        f"prediction: longer than this model's context length ({model.context_length} tokens)",
        "prediction",
    )


def generation_params(
    model: ServedModel, request: ChatRequest, prompt_tokens: int, constraint: Constraint | None
) -> GenerationParams:
    """The runner's params for `request` (or a 4xx); tokenizes its prediction,
    so it runs off the event loop."""
    room = model.context_length - prompt_tokens
    if room <= 0:
        raise _context_exceeded(model, f"Your messages resulted in {prompt_tokens} tokens.")
    sampling, defaults = request.sampling, model.sampling_defaults
    check_vocabulary(sampling.logit_bias, model.vocabulary_size, "logit_bias")
    prediction = prediction_tokens(model, request.prediction) if request.prediction else ()

    return GenerationParams(
        # Asked for more than the context leaves (agents ask for 32k-128k): clamped.
        max_tokens=min(request.max_tokens or room, room),
        temperature=defaults.temperature if sampling.temperature is None else sampling.temperature,
        top_p=defaults.top_p if sampling.top_p is None else sampling.top_p,
        top_k=defaults.top_k if sampling.top_k is None else sampling.top_k,
        min_p=defaults.min_p if sampling.min_p is None else sampling.min_p,
        repetition_penalty=defaults.repetition_penalty
        if sampling.repetition_penalty is None
        else sampling.repetition_penalty,
        repetition_context_size=sampling.repetition_context_size or REPETITION_CONTEXT_SIZE,
        presence_penalty=sampling.presence_penalty or 0.0,
        frequency_penalty=sampling.frequency_penalty or 0.0,
        logit_bias=sampling.logit_bias,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        seed=sampling.seed,
        stop=request.stop,
        constraint=constraint,
        speculation=request.speculation,
        prediction=prediction,
    )


def _token_logprobs(tokenizer: ChatTokenizer, sampled: SampledLogprobs) -> TokenLogprobs:
    def piece(token: int) -> tuple[str, tuple[int, ...]]:
        text = tokenizer.decode([token])
        return text, tuple(text.encode())

    tokens = []
    for entry in sampled.tokens:
        text, data = piece(entry.token)
        top = tuple(
            TopLogprob(token=t, logprob=alt.logprob, bytes=b)
            for alt in entry.top_logprobs
            for t, b in [piece(alt.token)]
        )
        tokens.append(TokenLogprob(token=text, logprob=entry.logprob, bytes=data, top_logprobs=top))
    return TokenLogprobs(tokens=tuple(tokens))


def reasoning_tokens(
    tokenizer: ChatTokenizer,
    thinking: ThinkingMarkers | None,
    output: str,
    completion_tokens: int,
) -> int:
    """Of a reply's `completion_tokens`, those it spent thinking: its raw
    `output` up to the end marker (all of it when the thinking was cut off),
    re-tokenized, since the runner sends text. 0 when it did not think."""
    if thinking is None:
        return 0
    end = output.find(thinking.end)
    thought = output if end < 0 else output[: end + len(thinking.end)]
    return min(len(tokenizer.encode(thought, add_special_tokens=False)), completion_tokens)


@dataclass(frozen=True)
class _Run:
    model: ServedModel
    task: Generate
    new_parser: Callable[[], ReplyParser]  # one per attempt: it keeps the text it read
    keepalive_seconds: float
    slot: Slot  # held until the reply ends, however it ends
    observer: GenerationObserver | None
    thinking: ThinkingMarkers | None  # the model's markers, for a chat reply
    retry: ReplyRetry
    # Streamed: each event goes to the client as it comes; else the reply is
    # sent whole, and its events are held until it finished.
    streamed: bool
    # Set once the runner took the task (past its memory admission).
    started: anyio.Event = field(default_factory=anyio.Event)

    async def events(self) -> AsyncGenerator[ReplyEvent]:
        ended: ReplyFinishReason | Literal["error", "cancelled"] = "cancelled"
        try:
            async with aclosing(self._events()) as events:  # its runner task ends here
                async for event in events:
                    if isinstance(event, ReplyFinished):
                        ended = event.finish_reason
                        self.slot.prefilled(event.usage.prompt_tokens - event.usage.cached_tokens)
                        if self.observer is not None:
                            self.observer.finished(ended, event.usage)
                    yield event
        except APIError:
            ended = "error"
            raise
        finally:
            self.slot.release()
            if self.observer is not None and (ended == "error" or ended == "cancelled"):
                self.observer.ended_early(ended)

    async def _events(self) -> AsyncGenerator[ReplyEvent]:
        """The reply, run again (`reply_retry`) when its runner is lost before
        any of it reached the client: before its first event for a stream,
        before it finished for a reply sent whole."""
        model, task = self.model, self.task
        for attempt in range(1, MAX_ATTEMPTS + 1):
            delivered = False
            held: list[ReplyEvent] = []
            try:
                async with aclosing(self._attempt(model, task, self.new_parser())) as events:
                    async for event in events:
                        if isinstance(event, KeepAlive):
                            yield event
                        elif self.streamed:
                            delivered = True
                            yield event
                        else:
                            held.append(event)
                for event in held:
                    yield event
                return
            except _RunnerLost as lost:
                if delivered:
                    raise runner_unavailable(str(lost)) from lost
                back = None
                if attempt < MAX_ATTEMPTS:
                    back = await self.retry.runner_back(model.model_id)
                elsewhere = self.retry.continue_elsewhere
                if back is None and self.streamed and self.started.is_set() and elsewhere:
                    # Its answer has begun: another node's events go into it.
                    observe_retry(model.model_id, "rerouted")
                    lost_instance = model.runner.instance.instance_id
                    async for event in elsewhere(lost_instance, task.tokens):
                        text = not isinstance(event, KeepAlive | TokenLogprobs | ReplyFinished)
                        if self.observer is not None and text:
                            self.observer.chunk()
                        yield event
                    return
                if back is None:
                    tried = f"tried {attempt} times" if attempt > 1 else "not retried"
                    raise lost_unanswered(
                        f"{lost}; nothing of the reply had been sent ({tried})"
                    ) from lost
                logger.warning(
                    f"a {model.model_id} request lost its runner before any of its reply "
                    f"was sent ({lost}); running it again"
                )
                observe_retry(model.model_id)
                model, task = back, task.model_copy(update={"task_id": new_task_id()})
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _attempt(
        self, model: ServedModel, task: Generate, parser: ReplyParser
    ) -> AsyncGenerator[ReplyEvent]:
        """One run of the task on `model`'s runner; `_RunnerLost` when the
        runner is lost."""
        calls: list[ToolCallEnd] = []
        output: list[str] = []  # the raw text, for the reasoning's token count
        reasoned = False
        try:
            async with model.runner.generate(task) as messages:
                while True:
                    message: TaskMessage | None = None
                    with anyio.move_on_after(self.keepalive_seconds):
                        try:
                            message = await messages.receive()
                        except anyio.EndOfStream:
                            break
                    match message:
                        case None:
                            yield KeepAlive()
                        case TaskText(text=text, logprobs=logprobs):
                            self.started.set()
                            self.slot.first_token()
                            if self.observer is not None:
                                self.observer.chunk()
                            output.append(text)
                            for event in parser.feed(text):
                                calls += [event] if isinstance(event, ToolCallEnd) else []
                                reasoned = reasoned or isinstance(event, ReasoningPiece)
                                yield event
                            if logprobs is not None:
                                yield _token_logprobs(model.tokenizer, logprobs)
                        case TaskFinished():
                            for event in parser.finish():
                                calls += [event] if isinstance(event, ToolCallEnd) else []
                                reasoned = reasoned or isinstance(event, ReasoningPiece)
                                yield event
                            reason: ReplyFinishReason = message.finish_reason
                            if message.stop_sequence is not None:
                                reason = "stop_sequence"
                            if calls and reason != "length":
                                reason = "tool_calls"
                            thought = await anyio.to_thread.run_sync(
                                reasoning_tokens,
                                model.tokenizer,
                                self.thinking if reasoned else None,
                                "".join(output),
                                message.usage.completion_tokens,
                            )
                            yield ReplyFinished(
                                finish_reason=reason,
                                stop_sequence=message.stop_sequence,
                                usage=message.usage,
                                tool_calls=tuple(end.call for end in calls),
                                reasoning_tokens=thought,
                            )
                            return
                        case TaskFailed(error=error, memory=MemoryRefusal() as refusal):
                            raise memory_refused(error, refusal)
                        case TaskFailed(error=error, runner_lost=True):
                            raise _RunnerLost(error)
                        case TaskFailed(error=error):
                            raise generation_failed(error)
                        case _:  # prefill progress: the runner took the task
                            if not self.started.is_set():
                                self.started.set()
                                yield KeepAlive()  # a stream's answer may begin
        except RunnerUnavailable as error:
            raise _RunnerLost(str(error)) from error
        raise generation_failed("the runner ended the task without a result")


class _RunnerLost(Exception):
    """The runner was lost during an attempt: the reply may run again."""


def _check_constraint(constraint: Constraint) -> None:
    """A 400 for a constraint no reply can satisfy: its grammar does not compile,
    or a schema in it has no finite instance (the reply would end empty)."""
    param = "response_format" if isinstance(constraint, JsonObject | JsonSchema) else "tools"
    match constraint:
        case JsonSchema(json_schema=schema) if not has_finite_instance(schema):
            raise invalid("json_schema: no finite JSON value matches the schema", param)
        case ToolCalls(tools=tools):
            for tool in tools:
                if not has_finite_instance(tool.parameters):
                    raise invalid(
                        f"parameters of tool {tool.name!r}: no finite JSON value matches them",
                        param,
                    )
        case _:
            pass
    try:
        check_constraint(constraint)
    except ConstraintError as error:
        raise invalid(str(error), param) from error


async def _admitted(
    model: ServedModel, request: ChatRequest, retry: ReplyRetry
) -> tuple[ServedModel, Slot]:
    """A slot of `model` for `request` (429 at once when its queue is full),
    then the prompt's size checked: before any work (tokenizing, compiling a
    grammar), which the queue's bound thus bounds. A failed runner is waited
    for while it restarts, within the retry's bound."""
    if model.runner.status == "failed":
        back = await retry.runner_back(model.model_id)
        if back is None:
            raise lost_unanswered(f"{model.runner.error}; it is restarting")
        model = back
    slot = await admit(model.model_id)
    try:
        check_prompt_size(model, request)
    except APIError:
        slot.release()
        raise
    return model, slot


async def count_prompt_tokens(
    model: ServedModel, request: ChatRequest, *, fetch_images: bool
) -> int:
    """The length of `request`'s prompt, under a generation's limits: it holds
    a slot of the model (429/503 as a generation would get) while its size is
    checked and it is tokenized."""
    model, slot = await _admitted(model, request, no_retry())
    try:
        return len((await render(model, request, fetch_images=fetch_images)).tokens)
    finally:
        slot.release()


async def prepare_reply(
    model: ServedModel,
    request: ChatRequest,
    keepalive_seconds: float,
    new_call_id: Callable[[], str] | None = None,
    retry: ReplyRetry | None = None,
    *,
    fetch_images: bool,
) -> PreparedReply:
    """Check `request` for `model` (4xx as `APIError`) and take a slot of the
    model (429 when its queue is full, 503 when the wait is too long) before
    rendering the prompt or compiling a grammar; the reply runs when its
    `events` are read (a routed stream's first token is awaited here, so its
    answer begins with it: `reply_retry`)."""
    observer = observe_generation(model.model_id)
    fmt = tool_call_format(model.tokenizer)
    constraint = constraint_for(request, fmt)
    retry = retry or no_retry()
    model, slot = await _admitted(model, request, retry)
    try:
        prompt = await render(model, request, fetch_images=fetch_images)
        if not prompt.tokens:  # e.g. a text prompt of characters the tokenizer drops
            raise invalid("the prompt has no tokens", "prompt" if request.prompt else "messages")
        check_vocabulary(text_tokens(prompt), model.vocabulary_size, "prompt")
        params = await anyio.to_thread.run_sync(
            generation_params, model, request, len(prompt.tokens), constraint
        )
        if constraint is not None:
            await anyio.to_thread.run_sync(_check_constraint, constraint)
    except BaseException:
        slot.release()
        raise
    task = Generate(
        task_id=new_task_id(),
        tokens=prompt.tokens,
        params=params,
        system_prompt_length=prompt.system_prompt_length,
        images=list(prompt.images),
    )
    tail = model.tokenizer.decode(text_tokens(prompt)[-16:]) if request.prompt is None else ""
    template = chat_template_text(model.tokenizer) if request.prompt is None else None
    tools_format = fmt if _tools_offered(request) else None

    def new_parser() -> ReplyParser:
        return ReplyParser.for_prompt(template, tail, tools_format, new_call_id)

    thinking = detect_thinking_markers(template)
    run = _Run(
        model,
        task,
        new_parser,
        keepalive_seconds,
        slot,
        observer,
        thinking,
        retry,
        streamed=request.stream,
    )
    events = run.events()
    if retry.routed and not retry.reads_events and request.stream:
        events = await held_until(events)
    elif request.stream:
        # The answer begins once the runner took the task: a request refused
        # by its memory admission gets its 4xx/503 as a status.
        events = await held_until(events, run.started.is_set)
    return PreparedReply(
        reply_id=uuid.uuid4().hex,
        model=model.model_id,
        prompt_tokens=len(prompt.tokens),
        created=int(time.time()),
        events=events,
    )


async def held_until(
    events: AsyncGenerator[ReplyEvent], ready: Callable[[], bool] = lambda: False
) -> AsyncGenerator[ReplyEvent]:
    """`events` once their first token came, or `ready()` held after a keep-alive
    (keep-alives before either dropped): a failure before it is raised here,
    while the answer has not begun."""
    first = await anext(events, None)
    while isinstance(first, KeepAlive) and not ready():
        first = await anext(events, None)

    async def chained() -> AsyncGenerator[ReplyEvent]:
        try:
            if first is not None:
                yield first
                async for event in events:
                    yield event
        finally:
            await events.aclose()

    return chained()
