"""End to end: schemathesis fuzzes every route of a real node from the app's own
OpenAPI schema, and sends valid inputs made hostile (strings with lone
surrogates, objects nested hundreds deep). No input may get a 5xx or hang,
errors come in the route's API format, and the node still answers a chat
afterwards."""

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err
from schemathesis.schemas import BaseSchema

from exo.models.builtin import DEFAULT_MODEL_ID
from tests.e2e.node_process import NodeProcess, running_node
from tests.hub_server import FakeHub

pytestmark = pytest.mark.slow

# Longest silence on one request: the node's SSE keep-alives come less often,
# so a stream stuck mid-way fails the test rather than holding it.
REQUEST_TIMEOUT_SECONDS = 60.0
KEEPALIVE_SECONDS = "120"
GENERATION_ROUTES = r"^/(v1/(chat/completions|completions|messages|responses)|api/(chat|generate))$"
# The dashboard's files are not API; these streams last as long as their client.
UNFUZZED_ROUTES = ["/", "/events", "/instance/await"]
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_TOKENS = 4  # a generation costs little on a CI machine's CPU
FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure shows its input as is
    # Requests to a real node are slow, and many generated inputs are filtered out.
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[NodeProcess]:
    # Models the fuzzer names are looked up on a hub that has none (a 400, where
    # an unreachable hub would rightly be a 503).
    with FakeHub({}) as hub, pytest.MonkeyPatch.context() as env:
        env.setitem(os.environ, "HF_ENDPOINT", hub.url)
        with running_node(
            tmp_path_factory.mktemp("node"),
            models_dir,
            "--sse-keepalive-seconds",
            KEEPALIVE_SECONDS,
        ) as started:
            yield started


@pytest.fixture(scope="module")
def api_schema(node: NodeProcess) -> BaseSchema:
    loaded = schemathesis.openapi.from_url(f"{node.base_url}/openapi.json", timeout=10)
    return loaded.exclude(path=UNFUZZED_ROUTES).exclude(path_regex="^/dashboard/")


def _cheap(body: dict[str, Any], path: str) -> None:
    """Aim the request at the served model and keep its generation short."""
    if "model" in body:
        body["model"] = str(DEFAULT_MODEL_ID)  # a plain str: the schema validator takes no subclass
    if path.startswith("/api/"):  # Ollama's: the limit is an option (<= 0: none)
        options = body.get("options")
        if path in ("/api/chat", "/api/generate") and isinstance(options, dict | None):
            body["options"] = {**(options or {}), "num_predict": MAX_TOKENS}
        return
    limits = [key for key in TOKEN_LIMITS if key in body]
    for key in limits:
        # null asks for the default: as many tokens as the context leaves
        if body[key] is None or (isinstance(body[key], int) and body[key] > MAX_TOKENS):
            body[key] = MAX_TOKENS
    if not limits:
        body["max_output_tokens" if path.startswith("/v1/responses") else "max_tokens"] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > 1:
        body["n"] = 1


# Deeper than a request may nest, deep enough that rendering it once failed;
# shallow enough for the client's own JSON encoder.
DEEP_LEVELS = 500


def _lone_surrogates(value: Any) -> Any:
    """`value` with a lone surrogate ending each of its strings."""
    if isinstance(value, str):
        return value + "\ud800"
    if isinstance(value, dict):
        return {key: _lone_surrogates(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_lone_surrogates(item) for item in value]
    return value


def _nested_deep(value: Any) -> Any:
    """`value` with each object or array of its top level nested `DEEP_LEVELS` deep."""
    if not isinstance(value, dict):
        return value
    deep = dict(value)
    for key, item in value.items():
        if isinstance(item, dict | list):
            for _ in range(DEEP_LEVELS):
                item = {"a": item}
            deep[key] = item
    return deep


def _assert_api_error(path: str, status: int, content_type: str, body: Callable[[], Any]) -> None:
    """A JSON error comes in the route's API format."""
    if status >= 400 and "json" in content_type:
        error = body()
        if path.startswith("/api/"):
            assert isinstance(error["error"], str) and error["error"], error
        elif path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"], error
        else:
            assert error["error"]["message"], error


def _call(case: Case, node: NodeProcess) -> int:
    """The status `case` is answered with (never a 5xx)."""
    if isinstance(case.body, dict):
        _cheap(case.body, case.path)
    response = case.call_and_validate(
        base_url=node.base_url, checks=[not_a_server_error], timeout=REQUEST_TIMEOUT_SECONDS
    )
    content_type = ", ".join(response.headers.get("content-type", []))
    _assert_api_error(case.path, response.status_code, content_type, response.json)
    return response.status_code


def _call_hostile(case: Case, mutation: Callable[[Any], Any], node: NodeProcess) -> int:
    """The status a valid `case`, made hostile by `mutation`, is answered with
    (never a 5xx). Sent as JSON text: schemathesis checks a case it did not
    make against the schema first, and its validator cannot read a lone
    surrogate."""
    body = case.body
    if isinstance(body, dict):
        _cheap(body, case.path)
    sent = json.dumps(mutation(body)).encode() if isinstance(body, dict | list) else None
    response = httpx.request(
        case.method,
        f"{node.base_url}{case.formatted_path}",
        params=case.query,
        content=sent,
        headers={"content-type": "application/json"} if sent is not None else None,
        timeout=REQUEST_TIMEOUT_SECONDS,
    )
    assert response.status_code < 500, (case.method, case.path, response.text)
    content_type = response.headers.get("content-type", "")
    _assert_api_error(case.path, response.status_code, content_type, response.json)
    return response.status_code


def _fuzz_operation(operation: APIOperation, node: NodeProcess, max_examples: int) -> Counter[int]:
    """Valid, invalid and hostile inputs to `operation`; the statuses they were
    answered with."""
    statuses: Counter[int] = Counter()
    valid = operation.as_strategy(GenerationMode.POSITIVE)
    invalid = operation.as_strategy(GenerationMode.NEGATIVE)
    hostile = st.tuples(valid, st.sampled_from([_lone_surrogates, _nested_deep]))

    @given(case=st.one_of(valid, invalid), made_hostile=hostile)
    @settings(FUZZ_SETTINGS, max_examples=max_examples)
    def fuzz(case: Case, made_hostile: tuple[Case, Callable[[Any], Any]]) -> None:
        statuses[_call(case, node)] += 1
        statuses[_call_hostile(*made_hostile, node)] += 1

    fuzz()
    return statuses


def _fuzz(operations: BaseSchema, node: NodeProcess, max_examples: int) -> dict[str, Counter[int]]:
    """Every operation fuzzed; the statuses each answered."""
    answered: dict[str, Counter[int]] = {}
    for result in operations.get_all_operations():
        if isinstance(result, Err):
            pytest.fail(
                f"the API's schema has an operation schemathesis cannot use: {result.err()}"
            )
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        answered[name] = _fuzz_operation(operation, node, max_examples)
    return answered


def test_generation_routes_take_any_input(api_schema: BaseSchema, node: NodeProcess) -> None:
    answered = _fuzz(api_schema.include(path_regex=GENERATION_ROUTES), node, max_examples=10)
    assert len(answered) == 6, answered
    # Some inputs got through validation to a generation on the model.
    assert sum(statuses[200] for statuses in answered.values()) > 0, answered


def test_the_other_routes_take_any_input(api_schema: BaseSchema, node: NodeProcess) -> None:
    answered = _fuzz(api_schema.exclude(path_regex=GENERATION_ROUTES), node, max_examples=40)
    assert {"POST /v1/messages/count_tokens", "POST /place_instance"} <= answered.keys(), answered


def test_a_token_id_outside_the_vocabulary_is_refused(node: NodeProcess) -> None:
    """Found by the fuzzer: such a prompt crashed the runner (it indexed past its embeddings)."""
    response = httpx.post(
        f"{node.base_url}/v1/completions",
        json={"model": DEFAULT_MODEL_ID, "prompt": [33554432], "max_tokens": 1},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert "33554432" in response.json()["error"]["message"]


def test_a_prompt_without_tokens_is_refused(node: NodeProcess) -> None:
    """Found by the fuzzer: the tokenizer drops a lone control character, and the
    runner failed on the empty prompt (a 500)."""
    response = httpx.post(
        f"{node.base_url}/v1/completions",
        json={"model": DEFAULT_MODEL_ID, "prompt": "\u0013", "max_tokens": 1},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the prompt has no tokens"


def test_the_node_still_serves_after_the_fuzzing(node: NodeProcess) -> None:
    reply = httpx.post(
        f"{node.base_url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 30,
        },
        timeout=120,
    )
    assert reply.status_code == 200
    assert "Paris" in reply.json()["choices"][0]["message"]["content"]
