"""Error kinds a request can end with, and how each crosses the wire.

Triton's stream carries an error code and a message but no HTTP status, so the backend puts the kind (and the
request parameter at fault) at the start of the message as `[kind:param]`; the adapter reads it back with
`decode` and answers with the kind's HTTP status and OpenAI error type. One table says all of it."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class _Wire:
    triton_code: str  # the pb_utils.TritonError attribute the backend sends
    http_status: int
    openai_type: str
    openai_code: str | None = None
    retry_after: bool = False  # whether the client should retry (503 + Retry-After)


class ErrorKind(enum.Enum):
    INVALID_REQUEST = _Wire("INVALID_ARG", 400, "invalid_request_error")
    NOT_FOUND = _Wire("NOT_FOUND", 404, "invalid_request_error", "model_not_found")  # e.g. a LoRA adapter
    OVERLOADED = _Wire("UNAVAILABLE", 503, "service_unavailable_error", retry_after=True)  # admission control
    CANCELLED = _Wire("CANCELLED", 503, "service_unavailable_error", retry_after=True)  # cancelled by the server
    # the engine failed step after step and gave up: no retry here helps (another replica, or a restart, does)
    ENGINE_DEAD = _Wire("UNAVAILABLE", 503, "service_unavailable_error", "engine_dead")
    INTERNAL = _Wire("INTERNAL", 500, "server_error")

    @property
    def tag(self) -> str:
        return self.name.lower()

    @property
    def wire(self) -> _Wire:
        return self.value


class RequestError(Exception):
    """A request's error, of one kind; `param` names the request parameter at fault, if any."""

    kind = ErrorKind.INTERNAL

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    @property
    def message(self) -> str:
        return super().__str__()

    def __str__(self) -> str:
        return encode(self.kind, self.message, self.param)


class InvalidRequest(RequestError):
    kind = ErrorKind.INVALID_REQUEST


class NotFound(RequestError):
    kind = ErrorKind.NOT_FOUND


class Overloaded(RequestError):
    kind = ErrorKind.OVERLOADED


class Cancelled(RequestError):
    kind = ErrorKind.CANCELLED


class EngineDead(RequestError):
    kind = ErrorKind.ENGINE_DEAD


def encode(kind: ErrorKind, message: str, param: str | None = None) -> str:
    """The message as it crosses Triton's stream."""
    return f"[{kind.tag}{':' + param if param else ''}] {message}"


_TAG = re.compile(r"\[(" + "|".join(kind.tag for kind in ErrorKind) + r")(?::(\w+))?\]\s*")


@dataclass(frozen=True)
class DecodedError:
    kind: ErrorKind
    param: str | None
    message: str


def decode(message: str) -> DecodedError | None:
    """The kind, parameter and message of an encoded error; None for a message the backend did not tag."""
    match = _TAG.search(message)
    if match is None:
        return None
    return DecodedError(ErrorKind[match.group(1).upper()], match.group(2), message[match.end():])


def error_kind_of(error: Exception) -> ErrorKind:
    return error.kind if isinstance(error, RequestError) else ErrorKind.INTERNAL
