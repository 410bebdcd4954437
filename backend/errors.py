"""Errors a request can end with. The tag in brackets is part of the message that crosses Triton's stream
(which carries no status code), so the adapter can map it to an HTTP status."""


class RequestError(Exception):
    tag = "internal"

    def __str__(self) -> str:
        return f"[{self.tag}] {super().__str__()}"


class InvalidRequest(RequestError):
    """Bad input: the adapter answers 400."""

    tag = "invalid_request"


class Overloaded(RequestError):
    """Admission control refused the request: the adapter answers 503 with Retry-After."""

    tag = "overloaded"
