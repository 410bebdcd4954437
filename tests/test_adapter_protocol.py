"""The adapter's HTTP contract where no engine is needed: validation, error shapes and statuses.

The app points at a port nothing listens on, so any request that passes validation meets a Triton that is
down, which must be a quick 503.
"""

import time

import pytest
from conftest import free_ports
from fastapi.testclient import TestClient

from openai_adapter import AdapterSettings, create_app

MODEL = "test-model"
HEALTH_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def client():
    settings = AdapterSettings(
        served_model_name=MODEL,
        triton_url=f"127.0.0.1:{free_ports(1)[0]}",
        request_timeout_s=5,
        health_timeout_s=HEALTH_TIMEOUT_S,
    )
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def _complete(client, **fields):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", **fields})


def test_malformed_json_is_400(client):
    response = client.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"null", b""])
def test_body_that_is_not_an_object_is_400(client, body):
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert _error(response, 400)["type"] == "invalid_request_error"


def test_missing_prompt_is_400_naming_it(client):
    response = client.post("/v1/completions", json={"model": MODEL})
    error = _error(response, 400)
    assert error["param"] == "prompt"
    assert error["code"] is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", "hot"),
        ("temperature", 2.5),
        ("n", 0),
        ("logprobs", 21),
        ("top_p", 0),
        ("max_tokens", -1),
        ("stop", 3),
        ("stream_options", {"include_usage": "maybe"}),
        ("prompt", []),
        ("prompt", [[]]),
        ("prompt", [1, "a"]),
        ("prompt", [-5]),
        ("prompt", {"text": "Hello"}),
    ],
)
def test_wrong_value_is_400_naming_the_field(client, field, value):
    error = _error(_complete(client, **{field: value}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field


@pytest.mark.parametrize(
    "field, value",
    [
        ("best_of", 2),
        ("suffix", "end"),
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1.0),
        ("repetition_penalty", 1.1),
        ("logit_bias", {"50256": -100}),
        ("stop_regex", "a+"),
        ("no_stop_trim", True),
        ("response_format", {"type": "json_object"}),
        ("json_schema", "{}"),
        ("regex", "[0-9]+"),
        ("ebnf", "root ::= 'a'"),
        ("lora_path", "adapter"),
        ("return_hidden_states", True),
        ("return_routed_experts", True),
    ],
)
def test_not_yet_supported_parameter_is_400(client, field, value):
    error = _error(_complete(client, **{field: value}), 400)
    assert error["param"] == field
    assert "not supported" in error["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0},
        {"logit_bias": {}, "suffix": None, "no_stop_trim": False},
        {"some_extra_body_field": {"x": 1}, "user": "alice"},
        {"temperature": None, "n": None, "stop": None, "max_tokens": None, "logprobs": None},
    ],
)
def test_neutral_and_unknown_fields_are_accepted(client, fields):
    # Accepted means the request got as far as Triton, which is down here.
    _error(_complete(client, **fields), 503)


def test_echo_with_logprobs_is_400(client):
    assert _error(_complete(client, echo=True, logprobs=1), 400)["param"] == "echo"


def test_echo_of_token_ids_is_400(client):
    assert _error(_complete(client, prompt=[1, 2, 3], echo=True), 400)["param"] == "echo"


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(client, stream):
    error = _error(_complete(client, model="gpt-4", stream=stream), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


def test_unknown_route_is_404(client):
    assert _error(client.get("/v1/nothing-here"), 404)["type"] == "invalid_request_error"


def test_wrong_method_is_405(client):
    response = client.get("/v1/completions")
    _error(response, 405)
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize("stream", [False, True])
def test_triton_down_is_503_with_retry_after(client, stream):
    response = _complete(client, stream=stream)
    error = _error(response, 503)
    assert "unavailable" in error["message"]
    assert int(response.headers["retry-after"]) > 0


def test_health_when_triton_is_down_is_quick_503(client):
    started = time.monotonic()
    response = client.get("/health")
    assert time.monotonic() - started < HEALTH_TIMEOUT_S + 0.5
    _error(response, 503)


def test_models_lists_the_served_model(client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert body["data"] == [{"id": MODEL, "object": "model", "created": body["data"][0]["created"], "owned_by": "tritonllm"}]
