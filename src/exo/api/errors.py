"""Error responses in the format of the API a route belongs to: Anthropic's for
`/v1/messages…`, Ollama's for `/api/…`, OpenAI's everywhere else."""

import json
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from loguru import logger
from starlette.exceptions import HTTPException

from exo.api.openai_types import error_body


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})  # e.g. Retry-After

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.code, self.param)


def invalid(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    """A 400: the request itself is wrong."""
    return APIError(400, message, "invalid_request_error", code, param)


_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH_PREFIX = "/v1/messages"
RESPONSES_PATH_PREFIX = "/v1/responses"
OLLAMA_PATH_PREFIX = "/api/"


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    return _ANTHROPIC_ERROR_TYPES.get(status, default)


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """An Anthropic error: the body of a failed response, or a stream's `error` event."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def ollama_error_body(message: str) -> dict[str, Any]:
    """An Ollama error: the body of a failed response, or a stream's last line."""
    return {"error": message}


def _response(
    request: Request,
    status: int,
    openai_body: dict[str, Any],
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    path = request.url.path
    message = openai_body["error"]["message"]
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        body = anthropic_error_body(status, message)
        return JSONResponse(body, status_code=status, headers=headers)
    if path.startswith(OLLAMA_PATH_PREFIX):
        return JSONResponse(ollama_error_body(message), status_code=status, headers=headers)
    return JSONResponse(openai_body, status_code=status, headers=headers)


def error_response(request: Request, error: APIError) -> JSONResponse:
    """`error` as the response of the API `request` belongs to."""
    return _response(request, error.status, error.body(), error.headers)


def stream_error_event(path: str, error: APIError) -> str:
    """`error` as the SSE event (the NDJSON line, for Ollama's) that ends a
    stream of the API at `path` (its status was sent already)."""
    if path.startswith(OLLAMA_PATH_PREFIX):
        return json.dumps(ollama_error_body(error.message)) + "\n"
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        payload = anthropic_error_body(error.status, error.message)
        return f"event: error\ndata: {json.dumps(payload)}\n\n"
    if path.startswith(RESPONSES_PATH_PREFIX):
        payload = {"type": "error", "code": error.code, "message": error.message, "param": None}
        return f"event: error\ndata: {json.dumps(payload)}\n\n"
    return f"data: {json.dumps(error.body())}\n\n"


def internal_error(
    detail: str, code: str = "internal_error", exception: BaseException | None = None
) -> APIError:
    """A 500 that tells the client only an id: exception text may show paths,
    prompts or other clients' data. `detail` (and `exception`'s traceback) go
    to the log under that id."""
    error_id = uuid.uuid4().hex[:12]
    logger.opt(exception=exception).error(f"internal error (id {error_id}): {detail}")
    return APIError(
        500, f"internal error (id {error_id}); see the node's log", "server_error", code
    )


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    first = error.errors()[0] if error.errors() else {}
    if first.get("type") == "json_invalid":
        return (
            f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
            None,
        )
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "extra_forbidden":
        message = "unknown parameter; exo does not support it"
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        detail = f"unhandled error on {request.method} {request.url.path}"
        return error_response(request, internal_error(detail, exception=error))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(request, invalid(message, param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:
        code = {404: "not_found", 413: "request_too_large"}.get(error.status_code)
        body = error_body(str(error.detail), "invalid_request_error", code)
        return _response(request, error.status_code, body)
