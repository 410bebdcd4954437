"""The adapter's connection to Triton: one gRPC stream per generation request to the decoupled model.

Decoupled models cannot answer unary infer calls, so every request goes through `stream_infer`. Each stream
carries exactly one request: after it is written, our request iterator ends, which half-closes the stream,
and Triton closes the stream once that request has sent its last response. The end of the stream is
therefore the end of the request. (The aio client cannot ask for Triton's empty final response: it rejects
the reserved `triton_enable_empty_final_response` request parameter.)

A call that goes `idle_timeout_s` without a response fails with 504: a generation may take as long as it keeps
producing (a deadline on the whole request is the HTTP layer's: tritonllm/adapter/deadlines.py).

An engine instance whose process died answers at once that it is not healthy, and never again answers the requests it
held. While an instance is dead, the calls it may hold (sent before it was marked dead) that wait in silence are
taken back (`watch_engines`, engine_health.py). A request refused or taken back before any response goes again (another
instance may serve it); one that had responses gets 503.
"""

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, InferInput, InferResult
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from tritonllm.interface.api_key import triton_headers
from tritonllm.interface.errors import decode
from tritonllm.interface.tensors import CANCEL_INPUT, CANCEL_OUTPUT, RUNNING
from tritonllm.adapter.engine_health import EngineHealth, dead_stub, engine_died
from tritonllm.adapter.errors import AdapterError, from_kind, gateway_timeout, internal_error, service_unavailable
from tritonllm.adapter.settings import AdapterSettings

_CHANNEL_ARGS = [
    # Non-streamed outputs with logprobs can pass gRPC's default 4 MiB limit.
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    # A short reconnect backoff lets /health turn ready soon after tritonserver (re)starts,
    # instead of after gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

_ALWAYS_RETURNED = (
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_num_cached_tokens",
    "return_matched_stop",
    "return_model_instance",  # read by _Responses, never passed on
)

logger = logging.getLogger(__name__)

_ENGINE_PROBE_INTERVAL_S = 1.0
_SILENT_S = 2.0
"""While an engine instance is dead, a call it may hold that has waited this long for its next response is taken back:
the dead instance will never answer it. The engine names the instance that takes a generation request
(return_model_instance); one sent before the death and not yet named may be held by any (a live one's, silent as long
in Triton's queue, is taken back too, and goes again)."""
_DEAD_ENGINE_RETRIES = 16
"""A request a dead instance refused (at once) or held goes again this many times: Triton hands each to whichever
instance takes it first, and a dead one is always free, so with two instances it takes about half of them."""
_CANCEL_RETRY_S = 0.05
"""A call left before its stream ended is cancelled in the engine (CANCEL_INPUT), asked again this often while
its stream goes on: the instance asked may not run it (Triton picks one), or not have it yet."""
_ABANDONED_S = 2.0  # then its gRPC stream is cancelled after all


class _EngineDied(Exception):
    """A call met a dead engine instance, or waited in silence on one (or on any, `instance` naming them all)."""

    def __init__(self, instance: str) -> None:
        super().__init__(instance)
        self.instance = instance


# Triton's own answer while the model is missing or still loading.
_MODEL_NOT_AVAILABLE = re.compile(r"unknown model", re.IGNORECASE)


@dataclass(frozen=True)
class ChoiceOutput:
    """What one response says about one of the request's `n` choices."""

    text: str
    """New text when streaming, the whole text otherwise (never including the prompt)."""
    finish_reason: str | None
    """None while the choice is still running."""
    logprobs: list[dict]
    """Engine entries of the new tokens (see logprobs.py); empty unless logprobs were requested."""
    num_output_tokens: int | None
    """Tokens this response carries (all of them when not streaming)."""
    matched_stop: str | int | None
    """The stop string (or stop_regex pattern) or stop token id that finished the choice; None until then."""
    hidden_states: list[list[float]] = field(default_factory=list)
    """Final hidden states of the new tokens; empty unless return_hidden_states was requested."""
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    """[MoE layers][top_k] expert ids of each new token; empty unless return_routed_experts was requested."""
    token_ids: list[int] = field(default_factory=list)
    """The new tokens' ids; empty unless return_token_ids was requested."""
    tool_calls: list[dict] = field(default_factory=list)
    """With tools: OpenAI's tool calls (streaming: their deltas), parsed by the engine."""
    reasoning: str | None = None
    """A reasoning model's chat: the reasoning text (streaming: the new text; `text` is the answer's); None when
    the engine parses none."""
    num_reasoning_tokens: int | None = None
    """Of the choice's output tokens so far, those of its reasoning."""


@dataclass(frozen=True)
class TritonChunk:
    """One response of the model."""

    choices: list[ChoiceOutput]
    num_input_tokens: int | None
    num_cached_tokens: int | None
    prompt_logprobs: list[dict] | None
    """Engine entries of every prompt token (the first with null logprob and rank), in one response only, when
    requested."""
    prompt_hidden_states: list[list[float]] | None = None
    """Final hidden states of every prompt token, in one response only, when requested (echo)."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids, in the first response only, when requested."""
    cached_tokens_details: list[int] | None = None
    """num_cached_tokens by KV cache tier (CACHE_TIERS' order), when requested."""


@dataclass(frozen=True)
class GenerateRequest:
    """One request to the `llm` model: a prompt and what goes with it."""

    prompt: str | list[int] | list[dict]
    """A text, token ids, or chat messages (the engine applies the model's chat template)."""
    sampling_parameters: dict
    stream: bool
    return_logprobs: bool = False
    return_token_ids: bool = False
    """The new tokens' ids per choice, and the prompt's once."""
    return_cached_tokens_details: bool = False
    """The cached prompt tokens by KV cache tier (CACHE_TIERS)."""
    prompt_options: dict[str, bool | str] = field(default_factory=dict)
    """PROMPT_OPTIONS and TOOL_INPUTS inputs (tritonllm/interface/tensors.py) by name, a bool for a BOOL input, a
    string for a STRING one; an absent one keeps the engine's default."""


@dataclass(frozen=True)
class TokenizedPrompt:
    """The answer to a tokenize_only request: a prompt as the engine sees it."""

    token_ids: list[int]
    token_strs: list[str]
    text: str
    max_model_len: int


def _announced_instance(result: InferResult) -> str | None:
    """The engine instance a return_model_instance response names; None for any other response."""
    response = result.get_response()
    if len(response.outputs) != 1 or response.outputs[0].name != "model_instance":
        return None
    return _decode(response.outputs[0].datatype, response.raw_output_contents[0])[0].decode()


class _Responses:
    """One gRPC stream's (result, error) pairs, read by a task of its own into a queue. Who waits for them may be
    cancelled (a client gone, a timeout) without cancelling the stream: a cancelled read would cancel the gRPC call,
    and tritonserver 2.51 can leak a stream cancelled while it writes a response (see CANCEL_INPUT)."""

    def __init__(self, stream) -> None:
        self._stream = stream  # tritonclient's stream_infer iterator
        self.sent_at = time.monotonic()
        self._queue: asyncio.Queue = asyncio.Queue()  # (result, error) pairs, then None or the exception that ended it
        self.instance: str | None = None  # the engine instance that took the request, once it said so
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            async for response in self._stream:
                if response[0] is not None and (instance := _announced_instance(response[0])) is not None:
                    self.instance = instance
                    continue
                self._queue.put_nowait(response)
            self._queue.put_nowait(None)
        except Exception as error:  # the call failed, or was cancelled
            self._queue.put_nowait(error)

    async def next(self) -> tuple | None:
        """The next (result, error); None once the stream has ended. Raises what ended it otherwise."""
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def ended(self) -> bool:
        return self._reader.done()

    async def ended_within(self, seconds: float) -> bool:
        await asyncio.wait([self._reader], timeout=seconds)
        return self.ended()

    def cancel(self) -> None:
        self._stream.cancel()


class TritonClient:
    """Owns the gRPC channel to tritonserver."""

    def __init__(self, settings: AdapterSettings, health: EngineHealth | None = None) -> None:
        self._settings = settings
        self.health = health or EngineHealth()
        self._client = InferenceServerClient(settings.triton_url, channel_args=_CHANNEL_ARGS)
        # With an API key, Triton requires its header on every call but health (tritonllm/interface/api_key.py).
        self._headers = triton_headers(settings.api_key)
        self._refusal: AdapterError | None = None  # set by cancel_all: what every call gets from then on
        self._waiting: dict[asyncio.Task, tuple[float, _Responses]] = {}  # tasks waiting for a response → since, what
        self._refused: dict[asyncio.Task, Exception] = {}  # those of them failed by us → with what
        self._abandoned: set[asyncio.Task] = set()  # cancelling the requests of calls left early (_end_abandoned)

    def cancel_all(self, error: AdapterError) -> None:
        """Fail every call in flight, and every later one, with `error` (their Triton requests are cancelled)."""
        self._refusal = error
        self._refuse(list(self._waiting), error)

    def _refuse(self, tasks: list[asyncio.Task], error: Exception) -> None:
        for task in tasks:
            if task not in self._refused:
                self._refused[task] = error
                task.cancel()

    async def watch_engines(self) -> None:
        """For the adapter's life: while calls wait or an engine instance is dead, probe the model every second (a
        dead instance answers at once that it is not healthy), and while one is dead take back the calls it may hold
        that have waited _SILENT_S for a response."""
        while True:
            await asyncio.sleep(_ENGINE_PROBE_INTERVAL_S)
            if not self._waiting and not self.health.dead():
                continue
            await self.probe()
            now = time.monotonic()
            for instance, died in self.health.dead_since().items():
                self._refuse([task for task, (since, responses) in self._waiting.items()
                              if now - since >= _SILENT_S and responses.sent_at < died
                              and responses.instance in (None, instance)], _EngineDied(instance))

    async def probe(self) -> None:
        """Ask the model for something cheap (a tokenize_only request); a dead instance that answers is marked."""
        try:
            await asyncio.wait_for(self.tokenize(".", {}, request_id=f"probe-{uuid.uuid4().hex}"),
                                   self._settings.health_timeout_s)
        except (AdapterError, TimeoutError):  # a dead instance is marked on the way (_stream)
            pass
        except Exception:  # the watch must go on
            logger.exception("probing the model failed")

    async def close(self) -> None:
        if self._abandoned:  # let the requests of calls left early end in the engine first
            await asyncio.wait(list(self._abandoned), timeout=_ABANDONED_S)
        await self._client.close()

    async def is_ready(self) -> bool:
        """Whether tritonserver and the model are ready; False on any failure or after health_timeout_s."""
        timeout = self._settings.health_timeout_s

        async def check() -> bool:
            return await self._client.is_server_ready(client_timeout=timeout) and await self._client.is_model_ready(
                self._settings.triton_model, client_timeout=timeout
            )

        try:
            ready = await asyncio.wait_for(check(), timeout)
        except Exception:
            ready = False
        if not ready:  # tritonserver is gone or reloading: the instances that come back are new
            self.health.mark_all_alive()
        return ready

    async def generate(self, request: GenerateRequest, request_id: str) -> AsyncIterator[TritonChunk]:
        """Run one generation request, yielding each of the model's responses.

        Raises AdapterError on an error response, a failed call, idle_timeout_s without a response, or after
        cancel_all. Closing the generator early cancels the request in Triton.
        """
        async with aclosing(self._stream(_request_inputs(request), request_id)) as results:
            async for result in results:
                yield _parse_response(result)

    async def tokenize(self, prompt: str | list[int] | list[dict], prompt_options: dict[str, bool | str],
                       request_id: str, sampling_parameters: dict | None = None) -> TokenizedPrompt:
        """The prompt's tokens (or a token-id prompt's text), from the engine's tokenizer; nothing is generated.
        The engine still checks `sampling_parameters` (reading the files of its `lora_path`)."""
        inputs = [*_prompt_inputs(prompt, prompt_options), _tensor("tokenize_only", np.array([True]), "BOOL")]
        if sampling_parameters is not None:
            inputs.append(_tensor("sampling_parameters", _bytes_array(json.dumps(sampling_parameters)), "BYTES"))
        async with aclosing(self._stream(inputs, request_id)) as results:
            answers = [_Outputs(result) async for result in results]  # one; read to the stream's end
        if not answers:
            raise internal_error("Triton answered a tokenize_only request with no response.")
        outputs = answers[0]
        return TokenizedPrompt(token_ids=outputs.ints("prompt_token_ids"),
                               token_strs=outputs.strings("prompt_token_strs"), text=outputs.strings("text_output")[0],
                               max_model_len=outputs.ints("max_model_len")[0])

    async def _cancel_request(self, request_id: str) -> bool:
        """Cancel the request in flight with this id in the engine instance Triton picks; whether it ran there."""
        inputs = [_tensor(CANCEL_INPUT, _bytes_array(request_id), "BYTES")]
        answers = [_Outputs(result) async for result in self._call(inputs, f"cancel-{uuid.uuid4().hex}",
                                                                      is_cancel=True)]
        return bool(answers and answers[0].ints(CANCEL_OUTPUT)[0])

    async def _stream(self, inputs: list[InferInput], request_id: str) -> AsyncIterator[InferResult]:
        """The responses of one request to the model, each as it arrives; sent again when a dead engine instance
        refused or held it before any response."""
        for attempt in range(_DEAD_ENGINE_RETRIES + 1):
            answered = False
            try:
                async with aclosing(self._call(inputs, request_id)) as results:
                    async for result in results:
                        answered = True
                        yield result
                return
            except _EngineDied as died:
                if answered or attempt == _DEAD_ENGINE_RETRIES:
                    raise engine_died(died.instance) from None

    async def _call(self, inputs: list[InferInput], request_id: str, is_cancel: bool = False
                    ) -> AsyncIterator[InferResult]:
        """The responses of one request to the model (one gRPC stream), each as it arrives. Left before the stream's
        end (a consumer gone, a timeout, an error), the request is cancelled in the engine, so the stream ends by
        itself. A cancel request (`is_cancel`) goes even after cancel_all, and its stream is cancelled if left; so is
        the stream of a call a dead instance held (a cancel request by its id could reach the request sent again)."""
        if self._refusal is not None and not is_cancel:
            raise self._refusal
        request = {"model_name": self._settings.triton_model, "inputs": inputs, "request_id": request_id}

        async def requests() -> AsyncIterator[dict]:
            yield request

        responses = _Responses(self._client.stream_infer(requests(), headers=self._headers))
        held_by_dead_instance = False
        try:
            while (response := await self._next_response(responses, refusable=not is_cancel)) is not None:
                result, error = response
                if error is not None:
                    if (instance := dead_stub(error.message())) is not None:
                        self.health.mark_dead(instance, "Triton says its process is not healthy", responses.sent_at)
                        raise _EngineDied(instance)
                    raise _error_from_message(error.message())
                yield result
        except grpc.aio.AioRpcError as error:
            raise self._error_from_rpc(error) from None
        except _EngineDied:
            held_by_dead_instance = True
            raise
        finally:
            if not responses.ended():
                if not (is_cancel or held_by_dead_instance):
                    task = asyncio.get_running_loop().create_task(self._end_abandoned(responses, request_id))
                    self._abandoned.add(task)
                    task.add_done_callback(self._abandoned.discard)
                else:
                    responses.cancel()

    async def _end_abandoned(self, responses: _Responses, request_id: str) -> None:
        """Cancel an abandoned call's request in the engine until its stream ends (its final response is the
        cancellation's error); cancel the stream itself only if that takes over _ABANDONED_S."""
        deadline = time.monotonic() + _ABANDONED_S
        try:
            while not await responses.ended_within(_CANCEL_RETRY_S) and time.monotonic() < deadline:
                try:
                    if await asyncio.wait_for(self._cancel_request(request_id), deadline - time.monotonic()):
                        await responses.ended_within(max(0.0, deadline - time.monotonic()))
                except (AdapterError, _EngineDied, TimeoutError):  # a dead or stuck instance: the deadline decides
                    pass
        finally:
            if not responses.ended():
                logger.info("request %s did not end %.0f s after it was cancelled; cancelling its stream",
                            request_id, _ABANDONED_S)
                responses.cancel()

    async def _next_response(self, responses: _Responses, refusable: bool = True) -> tuple | None:
        """The call's next (result, error); None once it has ended. Raises the idle timeout's 504, or cancel_all's
        error. Either cancels the wait, not the gRPC call: its reader task goes on (_Responses). A cancel request
        (not `refusable`) is neither timed nor refused here: its caller bounds it."""
        if not refusable:
            return await responses.next()
        if self._refusal is not None:
            raise self._refusal
        waiting = asyncio.current_task()
        self._waiting[waiting] = (time.monotonic(), responses)
        try:
            async with asyncio.timeout(self._settings.idle_timeout_s):
                return await responses.next()
        except TimeoutError:
            raise gateway_timeout(f"Triton sent nothing for {self._settings.idle_timeout_s} s (the idle timeout: "
                                  "no token for that long).") from None
        except asyncio.CancelledError:
            if waiting not in self._refused or waiting.uncancel() > 0:  # (also) cancelled by someone else
                raise
            raise self._refused[waiting] from None
        finally:
            self._waiting.pop(waiting, None)
            self._refused.pop(waiting, None)

    def _error_from_rpc(self, error: grpc.aio.AioRpcError) -> AdapterError:
        code = error.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return service_unavailable(f"Triton at {self._settings.triton_url} is unavailable: {error.details()}")
        return internal_error(f"Triton call failed ({code.name}): {error.details()}")


def _prompt_inputs(prompt: str | list[int] | list[dict], prompt_options: dict[str, bool | str]) -> list[InferInput]:
    if isinstance(prompt, str):
        inputs = [_tensor("text_input", _bytes_array(prompt), "BYTES")]
    elif isinstance(prompt[0], dict):  # chat messages: the engine applies the model's chat template
        inputs = [_tensor("messages", _bytes_array(json.dumps(prompt)), "BYTES")]
    else:
        inputs = [_tensor("input_ids", np.array(prompt, dtype=np.int32), "INT32")]
    inputs.extend(_tensor(name, np.array([value]), "BOOL") if isinstance(value, bool) else
                  _tensor(name, _bytes_array(value), "BYTES") for name, value in prompt_options.items())
    return inputs


def _request_inputs(request: GenerateRequest) -> list[InferInput]:
    inputs = _prompt_inputs(request.prompt, request.prompt_options)
    inputs.append(_tensor("stream", np.array([request.stream]), "BOOL"))
    inputs.append(_tensor("sampling_parameters", _bytes_array(json.dumps(request.sampling_parameters)), "BYTES"))
    # The adapter adds echoed prompt text itself, so Triton never returns the prompt.
    inputs.append(_tensor("exclude_input_in_output", np.array([True]), "BOOL"))
    flags = _ALWAYS_RETURNED + (("return_logprobs",) if request.return_logprobs else ()) + (
        ("return_token_ids", "return_prompt_token_ids") if request.return_token_ids else ()) + (
        ("return_cached_tokens_details",) if request.return_cached_tokens_details else ())
    inputs.extend(_tensor(flag, np.array([True]), "BOOL") for flag in flags)
    return inputs


def _tensor(name: str, array: np.ndarray, datatype: str) -> InferInput:
    tensor = InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _bytes_array(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=np.object_)


def _parse_response(response: InferResult) -> TritonChunk:
    result = _Outputs(response)
    texts = result.strings("text_output")
    count = len(texts)
    finish_reasons = result.strings("finish_reason") or [RUNNING] * count
    logprobs = [json.loads(entries) or [] for entries in result.strings("logprobs")] or [[]] * count
    num_output_tokens = result.ints("num_output_tokens") or [None] * count
    matched_stops = [json.loads(value) for value in result.strings("matched_stop")] or [None] * count
    num_input_tokens = result.ints("num_input_tokens")
    num_cached_tokens = result.ints("num_cached_tokens")
    prompt_logprobs = result.strings("prompt_logprobs")
    hidden_states = [json.loads(rows) for rows in result.strings("hidden_states")] or [[]] * count
    prompt_hidden_states = result.strings("prompt_hidden_states")
    routed_experts = [json.loads(rows) for rows in result.strings("routed_experts")] or [[]] * count
    token_ids = [json.loads(ids) for ids in result.strings("token_ids")] or [[]] * count
    tool_calls = [json.loads(calls) for calls in result.strings("tool_calls")] or [[]] * count
    reasoning = result.strings("reasoning_output") or [None] * count
    num_reasoning_tokens = result.ints("num_reasoning_tokens") or [None] * count
    prompt_token_ids = result.ints("prompt_token_ids") if "prompt_token_ids" in result else None
    return TritonChunk(
        choices=[
            ChoiceOutput(text, None if finish_reason == RUNNING else finish_reason, entries, tokens, matched_stop,
                         hidden, routed, ids, calls, thought, thought_tokens)
            for text, finish_reason, entries, tokens, matched_stop, hidden, routed, ids, calls, thought, thought_tokens
            in zip(texts, finish_reasons, logprobs, num_output_tokens, matched_stops, hidden_states, routed_experts,
                   token_ids, tool_calls, reasoning, num_reasoning_tokens)
        ],
        num_input_tokens=num_input_tokens[0] if num_input_tokens else None,
        num_cached_tokens=num_cached_tokens[0] if num_cached_tokens else None,
        prompt_logprobs=json.loads(prompt_logprobs[0]) if prompt_logprobs else None,
        prompt_hidden_states=json.loads(prompt_hidden_states[0]) if prompt_hidden_states else None,
        prompt_token_ids=prompt_token_ids,
        cached_tokens_details=result.ints("cached_tokens_details") or None,
    )


class _Outputs:
    """A response's outputs by name, each decoded once from its raw bytes (tritonclient's as_numpy looks an output up
    by scanning them all and builds an array: it cost half of a streamed token's parse)."""

    def __init__(self, result: InferResult):
        response = result.get_response()
        contents = response.raw_output_contents
        self._values = {output.name: _decode(output.datatype, contents[index])
                        for index, output in enumerate(response.outputs)}

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def strings(self, name: str) -> list[str]:
        """The output's elements, UTF-8 decoded; empty when the response has no such output."""
        return [item.decode() for item in self._values.get(name, ())]

    def ints(self, name: str) -> list[int]:
        return list(self._values.get(name, ()))


def _decode(datatype: str, raw: bytes) -> list:
    """Triton's raw tensor bytes → its elements (bytes objects for BYTES), by tritonclient's own decoders."""
    if datatype == "BYTES":
        return deserialize_bytes_tensor(raw).tolist()
    return np.frombuffer(raw, dtype=triton_to_np_dtype(datatype)).tolist()


def _error_from_message(message: str) -> AdapterError:
    """Map an error response to the client's error: by the kind the backend encoded (tritonllm/interface/errors.py),
    else by Triton's own wording."""
    decoded = decode(message)
    if decoded is None:
        if _MODEL_NOT_AVAILABLE.search(message):
            return service_unavailable(f"The model is not available in Triton: {message}")
        return internal_error(f"Triton error: {message}")
    return from_kind(decoded.kind, decoded.message, decoded.param)
