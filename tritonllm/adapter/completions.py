"""One OpenAI completion request in, concurrent Triton requests (one per prompt) out, and their answers back.

Chat requests run through here too (one prompt: the conversation); chat.py reshapes their results.

The engine returns the request's `n` choices side by side in every response, so the choice of `index` c of
prompt p gets OpenAI index p * n + c (prompt-major).
"""

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.parameters import CONSTRAINTS, PARAMETERS, SamplingParams
from tritonllm.interface.tensors import CACHE_TIERS, STORAGE_BACKEND
from tritonllm.adapter.concurrency import merge
from tritonllm.adapter.echo import Echo, echo_from_prompt_logprobs, echo_prompt_logprobs
from tritonllm.adapter.errors import (
    AdapterError,
    internal_error,
    invalid_request,
    model_not_found,
    parameter_not_enabled,
    unsupported_parameter,
)
from tritonllm.adapter.logprobs import LogprobsAccumulator, vllm_prompt_logprobs
from tritonllm.adapter.protocol import (
    CachedTokensDetails,
    CompletionChoice,
    CompletionTokensDetails,
    CompletionResponse,
    GenerationRequest,
    SPELLED_OTHERWISE,
    PromptTokensDetails,
    SglExt,
    StreamOptions,
    Usage,
)
from tritonllm.adapter.runtime_lora import RuntimeAdapters
from tritonllm.adapter.triton_client import ChoiceOutput, GenerateRequest, TritonChunk, TritonClient

logger = logging.getLogger(__name__)


def engine_prompt_logprobs(request: GenerationRequest) -> int | None:
    """The prompt logprobs the engine returns: what the echo needs or the client asked for, whichever is more
    (each use keeps the alternatives it needs); None: none."""
    return max((k for k in (echo_prompt_logprobs(request), request.prompt_logprobs) if k is not None), default=None)


def engine_parameters(request: GenerationRequest) -> SamplingParams:
    """The request's engine sampling parameters, every declared one (lora_path aside: it is each prompt's own),
    checked by their declaration: a value the engine would refuse is a 400 here with the same message, naming the
    parameter as the client spelled it."""
    values = {name: getattr(request, name) for name in PARAMETERS if name not in SPELLED_OTHERWISE}
    values |= {
        "logprobs": request.engine_logprobs(),
        "prompt_logprobs": engine_prompt_logprobs(request),
        "return_prompt_hidden_states": request.return_hidden_states and request.echo and request.echoes_prompt,
    }
    constraint = request.constraint()  # more than one → 400
    if constraint is not None:
        values[constraint.engine_field] = constraint.text
    try:
        params = SamplingParams.from_dict(values)
        if request.stream:
            params.check_streamable()
    except InvalidRequest as error:
        raise invalid_request(error.message, _api_name(request, error.param)) from None
    return params


def sampling_parameters(request: GenerationRequest) -> dict:
    """The engine's `sampling_parameters` JSON for a request (the same for each of its prompts): the parameters
    that differ from the engine's defaults, which keeps requests that use few of them plain."""
    return engine_parameters(request).non_defaults()


def _api_name(request: GenerationRequest, engine_field: str | None) -> str | None:
    """The request's spelling of an engine parameter (e.g. chat's top_logprobs for logprobs)."""
    constraint = request.constraint()
    if engine_field in CONSTRAINTS and constraint is not None:
        return constraint.param
    return request.api_name(engine_field)


class _ChoiceState:
    """One choice of the completion, built up from the responses of its Triton request."""

    def __init__(self, index: int, request: GenerationRequest) -> None:
        self.index = index
        self.finish_reason: str | None = None
        self.matched_stop: str | int | None = None
        self.num_output_tokens = 0
        self._text_parts: list[str] = []
        self._unsent_echo = _NO_ECHO
        self._logprobs = LogprobsAccumulator(request.return_tokens_as_token_ids) \
            if request.engine_logprobs() is not None else None
        self._hidden_states: list[list[float]] | None = [] if request.return_hidden_states else None
        self._routed_experts: list[list[list[int]]] | None = [] if request.return_routed_experts else None
        self._token_ids: list[int] | None = [] if request.return_token_ids else None
        self._tool_calls: list[dict] = []  # whole calls (a non-streamed response has them all)
        self._reasoning_parts: list[str] | None = None  # a reasoning model's chat: its reasoning
        self.num_reasoning_tokens: int | None = None
        self.prompt_token_ids: list[int] | None = None
        self._unsent_prompt_token_ids = False

    def echo(self, echo: Echo) -> None:
        """Put the prompt before the choice's text; it goes out with the next output."""
        self._unsent_echo = echo

    def set_prompt_token_ids(self, token_ids: list[int]) -> None:
        """The prompt's token ids (return_token_ids): they go out with the next output."""
        self.prompt_token_ids, self._unsent_prompt_token_ids = token_ids, True

    def echo_hidden_states(self, rows: list[list[float]]) -> None:
        """Put the prompt's hidden states before the choice's own."""
        self._hidden_states[:0] = rows

    def add(self, output: ChoiceOutput) -> CompletionChoice | None:
        """Record one response's output; returns what a stream chunk should carry, None if nothing new (hidden
        states are not streamed with the text: see `hidden_states_chunk`)."""
        if self.finish_reason is not None:
            # Responses keep listing a finished choice while its siblings run; it has one finish chunk only.
            return None
        text = self._unsent_echo.text + output.text
        entries = self._unsent_echo.logprobs + output.logprobs
        self._unsent_echo = _NO_ECHO
        if self._hidden_states is not None:
            self._hidden_states.extend(output.hidden_states)
        routed_experts = None
        if self._routed_experts is not None:
            routed_experts = output.routed_experts
            self._routed_experts.extend(routed_experts)
        token_ids = None
        if self._token_ids is not None:
            token_ids = output.token_ids
            self._token_ids.extend(token_ids)
        prompt_token_ids = self.prompt_token_ids if self._unsent_prompt_token_ids else None
        self._text_parts.append(text)
        self._tool_calls.extend(output.tool_calls)
        if output.reasoning is not None:
            self._reasoning_parts = (self._reasoning_parts or []) + [output.reasoning]
        if output.num_reasoning_tokens is not None:
            self.num_reasoning_tokens = output.num_reasoning_tokens  # (the total so far)
        self.finish_reason = output.finish_reason
        self.matched_stop = output.matched_stop
        self.num_output_tokens += output.num_output_tokens or 0
        logprobs = self._logprobs.add(entries) if self._logprobs else None
        if not (text or output.reasoning or entries or routed_experts or token_ids or prompt_token_ids
                or output.tool_calls) and self.finish_reason is None:
            return None
        self._unsent_prompt_token_ids = False
        return CompletionChoice(index=self.index, text=text, logprobs=logprobs, finish_reason=self.finish_reason,
                                matched_stop=self.matched_stop, routed_experts=routed_experts, token_ids=token_ids,
                                prompt_token_ids=prompt_token_ids, tool_calls=output.tool_calls,
                                reasoning_content=output.reasoning or None)

    def hidden_states_chunk(self) -> CompletionChoice | None:
        """SGLang's stream shape: a choice's hidden states come once its text has ended, in a chunk of their own
        (no text, no finish reason); None when it has none."""
        if not self._hidden_states:
            return None
        return CompletionChoice(index=self.index, text="", hidden_states=self._hidden_states)

    def whole(self, prompt_logprobs: list[dict | None] | None) -> CompletionChoice:
        return CompletionChoice(
            index=self.index,
            text="".join(self._text_parts),
            logprobs=self._logprobs.total if self._logprobs else None,
            prompt_logprobs=prompt_logprobs,
            finish_reason=self.finish_reason,
            matched_stop=self.matched_stop,
            hidden_states=self._hidden_states,
            routed_experts=self._routed_experts,
            token_ids=self._token_ids,
            prompt_token_ids=self.prompt_token_ids,
            tool_calls=self._tool_calls,
            reasoning_content="".join(self._reasoning_parts or ()) or None,
        )


_NO_ECHO = Echo("", [])


class CompletionAssembler:
    """Collects the Triton responses of one completion into OpenAI choices, chunks and usage."""

    def __init__(self, request: GenerationRequest) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self._created = int(time.time())
        self._model = request.model
        self._n = request.n
        self._logprobs = request.engine_logprobs()
        self._prompts = request.prompts()
        self._choices = [_ChoiceState(index, request) for index in range(len(self._prompts) * request.n)]
        # Prompts whose echo is built from the prompt logprobs of their first response carrying them.
        self._awaiting_echo: set[int] = set()
        if request.echo and echo_prompt_logprobs(request) is None:
            for prompt_index, prompt in enumerate(self._prompts):
                for state in self._choices_of(prompt_index):
                    state.echo(Echo(request.echoed_text(prompt), []))
        elif request.echo:
            self._awaiting_echo = set(range(len(self._prompts)))
        # vLLM's prompt_logprobs of each prompt, when asked for: given to each of its choices
        self._num_prompt_top = request.prompt_logprobs
        self._prompt_logprobs: list[list[dict | None] | None] = [None] * len(self._prompts)
        self._prompt_tokens = [0] * len(self._prompts)
        self._cached_tokens = [0] * len(self._prompts)
        self._cached_by_tier = [[0] * len(CACHE_TIERS) for _ in self._prompts]
        self._with_cache_details = request.return_cached_tokens_details
        self._with_routed_experts = request.return_routed_experts
        self._with_token_ids = request.return_token_ids

    def add(self, prompt_index: int, chunk: TritonChunk) -> list[CompletionChoice]:
        """Record a response to the request of prompt `prompt_index`; returns the choices with news."""
        if len(chunk.choices) > self._n:
            raise internal_error(f"Triton returned {len(chunk.choices)} choices for a request of n={self._n}.")
        if chunk.num_input_tokens is not None:
            self._prompt_tokens[prompt_index] = chunk.num_input_tokens
        if chunk.num_cached_tokens is not None:
            self._cached_tokens[prompt_index] = chunk.num_cached_tokens
        if chunk.cached_tokens_details is not None:
            self._cached_by_tier[prompt_index] = chunk.cached_tokens_details
        states = self._choices_of(prompt_index)
        if chunk.prompt_logprobs is not None and self._num_prompt_top is not None:
            self._prompt_logprobs[prompt_index] = vllm_prompt_logprobs(chunk.prompt_logprobs, self._num_prompt_top)
        if chunk.prompt_logprobs is not None and prompt_index in self._awaiting_echo:
            self._awaiting_echo.discard(prompt_index)
            echo = echo_from_prompt_logprobs(self._prompts[prompt_index], chunk.prompt_logprobs, self._logprobs)
            for state in states:
                state.echo(echo)
        if chunk.prompt_token_ids is not None and self._with_token_ids:
            for state in states:
                state.set_prompt_token_ids(chunk.prompt_token_ids)
        if chunk.prompt_hidden_states is not None:  # asked for only with echo
            for state in states:
                state.echo_hidden_states(chunk.prompt_hidden_states)
        updates = [state.add(output) for state, output in zip(states, chunk.choices)]
        return [choice for choice in updates if choice is not None]

    def _choices_of(self, prompt_index: int) -> list[_ChoiceState]:
        first = prompt_index * self._n
        return self._choices[first : first + self._n]

    def check_finished(self) -> None:
        """Every choice must have ended with a finish reason once all Triton requests have ended, and every
        echo that waits for prompt logprobs must have got them."""
        unfinished = [state.index for state in self._choices if state.finish_reason is None]
        if unfinished:
            raise internal_error(f"Triton ended the request without finishing choices {unfinished}.")
        if self._awaiting_echo:
            raise internal_error(f"Triton returned no prompt logprobs to echo prompts {sorted(self._awaiting_echo)}.")
        if self._num_prompt_top is not None and None in self._prompt_logprobs:
            raise internal_error("Triton returned no prompt logprobs for prompt_logprobs.")

    def usage(self) -> Usage:
        prompt_tokens = sum(self._prompt_tokens)
        completion_tokens = sum(state.num_output_tokens for state in self._choices)
        reasoning = [state.num_reasoning_tokens for state in self._choices if state.num_reasoning_tokens is not None]
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached_tokens)),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=sum(reasoning)) if reasoning else None,
        )

    def chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        cached = None
        if usage is not None and self._with_cache_details:
            device, host, storage = (sum(counts) for counts in zip(*self._cached_by_tier))
            cached = CachedTokensDetails(device=device, host=host, storage=storage,
                                         storage_backend=STORAGE_BACKEND if storage else None)
        routed = None
        if self._with_routed_experts and choices:
            routed = [[] for _ in self._choices]  # by choice index; a choice this chunk does not carry: none
            for choice in choices:
                routed[choice.index] = choice.routed_experts
        sglext = None if cached is None and routed is None else SglExt(cached_tokens_details=cached,
                                                                        routed_experts=routed)
        return CompletionResponse(id=self.id, created=self._created, model=self._model, choices=choices,
                                  usage=usage, sglext=sglext)

    def hidden_states_chunks(self) -> list[CompletionChoice]:
        """The trailing chunk choices of a stream with hidden states, one per choice."""
        return [choice for state in self._choices if (choice := state.hidden_states_chunk()) is not None]

    def response(self) -> CompletionResponse:
        self.check_finished()
        return self.chunk([state.whole(self._prompt_logprobs[state.index // self._n]) for state in self._choices],
                          self.usage())


class CompletionService:
    """Runs completion requests against the Triton model."""

    def __init__(self, triton: TritonClient, served_model_name: str, lora_enabled: bool = False,
                 runtime_adapters: RuntimeAdapters | None = None) -> None:
        self._triton = triton
        self._served_model_name = served_model_name
        self._lora_enabled = lora_enabled
        self._runtime_adapters = runtime_adapters or RuntimeAdapters(None, served_model_name, allowed=False)

    async def complete(self, request: GenerationRequest) -> CompletionResponse:
        """A whole (non-streamed) completion."""
        parameters = self._prompt_parameters(request)
        assembler = CompletionAssembler(request)
        async with aclosing(self._responses(request, parameters, assembler.id)) as responses:
            async for prompt_index, chunk in responses:
                assembler.add(prompt_index, chunk)
        return assembler.response()

    async def stream(self, request: GenerationRequest) -> AsyncIterator[CompletionResponse]:
        """The chunks of a streamed completion, one choice each (as OpenAI, vLLM and SGLang: clients read
        `choices[0]`); each choice gets exactly one chunk with a finish reason."""
        parameters = self._prompt_parameters(request)
        assembler = CompletionAssembler(request)
        options = request.stream_options or StreamOptions()
        async with aclosing(self._responses(request, parameters, assembler.id)) as responses:
            async for prompt_index, chunk in responses:
                for choice in assembler.add(prompt_index, chunk):
                    yield assembler.chunk([choice], assembler.usage() if options.continuous_usage_stats else None)
        assembler.check_finished()
        for choice in assembler.hidden_states_chunks():
            yield assembler.chunk([choice])
        if options.include_usage:
            yield assembler.chunk([], assembler.usage())

    def _prompt_parameters(self, request: GenerationRequest) -> list[dict]:
        """Each prompt's `sampling_parameters` (they differ by LoRA adapter only); refuses what the schema accepts
        but the engine or this service cannot do (yet)."""
        adapters = self._adapters(request)
        unsupported = request.unsupported_parameter()
        if unsupported is not None:
            raise unsupported_parameter(unsupported)
        ignored = request.ignored_vllm_parameters()
        if ignored:  # as vLLM's own deprecation warnings: the request runs
            logger.warning("ignoring the vLLM-only field(s) %s: they change nothing on this server", ", ".join(ignored))
        parameters = sampling_parameters(request)
        if request.stream and request.prompt_logprobs is not None:  # vLLM's rule: chunks carry none
            raise invalid_request("prompt_logprobs cannot be streamed: set stream to false.", "prompt_logprobs")
        if request.suffix:
            raise invalid_request(
                f"suffix is not supported: the model '{self._served_model_name}' has no fill-in-the-middle support.",
                "suffix",
            )
        return [parameters if adapter is None else {**parameters, "lora_path": adapter} for adapter in adapters]

    def _adapters(self, request: GenerationRequest) -> list[str | None]:
        """Each prompt's LoRA adapter (None: the base model), from `model: "<served>:<adapter>"` or `lora_path`;
        a runtime adapter's name (also alone as `model`, as vLLM) becomes its path inside the adapters directory.
        Whether an adapter exists is otherwise the engine's to say (it answers not found), as it owns the
        adapters directory."""
        runtime_path = self._runtime_adapters.path_of
        if runtime_path(request.model) is not None:
            base, colon, from_model = self._served_model_name, ":", request.model
        else:
            base, colon, from_model = request.model.partition(":")
        if base != self._served_model_name or (colon and not (from_model and self._lora_enabled)):
            raise model_not_found(request.model)
        count = len(request.prompts())
        lora_path = request.lora_path
        if lora_path in (None, "", []):
            return [(runtime_path(from_model) or from_model) if from_model else None] * count
        if not self._lora_enabled:
            raise parameter_not_enabled("lora_path")
        if from_model:
            raise invalid_request("Give the LoRA adapter either in 'model' or in 'lora_path', not both.", "lora_path")
        if isinstance(lora_path, str):
            return [runtime_path(lora_path) or lora_path] * count
        if len(lora_path) != count:
            raise invalid_request(f"lora_path has {len(lora_path)} entries for {count} prompts.", "lora_path")
        return [(runtime_path(path) or path) if path else None for path in lora_path]

    async def _responses(
        self, request: GenerationRequest, prompt_parameters: list[dict], completion_id: str
    ) -> AsyncIterator[tuple[int, TritonChunk]]:
        """Responses of all the prompts' Triton requests, run concurrently, tagged with the prompt index."""
        calls = [
            self._triton.generate(
                GenerateRequest(prompt, parameters, stream=request.stream,
                                return_logprobs=request.engine_logprobs() is not None,
                                return_token_ids=request.return_token_ids,
                                return_cached_tokens_details=request.return_cached_tokens_details,
                                prompt_options=request.prompt_options()),
                request_id=f"{completion_id}-{prompt_index}",
            )
            for prompt_index, (prompt, parameters) in enumerate(zip(request.prompts(), prompt_parameters))
        ]
        try:
            async with aclosing(merge(calls)) as responses:
                async for item in responses:
                    yield item
        except AdapterError as error:
            # The engine names its own fields: the client should see the one it sent.
            if error.code == "model_not_found" and not request.lora_path:
                error.param = "model"  # the unknown adapter came from the model name
            elif error.param is not None:
                error.param = _api_name(request, error.param)  # e.g. response_format for an invalid schema
            raise
