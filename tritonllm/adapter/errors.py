"""OpenAI-format errors: the one exception type every failure becomes, and the handlers that render it.

Body shape: {"error": {"message", "type", "param", "code"}}. The official SDKs read these fields. Under
ANTHROPIC_PATH (the Messages API) the same errors have Anthropic's shape: {"type": "error", "error": {"type",
"message"}}.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonllm.interface.errors import ErrorKind

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Seconds a client should wait before retrying a 503: Triton restarts or its queue drains quickly."""

ANTHROPIC_PATH = "/v1/messages"
"""The routes whose errors have Anthropic's shape."""
# Anthropic's error type of each status (any other 5xx: api_error)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


class AdapterError(Exception):
    """A failure with the HTTP status and OpenAI error fields the client should see."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        error_type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: bool = False,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = error_type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        error_type = _ANTHROPIC_TYPES.get(self.status_code, "api_error" if self.status_code >= 500
                                          else "invalid_request_error")
        message = self.message if self.param is None or self.param in self.message \
            else f"{self.param}: {self.message}"
        return {"type": "error", "error": {"type": error_type, "message": message}}

    def response(self, path: str = "") -> JSONResponse:
        """The error's response to a request for `path` (Anthropic's shape under ANTHROPIC_PATH)."""
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.retry_after else None
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATH) else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=headers)


def from_kind(kind: ErrorKind, message: str, param: str | None = None) -> AdapterError:
    """The client's error for an error kind (the one table: tritonllm/interface/errors.py)."""
    wire = kind.wire
    return AdapterError(wire.http_status, message, error_type=wire.openai_type, param=param, code=wire.openai_code,
                        retry_after=wire.retry_after)


def invalid_request(message: str, param: str | None = None) -> AdapterError:
    return from_kind(ErrorKind.INVALID_REQUEST, message, param)


def unsupported_parameter(param: str) -> AdapterError:
    return invalid_request(f"The parameter '{param}' is not supported yet.", param)


def parameter_not_enabled(param: str) -> AdapterError:
    return invalid_request(f"The parameter '{param}' is not enabled on this server.", param)


def model_not_found(model: str) -> AdapterError:
    return not_found(f"The model '{model}' does not exist.", "model")


def not_found(message: str, param: str | None) -> AdapterError:
    """A model or LoRA adapter this server does not have."""
    return from_kind(ErrorKind.NOT_FOUND, message, param)


def invalid_api_key(message: str) -> AdapterError:
    return AdapterError(401, message, error_type="invalid_request_error", code="invalid_api_key")


def request_too_large(max_bytes: int) -> AdapterError:
    return AdapterError(
        413,
        f"The request body is larger than this server's limit of {max_bytes} bytes.",
        error_type="invalid_request_error",
        code="request_too_large",
    )


def service_unavailable(message: str) -> AdapterError:
    return from_kind(ErrorKind.OVERLOADED, message)


def gateway_timeout(message: str) -> AdapterError:
    return AdapterError(504, message, error_type="timeout_error")


def internal_error(message: str = "Internal server error.") -> AdapterError:
    return from_kind(ErrorKind.INTERNAL, message)


def client_disconnected() -> AdapterError:
    # Nobody reads this response; it only gives the access log an honest line.
    return invalid_request("The client disconnected before the completion finished.")


def from_validation_error(error: ValidationError) -> AdapterError:
    """The first problem of a request body that failed validation, named by its top-level field."""
    first = error.errors()[0]
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "missing":
        return invalid_request(f"Missing required parameter '{param}'.", param)
    if first["type"] == "extra_forbidden":  # OpenAI's wording for a field it does not know
        return invalid_request(f"Unrecognized request argument supplied: {param}", param)
    reason = first["msg"].removeprefix("Value error, ")
    if param is None:
        return invalid_request(f"Invalid request body: {reason}")
    return invalid_request(f"Invalid value for '{param}': {reason}", param)


def log_server_error(error: AdapterError) -> None:
    """Client errors are the client's business; server-side ones are ours to see in the log."""
    if error.status_code >= 500:
        logger.warning("%d %s", error.status_code, error.message)


def install_exception_handlers(app: FastAPI) -> None:
    """Make every error response of the app, routing errors included, use the OpenAI shape."""

    async def on_adapter_error(request: Request, error: AdapterError) -> JSONResponse:
        log_server_error(error)
        return error.response(request.url.path)

    async def on_http_exception(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})."
        else:
            message = str(error.detail)
        adapter_error = AdapterError(error.status_code, message, error_type="invalid_request_error")
        response = adapter_error.response(request.url.path)
        # Keep headers such as Allow on a 405.
        response.headers.update(error.headers or {})
        return response

    async def on_unexpected_error(request: Request, error: Exception) -> JSONResponse:
        # Starlette re-raises the error after this response, so the server logs its traceback.
        return internal_error().response(request.url.path)

    app.add_exception_handler(AdapterError, on_adapter_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected_error)
