"""The OpenAPI description of routes whose bodies FastAPI does not parse itself.

/v1/completions and /v1/chat/completions read their bodies by hand (so malformed bodies get OpenAI-format 400s),
which would leave the request body out of the generated schema; here it is put back, with every response the
route can give.
"""

from typing import Any

from fastapi import FastAPI

from pydantic import BaseModel

from tritonllm.adapter.messages import CountTokensRequest, MessagesRequest
from tritonllm.adapter.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from tritonllm.adapter.responses import ResponsesRequest

_COMPONENT_REF = "#/components/schemas/{model}"
# One server-sent event of a stream: its `data` (JSON, or [DONE]) and, for the Messages and Responses APIs, its
# `event` name.
_SSE_EVENT_SCHEMA = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                     "required": ["data"]}

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a bad parameter value, or a limit exceeded (`param` names it)",
    401: "Missing or incorrect API key (only when the server has one)",
    404: "Unknown model (or adapter)",
    413: "Request body too large",
    503: "Triton or the model is unavailable, or the engine is overloaded (see Retry-After)",
    504: "Triton did not finish the request in time",
}


def error_responses(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` entries for the given error statuses, all with the error body `model` (OpenAI's, or
    Anthropic's for the Messages API)."""
    return {status: {"model": model, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


def generation_route_docs(
    request_model: type[BaseModel], response_model: type[BaseModel], chunk_model: type[BaseModel] | None,
    with_auth: bool, stream_description: str | None = None, error_model: type[BaseModel] = ErrorResponse,
) -> dict[str, Any]:
    """Keyword arguments for a generating route decorator: its request body and responses (with `stream: true`
    the answer's server-sent events: `chunk_model`'s, or as `stream_description` says)."""
    request_schema = request_model.model_json_schema(ref_template=_COMPONENT_REF)
    request_schema.pop("$defs", None)  # nested models go into components (install_request_components)
    errors = (400, 401, 404, 413, 503, 504) if with_auth else (400, 404, 413, 503, 504)
    stream_description = stream_description or \
        f"its chunks as server-sent events (`data: <{chunk_model.__name__} JSON>` each, then `data: [DONE]`)"
    return {
        "openapi_extra": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}}
        },
        "responses": {
            200: {
                "model": response_model,
                "description": f"The answer, or with `stream: true` {stream_description}",
                "content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}},
            },
            **error_responses(*errors, model=error_model),
        },
    }


def lora_route_docs(request_model: type[BaseModel], with_auth: bool) -> dict[str, Any]:
    """Keyword arguments for a runtime LoRA route decorator (flat bodies, vLLM's plain-text answer)."""
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": request_model.model_json_schema()}}}},
        "responses": {
            200: {"description": "vLLM's `Success: ...` line",
                  "content": {"text/plain": {"schema": {"type": "string"}}}},
            **error_responses(*((400, 401, 404, 503) if with_auth else (400, 404, 503))),
        },
    }


def install_request_components(app: FastAPI) -> None:
    """Add the request models' nested schemas, which `generation_route_docs` refers to, to the components."""
    nested = {
        name: schema
        for model in (CompletionRequest, ChatCompletionRequest, MessagesRequest, CountTokensRequest, ResponsesRequest)
        for name, schema in model.model_json_schema(ref_template=_COMPONENT_REF).get("$defs", {}).items()
    }
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()  # caches itself in app.openapi_schema, which this updates in place
            schema.setdefault("components", {}).setdefault("schemas", {}).update(nested)
        return app.openapi_schema

    app.openapi = openapi
