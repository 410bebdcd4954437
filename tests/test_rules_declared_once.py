"""Each rule the adapter and the engine share is declared once (backend/interface); these tests walk the
declarations and check that both sides apply them alike: request parameters at their boundary values, the
streaming rule, chat roles, LoRA adapter names, error kinds across the wire, engine settings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.interface import errors, tensors
from backend.interface.errors import ErrorKind, InvalidRequest
from backend.interface.lora_names import available_adapters, resolve_adapter
from backend.interface.parameters import PARAMETERS
from backend.triton_io import parse_request
from openai_adapter.completions import check_parameters
from openai_adapter.errors import AdapterError
from openai_adapter.models import available_adapters as adapter_listing
from openai_adapter.protocol import ChatCompletionRequest, CompletionRequest
from openai_adapter.triton_client import _error_from_message


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
    try:
        check_parameters(request_type.model_validate({"model": "m", "prompt": "Hi", **body}))
        return None
    except AdapterError as error:
        assert error.status_code == 400
        return error.message, error.param


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
    messages = [{"role": role, "content": "Hi"}]
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
