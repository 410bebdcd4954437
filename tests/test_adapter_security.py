"""API-key authentication, request limits and the OpenAPI document, with no engine behind the adapter.

As in test_adapter_protocol.py, Triton is down: a request that passes every check gets a 503.
"""

import pytest
from stack_helpers import free_ports
from fastapi.testclient import TestClient

from tritonllm.adapter import AdapterSettings, create_app

MODEL = "test-model"
KEY = "sk-test-key"
MAX_BODY_BYTES = 1024


def _client(**settings) -> TestClient:
    return TestClient(create_app(AdapterSettings(
        served_model_name=MODEL, triton_url=f"127.0.0.1:{free_ports(1)[0]}", request_timeout_s=5,
        health_timeout_s=0.5, **settings)))


@pytest.fixture(scope="module")
def client():
    with _client(api_key=KEY, max_body_bytes=MAX_BODY_BYTES, max_prompts=3, max_n=2, max_best_of=3,
                 max_tokens=100) as test_client:
        yield test_client


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    return response.json()["error"]


def _complete(client, headers=None, **fields):
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **fields}, headers=headers)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": KEY}, {"Authorization": "Bearer"}])
def test_api_routes_without_the_key_are_401(client, headers):
    vllm_routes = [client.post(route, json=body, headers=headers) for route, body in (
        ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]}), ("/invocations", {"prompt": "Hi"}),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"}), ("/v1/unload_lora_adapter", {"lora_name": "a"}))]
    for response in (_complete(client, headers=headers), client.get("/v1/models", headers=headers), *vllm_routes):
        error = _error(response, 401)
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert KEY not in error["message"]


def test_auth_comes_before_the_body_is_read(client):
    response = client.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1))
    _error(response, 401)


def test_the_right_key_passes_and_health_stays_open(client):
    _error(_complete(client), 503)  # reached Triton, which is down
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/health").status_code == 503  # open, not 401


def test_no_key_configured_means_no_auth():
    with _client() as open_client:
        assert open_client.get("/v1/models").status_code == 200
        assert open_client.get(f"/v1/models/{MODEL}").status_code == 200
        # the generation routes pass authentication too: they reach Triton, which is down
        for route, body in (("/v1/completions", {"prompt": "Hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            _error(open_client.post(route, json={"model": MODEL, **body}), 503)
            _error(open_client.post(route, json={"model": MODEL, **body},
                                    headers={"Authorization": "Bearer anything"}), 503)


def test_oversized_body_is_413_by_content_length(client):
    response = _complete(client, prompt="x" * MAX_BODY_BYTES)
    error = _error(response, 413)
    assert error["code"] == "request_too_large"


def test_oversized_chunked_body_is_413_while_reading(client):
    def chunks():  # no Content-Length: the limit must hold while the body streams in
        yield b'{"model": "test-model", "prompt": "'
        for _ in range(100):
            yield b"x" * 64
        yield b'"}'

    response = client.post("/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}"})
    _error(response, 413)


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
    ({"prompt": [[1], [2], [3], [4]]}, "prompt"),
    ({"n": 3, "best_of": 3}, "n"),
    ({"n": 2, "best_of": 4}, "best_of"),
    ({"max_tokens": 101}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
])
def test_limits_are_400_naming_the_param(client, fields, param):
    error = _error(_complete(client, **fields), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_requests_at_the_limits_pass(client):
    _error(_complete(client, prompt=["a", "b", "c"], n=2, best_of=3, max_tokens=100, logprobs=20), 503)


@pytest.mark.parametrize("body", [b'{"model": "\xff\xfe"}', b"\xff\xfe\x00", b"not json"])
def test_invalid_utf8_or_non_json_is_400(client, body):
    response = client.post("/v1/completions", content=body, headers={"Authorization": f"Bearer {KEY}"})
    assert _error(response, 400)["type"] == "invalid_request_error"


def test_openapi_describes_the_completions_route(client):
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/v1/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "prompt"} <= set(body["required"])
    assert body["properties"]["stream_options"]["anyOf"][0]["$ref"] == "#/components/schemas/StreamOptions"
    assert "StreamOptions" in schema["components"]["schemas"]
    assert set(operation["responses"]) == {"200", "400", "401", "404", "413", "503", "504"}
    ok = operation["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"] == "#/components/schemas/CompletionResponse"
    assert "text/event-stream" in ok
    assert operation["responses"]["413"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert operation["security"] == [{"HTTPBearer": []}, {"APIKeyHeader": []}]  # either one
    assert "security" not in schema["paths"]["/health"]["get"]


def test_metrics_are_open_by_default_and_behind_the_key_when_asked(client):
    assert client.get("/metrics").status_code == 200  # as vLLM: a scraper needs no key unless told
    with _client(api_key=KEY, metrics_require_key=True) as keyed:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error = _error(keyed.get("/metrics", headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert "tritonllm_adapter" in keyed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        assert keyed.get("/health").status_code == 503  # open (Triton is down), never 401


def test_openapi_describes_the_messages_routes_with_anthropics_errors(client):
    schema = client.get("/openapi.json").json()
    for path, response in (("/v1/messages", "MessageResponse"), ("/v1/messages/count_tokens", "CountTokensResponse")):
        operation = schema["paths"][path]["post"]
        assert {"model", "messages"} <= set(operation["requestBody"]["content"]["application/json"]["schema"][
            "required"])
        assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response)
        assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "AnthropicErrorResponse")


def test_anthropic_clients_authenticate_with_x_api_key(client):
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    assert client.post("/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 503  # Triton is down
    refused = client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/messages", json=body).json()["type"] == "error"
    _error(_complete(client, headers={"x-api-key": KEY}), 503)  # the OpenAI routes take it too
