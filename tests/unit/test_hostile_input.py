"""Request bodies no generation can use are a 400 in the route's API format,
before any field is read: lone surrogates in any string, nesting deeper than
`MAX_JSON_DEPTH`, numbers JSON does not have; `logit_bias` keys of ASCII
digits only; JSON schemas without a finite instance."""

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from exo.api.anthropic_types import CountTokensRequest, MessagesRequest
from exo.api.errors import install_error_handlers
from exo.api.ollama_types import OllamaChatRequest, OllamaGenerateRequest
from exo.api.openai_types import ChatCompletionRequest, CompletionRequest
from exo.api.request_fields import MAX_JSON_DEPTH, sound_json_problem
from exo.api.responses_types import ResponsesRequest
from exo.api.schema_instances import has_finite_instance

LONE = "\\ud800"  # as JSON text: an escape no UTF-8 text can hold
USER = {"role": "user", "content": "Hi"}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "messages": [USER]},
    "/v1/completions": {"model": "m", "prompt": "Hi"},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [USER]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [USER]},
    "/v1/responses": {"model": "m", "input": "Hi"},
    "/api/chat": {"model": "m", "messages": [USER]},
    "/api/generate": {"model": "m", "prompt": "Hi"},
}
OK = {"ok": "yes"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    """Each route's request type behind the API's error handlers."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return OK

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return OK

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return OK

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return OK

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return OK

    @app.post("/api/chat")
    async def ollama_chat(body: OllamaChatRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return OK

    @app.post("/api/generate")
    async def ollama_generate(body: OllamaGenerateRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return OK

    return TestClient(app)


def deep(levels: int, leaf: object = 1) -> object:
    for _ in range(levels):
        leaf = {"a": leaf}
    return leaf


def post(client: TestClient, path: str, text: str) -> dict[str, Any]:
    """The error `text` (a JSON body) gets: a 400 in the route's API's format."""
    response = client.post(path, content=text, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    body = response.json()
    if path.startswith("/api/"):
        assert list(body) == ["error"]
        return {"message": body["error"]}
    if path.startswith("/v1/messages"):
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        return {"message": body["error"]["message"]}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def with_lone_surrogate(path: str) -> str:
    return json.dumps(BODIES[path]).replace('"Hi"', f'"hi {LONE}"', 1)


@pytest.mark.parametrize("path", BODIES)
def test_a_lone_surrogate_in_a_message_is_refused(client: TestClient, path: str) -> None:
    error = post(client, path, with_lone_surrogate(path))
    assert "lone surrogate" in error["message"]
    where = {"/v1/completions": "prompt", "/v1/responses": "input", "/api/generate": "prompt"}.get(
        path, "messages.0.content"
    )
    assert error["message"].startswith(f"{where}: ")


@pytest.mark.parametrize(
    ("path", "fields", "where"),
    [
        ("/v1/chat/completions", f'"stop": ["ok", "x{LONE}"]', "stop.1"),
        ("/v1/messages", f'"stop_sequences": ["{LONE}"]', "stop_sequences.0"),
        ("/v1/chat/completions", f'"user": "{LONE}"', "user"),  # ignored fields too
        ("/v1/chat/completions", f'"metadata": {{"{LONE}": "x"}}', "metadata.\\ud800"),
    ],
)
def test_a_lone_surrogate_anywhere_is_refused(
    client: TestClient, path: str, fields: str, where: str
) -> None:
    text = json.dumps(BODIES[path])[:-1] + f", {fields}}}"
    error = post(client, path, text)
    assert error["message"].startswith(f"{where}: ") and "lone surrogate" in error["message"]


def test_paired_surrogates_are_a_character(client: TestClient) -> None:
    body = json.dumps(BODIES["/v1/chat/completions"]).replace('"Hi"', '"\\ud83d\\ude00"')
    response = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/chat/completions", "chat_template_kwargs"),
        ("/v1/chat/completions", "metadata"),
        ("/v1/messages", "tools"),
        ("/v1/messages/count_tokens", "tools"),
        ("/v1/responses", "tools"),
    ],
)
def test_nesting_deeper_than_the_bound_is_refused(
    client: TestClient, path: str, field: str
) -> None:
    body = dict(BODIES[path])
    nested = deep(900)
    if field == "tools":
        tool = {"name": "t", "input_schema": nested}
        body[field] = [tool if path.startswith("/v1/messages") else
                       {"type": "function", "name": "t", "parameters": nested}]  # fmt: skip
    else:
        body[field] = nested
    error = post(client, path, json.dumps(body))
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in error["message"]
    assert error["message"].startswith(f"{field}.")


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", '"repetition_penalty": Infinity'),
        ("/v1/chat/completions", '"frequency_penalty": NaN'),
        ("/v1/completions", '"presence_penalty": -Infinity'),
        ("/v1/chat/completions", '"temperature": 1e400'),  # decodes as infinity
        ("/v1/messages", '"temperature": NaN'),
        ("/v1/responses", '"top_p": Infinity'),
        ("/api/chat", '"options": {"temperature": NaN}'),
    ],
)
def test_numbers_json_does_not_have_are_refused(client: TestClient, path: str, fields: str) -> None:
    text = json.dumps(BODIES[path])[:-1] + f", {fields}}}"
    assert "numbers must be finite" in post(client, path, text)["message"]


@pytest.mark.parametrize("key", ["²", "\u0661", "1.5", "-1", " 1", ""])
def test_logit_bias_keys_are_ascii_digits(client: TestClient, key: str) -> None:
    body = {**BODIES["/v1/chat/completions"], "logit_bias": {key: 1}}
    error = post(client, "/v1/chat/completions", json.dumps(body))
    assert error["param"] == "logit_bias" and "token ids" in error["message"]


def test_sound_json_within_the_bound_passes() -> None:
    assert sound_json_problem(deep(MAX_JSON_DEPTH)) is None
    assert sound_json_problem(deep(MAX_JSON_DEPTH + 1)) is not None
    assert sound_json_problem({"a": ["é", 1.5, None, True, {"ok": "😀"}]}) is None
    # A key's lone surrogate is escaped in the message: the message must encode.
    problem = sound_json_problem({"a": {"b\ud800": 1}})
    assert problem == "a.b\\ud800: the key holds a lone surrogate"
    problem.encode()


@pytest.mark.parametrize(
    ("schema", "finite"),
    [
        ({"$ref": "#"}, False),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
         False),
        ({"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}, False),
        (False, False),
        # Recursion with a way out: a finite instance exists.
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),
        ({"type": "array", "items": {"$ref": "#"}}, True),
        ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
        ({"$defs": {"node": {"type": "object", "required": ["next"], "properties": {
            "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
          "$ref": "#/$defs/node"}, True),
        ({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}, True),
        ({"$ref": "https://example.com/schema"}, True),  # not ours to judge: llguidance's
        ({"$ref": "#/nowhere"}, True),
        ({}, True),
    ],
)  # fmt: skip
def test_a_schema_has_a_finite_instance_unless_every_one_recurses(
    schema: object, finite: bool
) -> None:
    assert has_finite_instance(schema) is finite
