"""Each rule the adapter and the engine share is declared once (tritonllm/interface); these tests walk the
declarations and check that both sides apply them alike: every request parameter reaches the engine through the
adapter, parameters at their boundary values, the streaming rule, chat roles, LoRA adapter names, error kinds
across the wire, engine settings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tritonllm.interface import errors, tensors
from tritonllm.interface.errors import ErrorKind, InvalidRequest
from tritonllm.interface.lora_names import available_adapters, resolve_adapter
from tritonllm.interface.parameters import PARAMETERS, Parameter, SamplingParams
from tritonllm.engine.triton_io import ParsedRequest, parse_request
from tritonllm.adapter.completions import CompletionService, engine_parameters
from tritonllm.adapter.errors import AdapterError
from tritonllm.adapter.models import available_adapters as adapter_listing
from tritonllm.adapter.protocol import SPELLED_OTHERWISE, ChatCompletionRequest, CompletionRequest
from tritonllm.adapter.triton_client import _error_from_message, _request_inputs
from tritonclient.grpc import InferInput
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype


def _engine(values: dict, stream: bool = False) -> str | None:
    """The engine's verdict on sampling_parameters: None (accepted) or the error message."""
    inputs = {"text_input": np.array([b"Hi"], dtype=np.object_),
              "sampling_parameters": np.array([json.dumps(values).encode()], dtype=np.object_),
              "stream": np.array([stream])}
    try:
        parse_request(inputs)
        return None
    except InvalidRequest as error:
        return error.message


def _adapter(body: dict, request_type=CompletionRequest) -> tuple[str | None, str | None]:
    """The adapter's verdict on a body: None or (message, param)."""
    prompt = {"prompt": "Hi"} if request_type is CompletionRequest else {}
    try:
        engine_parameters(request_type.model_validate({"model": "m", **prompt, **body}))
        return None
    except AdapterError as error:
        assert error.status_code == 400
        return error.message, error.param


def _engine_request(inputs: list[InferInput]) -> ParsedRequest:
    """What the engine makes of the tensors the adapter sends, decoded as tritonserver hands them to model.py."""
    arrays = {}
    for tensor in inputs:
        raw = tensor._get_content()
        array = deserialize_bytes_tensor(raw) if tensor.datatype() == "BYTES" else \
            np.frombuffer(raw, triton_to_np_dtype(tensor.datatype()))
        arrays[tensor.name()] = array.reshape(tensor.shape())
    return parse_request(arrays)


class _Sent(Exception):
    """The adapter sent its Triton request (the test needs no answer)."""


class EngineSide:
    """Stands in for TritonClient.generate: the adapter's real request tensors, parsed by the engine's parser."""

    def __init__(self) -> None:
        self.requests: list[ParsedRequest] = []

    async def generate(self, request, request_id):
        self.requests.append(_engine_request(_request_inputs(request)))
        raise _Sent
        yield  # (an async generator, like TritonClient.generate)


async def _engine_params(request_type, body: dict) -> SamplingParams:
    """The SamplingParams the engine gets for a request body sent through the adapter."""
    prompt = {"prompt": "Hi"} if request_type is CompletionRequest else {"messages": [{"role": "user", "content": "Hi"}]}
    request = request_type.model_validate({"model": "m", **prompt, **body})
    engine = EngineSide()
    with pytest.raises(_Sent):
        await CompletionService(engine, "m", lora_enabled=True).complete(request)
    [sent] = engine.requests
    return sent.params


def _non_default(parameter: Parameter):
    """A value of a parameter sent under its own name, other than its default, that passes its checks alone."""
    if parameter.kind == "bool":
        return not parameter.default
    if parameter.kind == "int":
        return (parameter.minimum or 0) + 2
    if parameter.kind == "float" and parameter.maximum is None:  # (e.g. length_penalty: any number)
        return parameter.default + 0.5
    if parameter.kind == "float":
        return (parameter.minimum + 3 * parameter.maximum) / 4
    return {"strings": ["x"], "token_ids": [5], "logit_bias": {"5": 1.5}, "string": "x",
            "json": '{"type": "object"}'}[parameter.kind]


STRUCTURAL_TAG = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
SPELLINGS = {
    # engine parameter spelled otherwise → (completions body, chat body or None: chat has none; the engine's value)
    "logprobs": ({"logprobs": 2}, {"logprobs": True, "top_logprobs": 2}, 2),
    "prompt_logprobs": ({"prompt_logprobs": 3}, None, 3),
    "json_schema": ({"response_format": {"type": "json_object"}}, ..., '{"type": "object"}'),
    "regex": ({"guided_regex": "[a-z]+"}, ..., "[a-z]+"),
    "ebnf": ({"guided_choice": ["yes", "no"]}, ..., 'start: "yes" | "no"'),
    "structural_tag": ({"response_format": {"type": "structural_tag", **STRUCTURAL_TAG}}, ...,
                       json.dumps({"type": "structural_tag", **STRUCTURAL_TAG})),
    "lora_path": ({"lora_path": "team/sql"}, ..., "team/sql"),
    "return_prompt_hidden_states": ({"return_hidden_states": True, "echo": True}, None, True),
}


def _walk(chat: bool) -> list:
    cases = []
    for name, parameter in PARAMETERS.items():
        if name in SPELLED_OTHERWISE:
            completion_body, chat_body, expected = SPELLINGS[name]
            body = completion_body if not chat or chat_body is ... else chat_body
        else:
            body = {name: _non_default(parameter)}
            expected = getattr(SamplingParams.from_dict(body), name)  # the engine's cast of the value
        if body is not None:
            cases.append(pytest.param(name, body, expected, id=name))
    return cases


@pytest.mark.parametrize("name, body, expected", _walk(chat=False))
async def test_every_parameter_reaches_the_engine_from_a_completion(name, body, expected):
    params = await _engine_params(CompletionRequest, body)
    assert expected != PARAMETERS[name].default and getattr(params, name) == expected


@pytest.mark.parametrize("name, body, expected", _walk(chat=True))
async def test_every_parameter_reaches_the_engine_from_a_chat(name, body, expected):
    params = await _engine_params(ChatCompletionRequest, body)
    assert expected != PARAMETERS[name].default and getattr(params, name) == expected


def _boundary_cases() -> list:
    cases = []
    for parameter in PARAMETERS.values():  # (each one the OpenAI API can send)
        if parameter.kind not in ("int", "float"):
            continue
        step = 1 if parameter.kind == "int" else 1e-3
        inside, outside = [], []
        if parameter.minimum is not None:
            (outside if parameter.exclusive_minimum else inside).append(parameter.minimum)
            outside.append(parameter.minimum - step)
        if parameter.maximum is not None:
            inside.append(parameter.maximum)
            outside.append(parameter.maximum + step)
        if parameter.special is not None:
            inside.append(parameter.special)
        cases += [pytest.param(parameter.name, value, True, id=f"{parameter.name}={value}") for value in inside]
        cases += [pytest.param(parameter.name, value, False, id=f"{parameter.name}={value}") for value in outside]
    return cases


def _with_companions(name: str, value) -> dict:
    """A body where only `name` decides (best_of must not fall below n, min_tokens not above max_tokens)."""
    body = {name: value}
    if name == "n":
        body["best_of"] = max(value, 1)
    if name == "min_tokens":
        body["max_tokens"] = None
    return body


@pytest.mark.parametrize("name, value, valid", _boundary_cases())
def test_both_sides_accept_and_refuse_the_same_boundary_values(name, value, valid):
    body = _with_companions(name, value)
    engine_verdict, adapter_verdict = _engine(body), _adapter(body)
    if valid:
        assert engine_verdict is None and adapter_verdict is None, (engine_verdict, adapter_verdict)
    else:
        assert engine_verdict is not None and adapter_verdict == (engine_verdict, name)


def test_api_spellings_are_named_in_errors():
    body = {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21,
            "max_completion_tokens": 5}
    message, param = _adapter(body, ChatCompletionRequest)
    assert param == "top_logprobs" and message == _engine({"logprobs": 21})
    assert "top_logprobs" in PARAMETERS["logprobs"].api_names


@pytest.mark.parametrize("body", [
    {"stop_regex": r"\p{L}+"},  # the engine's regex dialect: once refused by the adapter alone
    {"stop_regex": "("},
    {"json_schema": "{not json"},
    {"logit_bias": {"ab": 1}},
    {"n": 2, "best_of": 1},
    {"min_tokens": 5, "max_tokens": 2},
    {"top_k": 0},
])
def test_other_rules_agree(body):
    engine_verdict, adapter_verdict = _engine(body), _adapter(body)
    assert (engine_verdict is None) == (adapter_verdict is None), (engine_verdict, adapter_verdict)
    if engine_verdict is not None:
        assert adapter_verdict[0] == engine_verdict


def test_best_of_cannot_be_streamed_on_either_side():
    assert _engine({"n": 1, "best_of": 2}, stream=True) == _adapter({"n": 1, "best_of": 2, "stream": True})[0]
    assert _engine({"n": 2, "best_of": 2}, stream=True) is None and _adapter({"n": 2, "best_of": 2, "stream": True}) is None


@pytest.mark.parametrize("role", [*tensors.CHAT_ROLES, "wizard"])
def test_chat_roles_agree(role):
    messages = [{"role": role, "content": "Hi", **({"tool_call_id": "call_1"} if role == "tool" else {})}]
    try:
        ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
        adapter_ok = True
    except Exception:
        adapter_ok = False
    try:
        parse_request({"messages": np.array([json.dumps(messages).encode()], dtype=np.object_)})
        engine_ok = True
    except InvalidRequest:
        engine_ok = False
    assert adapter_ok == engine_ok == (role in tensors.CHAT_ROLES)


def test_adapter_names_are_the_same_on_both_sides(tmp_path):
    for name in ("alpha", "team/beta"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "adapter_config.json").write_text("{}")
    (tmp_path / "no-config").mkdir()
    assert adapter_listing is available_adapters  # one function, imported by the adapter
    assert available_adapters(tmp_path) == ["alpha", "team/beta"]
    assert resolve_adapter(tmp_path, "team/../team/beta") == "team/beta"


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_each_error_kind_reaches_the_client_with_its_declared_status(kind):
    message = errors.encode(kind, "something happened", "temperature")
    error = _error_from_message(f"in ensemble: {message}")
    assert (error.status_code, error.type, error.code) == (kind.wire.http_status, kind.wire.openai_type,
                                                           kind.wire.openai_code)
    assert error.message == "something happened" and error.param == "temperature"
    assert errors.decode(str(errors.RequestError("x"))).kind is ErrorKind.INTERNAL
