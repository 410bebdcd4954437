"""The adapter's HTTP contract where no engine is needed: validation, error shapes and statuses.

The app points at a port nothing listens on, so any request that passes validation meets a Triton that is
down, which must be a quick 503.
"""

import time

import pytest
from stack_helpers import free_ports
from fastapi.testclient import TestClient

from tritonllm.adapter import AdapterSettings, create_app

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
        ("temperature", -0.1),
        ("n", 0),
        ("n", 1.5),
        ("logprobs", 21),
        ("logprobs", -1),
        ("top_p", 0),
        ("top_p", 1.01),
        ("max_tokens", -1),
        ("stop", 3),
        ("echo", "sometimes"),
        ("stream_options", {"include_usage": "maybe"}),
        ("prompt", []),
        ("prompt", [[]]),
        ("prompt", [1, "a"]),
        ("prompt", [-5]),
        ("prompt", {"text": "Hello"}),
        ("frequency_penalty", 2.1),
        ("frequency_penalty", -2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", "lots"),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.5),
        ("logit_bias", {"50256": 101}),
        ("logit_bias", {"50256": -100.5}),
        ("logit_bias", {"-1": 5}),
        ("logit_bias", {"the": 5}),
        ("logit_bias", {"1.5": 5}),
        ("logit_bias", [1, 2]),
        ("stop_regex", "(unclosed"),
        ("stop_regex", ["ok", "[z-a]"]),
        ("stop_regex", 5),
        ("no_stop_trim", "perhaps"),
        ("best_of", 0),
        ("best_of", "two"),
        ("user", 7),
    ],
)
def test_wrong_value_is_400_naming_the_field(client, field, value):
    error = _error(_complete(client, **{field: value}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 3, "best_of": 2},
        {"n": 2, "best_of": 3, "stream": True},
    ],
)
def test_best_of_below_n_or_streamed_above_n_is_400(client, fields):
    error = _error(_complete(client, **fields), 400)
    assert error["param"] == "best_of"
    assert "best_of" in error["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("include_stop_str_in_output", True),
    ],
)
def test_not_yet_supported_parameter_is_400(client, field, value):
    error = _error(_complete(client, **{field: value}), 400)
    assert error["param"] == field
    assert "not supported" in error["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"regex": "[0-9]+", "ebnf": "start: \"a\""}, "ebnf"),
        ({"response_format": {"type": "json_object"}, "json_schema": "{}"}, "json_schema"),
        ({"guided_choice": ["a", "b"], "regex": "a|b"}, "guided_choice"),
    ],
)
def test_two_constraints_at_once_are_400(client, fields, param):
    error = _error(_complete(client, **fields), 400)
    assert error["param"] == param
    assert "Only one of" in error["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": "[1, 2]"}, "json_schema"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_malformed_constraint_is_400(client, fields, param):
    assert _error(_complete(client, **fields), 400)["param"] == param


def test_text_response_format_is_no_constraint(client):
    """{"type": "text"} constrains nothing, so it may go with a regex; the request then reaches Triton (down)."""
    response = _complete(client, response_format={"type": "text"}, regex="[a-z]+")
    assert _error(response, 503)


@pytest.mark.parametrize("value", ["adapter", ["a", None]])
def test_lora_path_without_an_adapters_directory_is_400(client, value):
    error = _error(_complete(client, lora_path=value), 400)
    assert error["param"] == "lora_path"
    assert "not enabled on this server" in error["message"]


def test_adapter_model_name_without_an_adapters_directory_is_404(client):
    error = _error(_complete(client, model=f"{MODEL}:adapter"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")


def test_suffix_is_400_naming_fill_in_the_middle(client):
    error = _error(_complete(client, suffix="end"), 400)
    assert error["param"] == "suffix"
    assert "fill-in-the-middle" in error["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"best_of": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0},
        {"logit_bias": {}, "suffix": None, "no_stop_trim": False, "lora_path": None},
        {"suffix": "", "return_hidden_states": False, "stop_regex": []},
        {"user": "alice", "service_tier": "auto", "store": False, "metadata": {"team": "a"}},
        {"temperature": None, "n": None, "stop": None, "max_tokens": None, "logprobs": None, "best_of": None},
        {"frequency_penalty": -2, "presence_penalty": 2, "repetition_penalty": 2, "logit_bias": {"0": -100}},
        {"logit_bias": {"50256": 100, "007": 1.5}, "stop_regex": r"\d+\.", "no_stop_trim": True},
        {"n": 2, "best_of": 2, "stream": True},
        {"n": 2, "best_of": 4, "temperature": 0.0, "top_p": 1e-3},
        {"echo": True, "logprobs": 5},
        {"echo": True, "prompt": [[1, 2], [3]], "logprobs": 0, "stream": True},
    ],
)
def test_valid_neutral_and_ignored_fields_are_accepted(client, fields):
    # Accepted means the request got as far as Triton, which is down here.
    _error(_complete(client, **fields), 503)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
@pytest.mark.parametrize("field", ["some_extra_body_field", "temprature", "suffix_text"])
def test_unknown_field_is_400_naming_it(client, route, body, field):
    """As OpenAI: a field this server does not know is refused, not ignored (a misspelt parameter would
    otherwise be dropped silently); a null one too."""
    for value in ({"x": 1}, None):
        error = _error(client.post(route, json={"model": MODEL, **body, field: value}), 400)
        assert (error["param"], error["message"]) == (field, f"Unrecognized request argument supplied: {field}")


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
])
def test_vllm_legacy_fields_are_ignored_with_a_warning(client, route, body, caplog):
    """vLLM's own suite still sends guided_decoding_backend, which vLLM tolerates: the request runs (here as far as
    Triton, which is down), and the log says the field changed nothing."""
    fields = {"guided_decoding_backend": "xgrammar", "mm_processor_kwargs": {"num_crops": 4}}
    with caplog.at_level("WARNING", logger="tritonllm.adapter.completions"):
        _error(client.post(route, json={"model": MODEL, **body, **fields}), 503)
    assert "guided_decoding_backend, mm_processor_kwargs" in caplog.text


@pytest.mark.parametrize("field, value", [("user", 7), ("store", "maybe"), ("metadata", ["a"]),
                                          ("guided_decoding_backend", 3)])
def test_ignored_fields_still_have_their_type_checked(client, field, value):
    assert _error(_complete(client, **{field: value}), 400)["param"] == field


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
    assert body["data"] == [{"id": MODEL, "object": "model", "created": body["data"][0]["created"], "owned_by": "tritonllm",
                             "root": MODEL}]  # SGLang's root: the served name, even with Triton down


def test_one_model_is_retrieved_by_id_and_others_are_404(client):
    listed = client.get("/v1/models").json()["data"][0]
    assert client.get(f"/v1/models/{MODEL}").json() == listed
    error = _error(client.get("/v1/models/gpt-4"), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
