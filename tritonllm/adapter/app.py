"""The HTTP service: FastAPI routes over the completion and chat services, and the uvicorn entry point."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from prometheus_client.metrics_core import Metric
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from tritonllm.adapter.auth import api_key_dependency
from tritonllm.adapter.chat import ChatService
from tritonllm.adapter.completions import CompletionService
from tritonllm.adapter.concurrency import cancel_on_disconnect
from tritonllm.adapter.deadlines import request_deadline, stream_within, within
from tritonllm.adapter.engine_health import EngineHealth
from tritonllm.adapter.engine_metrics import dead_instances, read_engine_metrics, relayed, sglang_loads
from tritonllm.adapter.errors import install_exception_handlers, model_not_found, service_unavailable
from tritonllm.adapter.head import HeadAsGet
from tritonllm.adapter.limits import check_limits, read_body
from tritonllm.adapter.messages import (AnthropicErrorResponse, CountTokensRequest, CountTokensResponse,
                                        MessageResponse, MessagesRequest, anthropic_message, message_events)
from tritonllm.adapter.metrics import AdapterMetrics, MetricsMiddleware
from tritonllm.adapter.models import model_cards
from tritonllm.adapter.openapi import (error_responses, generation_route_docs, install_request_components,
                                    lora_route_docs)
from tritonllm.adapter.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerationRequest,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
    parse_by_shape,
    parse_request,
)
from tritonllm.adapter.responses import ResponseObject, ResponsesRequest, response_events, whole_response
from tritonllm.adapter.runtime_lora import RuntimeAdapters, runtime_lora_allowed
from tritonllm.adapter.sse import completion_events
from tritonllm.adapter.settings import AdapterSettings
from tritonllm.adapter.shutdown import CANCELLED_EXIT_S, Drain, DrainingServer, shutting_down
from tritonllm.adapter.tokenization import TokenizationService
from tritonllm.adapter.triton_client import TritonClient


def create_app(settings: AdapterSettings, engine_health: EngineHealth | None = None) -> FastAPI:
    """`engine_health`: shared with `tritonllm serve`'s engine supervisor, which sees engine processes die."""
    started = int(time.time())
    runtime_adapters = RuntimeAdapters(settings.lora_dir, settings.served_model_name,
                                       runtime_lora_allowed(settings.allow_runtime_lora))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The gRPC channel belongs to the serving event loop, so it is made here rather than at import.
        triton = TritonClient(settings, engine_health)
        app.state.triton = triton
        watch = asyncio.create_task(triton.watch_engines())
        app.state.completions = CompletionService(triton, settings.served_model_name, settings.lora_dir is not None,
                                                  runtime_adapters)
        app.state.chat = ChatService(app.state.completions)
        app.state.tokenization = TokenizationService(triton, settings.served_model_name, runtime_adapters)
        try:
            yield
        finally:
            watch.cancel()
            await triton.close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", lifespan=lifespan)
    install_exception_handlers(app)
    install_request_components(app)
    # Outermost last: metrics see every request (HEAD and refusals while draining included) as the client sent it.
    app.state.drain = Drain(settings.shutdown_grace_s)
    app.add_middleware(app.state.drain.middleware)
    app.add_middleware(HeadAsGet)
    metrics = AdapterMetrics()
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    with_auth = settings.api_key is not None
    # Authentication runs as a dependency, before the body is read: strangers cannot make us read it.
    auth = [Depends(api_key_dependency(settings.api_key))] if with_auth else []
    v1 = APIRouter(prefix="/v1", dependencies=auth)
    vllm_routes = APIRouter(dependencies=auth)  # vLLM's routes outside /v1

    async def generate(request: Request, generation_request: GenerationRequest,
                       events: Callable[[Any, AsyncGenerator], AsyncIterator[str]] = completion_events,
                       whole: Callable[[Any], BaseModel] = lambda completion: completion) -> Response:
        """Run a completion or chat; `events` frames its stream (from the first chunk and the rest), `whole` turns
        the whole answer into the response body (both OpenAI's as they are, unless another API's)."""
        service: CompletionService | ChatService = request.app.state.chat \
            if isinstance(generation_request, ChatCompletionRequest) else request.app.state.completions
        deadline_s = request_deadline(request.headers, settings)
        check_limits(generation_request, settings)
        if generation_request.stream:
            chunks = stream_within(service.stream(generation_request), deadline_s)
            # Wait for the first chunk before answering 200, so that refusals and Triton failures at the
            # start still get a proper HTTP error status.
            first = await cancel_on_disconnect(anext(chunks), request.is_disconnected)
            stream = events(first, chunks)
            # Starlette cancels the streaming task when the client disconnects; closing the generator
            # afterwards also covers a generator that was suspended between chunks at that moment.
            return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(stream.aclose))
        completion = await cancel_on_disconnect(within(service.complete(generation_request), deadline_s),
                                                request.is_disconnected)
        return Response(whole(completion).model_dump_json(), media_type="application/json")

    @v1.post("/completions", **generation_route_docs(CompletionRequest, CompletionResponse, CompletionResponse,
                                                     with_auth))
    async def create_completion(request: Request) -> Response:
        # Parsed by hand (not as a FastAPI body parameter) so every malformed body gets an OpenAI-format 400.
        return await generate(request, parse_request(await read_body(request, settings.max_body_bytes),
                                                     CompletionRequest))

    @v1.post("/chat/completions", **generation_route_docs(ChatCompletionRequest, ChatCompletionResponse,
                                                          ChatCompletionChunk, with_auth))
    async def create_chat_completion(request: Request) -> Response:
        return await generate(request, parse_request(await read_body(request, settings.max_body_bytes),
                                                     ChatCompletionRequest))

    anthropic_errors = {"with_auth": with_auth, "error_model": AnthropicErrorResponse}

    @v1.post("/messages", **generation_route_docs(
        MessagesRequest, MessageResponse, None, **anthropic_errors,
        stream_description="Anthropic's events (message_start, content_block_start / delta / stop, message_delta, "
                           "message_stop; `event: <type>` and `data: <JSON>` each)"))
    async def create_message(request: Request) -> Response:
        """Anthropic's Messages API, run as a chat completion (tritonllm/adapter/messages.py)."""
        body = parse_request(await read_body(request, settings.max_body_bytes), MessagesRequest)
        return await generate(request, body.chat_request(), lambda first, rest: message_events(first, rest, body),
                              lambda chat: anthropic_message(chat, body))

    @v1.post("/messages/count_tokens", **generation_route_docs(
        CountTokensRequest, CountTokensResponse, None, **anthropic_errors, stream_description="(never streamed)"))
    async def count_message_tokens(request: Request) -> CountTokensResponse:
        """Anthropic's: the prompt tokens a message request would take (its system prompt and tools included)."""
        body = parse_request(await read_body(request, settings.max_body_bytes), CountTokensRequest)
        tokenized = await request.app.state.tokenization.tokenize(body.tokenize_request())
        return CountTokensResponse(input_tokens=tokenized.count)

    @v1.post("/responses", **generation_route_docs(
        ResponsesRequest, ResponseObject, None, with_auth,
        stream_description="the Responses events (response.created, response.output_item.added, "
                           "response.output_text.delta, response.function_call_arguments.delta, ..., "
                           "response.completed; `event: <type>` and `data: <JSON>` each)"))
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API, stateless, run as a chat completion (tritonllm/adapter/responses.py)."""
        body = parse_request(await read_body(request, settings.max_body_bytes), ResponsesRequest)
        return await generate(request, body.chat_request(), lambda first, rest: response_events(first, rest, body),
                              lambda chat: whole_response(chat, body))

    async def engine_metrics() -> list[Metric] | None:
        """Triton's metric families; None when unknown (no --triton-metrics-url) or unreachable."""
        if settings.triton_metrics_url is None:
            return None
        try:
            return await read_engine_metrics(settings.triton_metrics_url)
        except OSError:  # Triton is down: /health says so
            return None

    @v1.get("/models", responses=error_responses(401) if with_auth else None)
    async def list_models(request: Request) -> ModelList:
        """The base model, each LoRA adapter of the directory as `<base>:<adapter>`, then the ones loaded at runtime
        by their names (what `model` accepts)."""
        return ModelList(data=await model_cards(settings, started, runtime_adapters))

    @v1.get("/models/{model:path}", responses=error_responses(*((401, 404) if with_auth else (404,))))
    async def retrieve_model(request: Request, model: str) -> ModelCard:
        """One entry of /v1/models (adapter names may hold slashes); 404 model_not_found for any other."""
        cards = await model_cards(settings, started, runtime_adapters)
        card = next((card for card in cards if card.id == model), None)
        if card is None:
            raise model_not_found(model)
        return card

    # no response_class: it would document the JSON errors as plain text too (the answers are PlainTextResponse)
    @v1.post("/load_lora_adapter", **lora_route_docs(LoadLoraAdapterRequest, with_auth))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        """vLLM's: give `lora_name` to the adapter at `lora_path` (inside the adapters directory), once an engine
        has read its files; /v1/models lists it at once and `model` accepts the name."""
        body = parse_request(await read_body(request, settings.max_body_bytes), LoadLoraAdapterRequest)
        triton: TritonClient = request.app.state.triton

        async def engine_reads(path: str) -> None:
            await triton.tokenize(body.lora_name, {}, request_id=f"lora-{uuid.uuid4().hex}",
                                  sampling_parameters={"lora_path": path})

        return PlainTextResponse(await runtime_adapters.load(body.lora_name, body.lora_path, engine_reads))

    @v1.post("/unload_lora_adapter", **lora_route_docs(UnloadLoraAdapterRequest, with_auth))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        """vLLM's: forget `lora_name`; requests already running with it finish, later ones get 404."""
        body = parse_request(await read_body(request, settings.max_body_bytes), UnloadLoraAdapterRequest)
        return PlainTextResponse(runtime_adapters.unload(body.lora_name))

    # SGLang's load report, which gateways (SMG) poll for load-aware routing; one entry per engine instance.
    @v1.get("/loads", include_in_schema=False)
    async def loads() -> dict:
        families = await engine_metrics()
        if families is None:
            raise service_unavailable("The engines' metrics cannot be read (is --triton-metrics-url set?).")
        return sglang_loads(families)

    @vllm_routes.post("/tokenize", responses=error_responses(*((400, 401, 404) if with_auth else (400, 404))))
    async def tokenize(request: Request) -> TokenizeResponse:
        """vLLM's: a prompt's (or a chat's rendered) token ids, from the engine's tokenizer."""
        body = parse_by_shape(await read_body(request, settings.max_body_bytes), TokenizeChatRequest,
                              TokenizeCompletionRequest)
        return await request.app.state.tokenization.tokenize(body)

    @vllm_routes.post("/detokenize", responses=error_responses(*((400, 401, 404) if with_auth else (400, 404))))
    async def detokenize(request: Request) -> DetokenizeResponse:
        """vLLM's: the text of token ids."""
        body = parse_request(await read_body(request, settings.max_body_bytes), DetokenizeRequest)
        return await request.app.state.tokenization.detokenize(body)

    @vllm_routes.post("/invocations", **generation_route_docs(CompletionRequest, CompletionResponse,
                                                              CompletionResponse, with_auth))
    async def invocations(request: Request) -> Response:
        """vLLM's (SageMaker's) route: a chat completion when the body has `messages`, else a completion."""
        return await generate(request, parse_by_shape(await read_body(request, settings.max_body_bytes),
                                                      ChatCompletionRequest, CompletionRequest))

    app.include_router(v1)
    app.include_router(vllm_routes)

    @app.get("/health", responses=error_responses(503))
    async def health(request: Request) -> dict:
        triton: TritonClient = request.app.state.triton
        if not await triton.is_ready():
            raise service_unavailable(f"Triton model '{settings.triton_model}' at {settings.triton_url} is not ready.")
        # Triton's readiness sees neither an engine dead inside a live stub (its metrics do) nor a dead stub (the
        # Triton client does: engine_health.py)
        failed = dead_instances(await engine_metrics() or [])
        if failed:
            raise service_unavailable(f"engine instance(s) {', '.join(failed)} of Triton model "
                                      f"'{settings.triton_model}' are dead after repeated failed steps; restart "
                                      "the server (its log says why).")
        if not (ended := triton.health.dead()):
            await triton.probe()  # (a dead engine process answers at once; an idle server would not notice otherwise)
            ended = triton.health.dead()
        if ended:
            raise service_unavailable(f"engine instance(s) {', '.join(sorted(ended))} of Triton model "
                                      f"'{settings.triton_model}' died ({'; '.join(ended.values())}); being "
                                      "restarted (the server's log says how it ended).")
        return {"status": "ok"}

    # Outside /v1: a Prometheus scraper needs no API key unless asked (as vLLM's); /health never does (probes).
    @app.get("/metrics", include_in_schema=False, dependencies=auth if settings.metrics_require_key else [])
    async def prometheus_metrics(request: Request) -> Response:
        return metrics.response(relayed(await engine_metrics() or [], request.app.state.triton.health.dead()))

    return app


def run(settings: AdapterSettings, host: str, port: int, log_level: str,
        engine_health: EngineHealth | None = None) -> None:
    """Serve the adapter until interrupted; the first SIGINT/SIGTERM drains it first (tritonllm/adapter/shutdown.py)."""
    # uvicorn configures only its own loggers; this gives the adapter's warnings a format and a handler.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    app = create_app(settings, engine_health)

    async def drain() -> None:
        await app.state.drain.run(cancel_rest=lambda: app.state.triton.cancel_all(shutting_down()))

    # Drained, no connection should be left; one that is gets closed this much later.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=CANCELLED_EXIT_S)
    DrainingServer(config, drain).run()
