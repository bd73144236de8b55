"""OpenAI-style error responses."""

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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.code, self.param)


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
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.opt(exception=error).error("unhandled error in the API")
        return JSONResponse(
            error_body(f"internal error: {type(error).__name__}: {error}", "server_error", None),
            status_code=500,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return JSONResponse(
            error_body(message, "invalid_request_error", "invalid_request", param),
            status_code=400,
        )

    @app.exception_handler(HTTPException)
    async def _http(_: Request, error: HTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return JSONResponse(
            error_body(str(error.detail), "invalid_request_error", code),
            status_code=error.status_code,
        )
