"""Errors a request can end with. The tag in brackets is part of the message that crosses Triton's stream
(which carries no status code), so the adapter can map it to an HTTP status; `[tag:param]` also names the
request parameter at fault."""


class RequestError(Exception):
    tag = "internal"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __str__(self) -> str:
        where = f":{self.param}" if self.param else ""
        return f"[{self.tag}{where}] {super().__str__()}"


class InvalidRequest(RequestError):
    """Bad input: the adapter answers 400."""

    tag = "invalid_request"


class NotFound(RequestError):
    """The request names something this server does not have (a LoRA adapter): the adapter answers 404."""

    tag = "not_found"


class Overloaded(RequestError):
    """Admission control refused the request: the adapter answers 503 with Retry-After."""

    tag = "overloaded"
