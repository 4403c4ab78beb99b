"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; the app's exception handlers turn it, Starlette's
HTTPException (unknown route, wrong method) and anything unexpected into that shape.
"""
from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxllm.engine.async_llm import EngineDeadError

# HTTP status -> OpenAI's error type.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
# Seconds an overloaded server asks a client to wait (the openai SDK honours it).
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def engine_dead() -> APIError:
    return APIError(503, "The engine is not running; the server cannot serve requests.",
                    code="engine_dead")


def overloaded(message: str) -> APIError:
    """--max-waiting-requests reached: the request was not queued; try again later."""
    return APIError(429, message, code="too_many_waiting_requests",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


async def handle_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def handle_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail)).response()


async def handle_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    return engine_dead().response()


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this, so uvicorn logs the traceback.
    return APIError(500, f"Internal server error: {exc!r}").response()


EXCEPTION_HANDLERS = {APIError: handle_api_error, HTTPException: handle_http_exception,
                      EngineDeadError: handle_engine_dead, Exception: handle_unexpected}
