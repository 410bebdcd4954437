"""Per-request resource limits: the body size, checked while the body is read, and the request's fan-out
(prompts, choices, tokens), checked once it is parsed."""

from fastapi import Request

from tritonllm.adapter.errors import invalid_request, request_too_large
from tritonllm.adapter.protocol import GenerationRequest
from tritonllm.adapter.settings import AdapterSettings


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `max_bytes`.

    A declared Content-Length is checked before anything is read; a chunked body is counted as it arrives,
    so an oversized one never sits in memory whole.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise request_too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise request_too_large(max_bytes)
    return bytes(body)


def check_limits(request: GenerationRequest, settings: AdapterSettings) -> None:
    """400 naming the first parameter beyond this server's limits (each None limit is off)."""
    limited = (
        ("prompt", len(request.prompts()), settings.max_prompts, "prompts in one request"),
        ("n", request.n, settings.max_n, "for 'n'"),
        ("best_of", request.best_of, settings.max_best_of, "for 'best_of'"),
        ("max_tokens", request.max_tokens, settings.max_tokens, "for 'max_tokens'"),
    )
    for param, value, limit, what in limited:
        if value is not None and limit is not None and value > limit:
            raise invalid_request(f"This server accepts at most {limit} {what}, got {value}.", param)
