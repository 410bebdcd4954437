"""vLLM's runtime LoRA routes in front of a Triton that is down: what the adapter refuses before any engine
reads the adapter (the loads that reach one: tests/test_stack_lora.py)."""

import json

import pytest
from fastapi.testclient import TestClient
from stack_helpers import free_ports

from tritonllm.adapter import AdapterSettings, create_app
from tritonllm.adapter.runtime_lora import VLLM_ENV

MODEL = "test-model"
KEY = "sk-test-key"


@pytest.fixture
def lora_dir(tmp_path):
    (tmp_path / "alpha").mkdir()
    (tmp_path / "alpha" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return tmp_path


def _client(**settings) -> TestClient:
    return TestClient(create_app(AdapterSettings(
        served_model_name=MODEL, triton_url=f"127.0.0.1:{free_ports(1)[0]}", request_timeout_s=5, **settings)))


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_disabled_by_default_as_vllm_without_its_variable(lora_dir, monkeypatch):
    monkeypatch.delenv(VLLM_ENV, raising=False)
    with _client(lora_dir=str(lora_dir)) as client:
        for route, body in (("load", {"lora_name": "a", "lora_path": "alpha"}), ("unload", {"lora_name": "a"})):
            error = _error(client.post(f"/v1/{route}_lora_adapter", json=body), 404)
            assert "--allow-runtime-lora" in error["message"] and VLLM_ENV in error["message"]


@pytest.mark.parametrize("enable", [{"allow_runtime_lora": True}, {VLLM_ENV: "True"}, {VLLM_ENV: "1"}])
def test_enabled_by_the_setting_or_vllms_variable(lora_dir, monkeypatch, enable):
    monkeypatch.delenv(VLLM_ENV, raising=False)
    if VLLM_ENV in enable:
        monkeypatch.setenv(VLLM_ENV, enable.pop(VLLM_ENV))
    with _client(lora_dir=str(lora_dir), **enable) as client:
        # past every check of the adapter, to the engine's reading of the files: Triton is down
        _error(client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "alpha"}), 503)
        error = _error(client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}), 404)
        assert error["message"] == "The lora adapter 'a' cannot be found." and error["param"] == "lora_name"
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [MODEL, f"{MODEL}:alpha"]


def test_needs_the_adapters_directory(monkeypatch):
    monkeypatch.delenv(VLLM_ENV, raising=False)
    with _client(allow_runtime_lora=True) as client:
        error = _error(client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "alpha"}), 400)
        assert "--lora-dir" in error["message"] and error["param"] == "lora_path"


@pytest.mark.parametrize("body, param", [({"lora_name": MODEL, "lora_path": "alpha"}, "lora_name"),
                                         ({"lora_name": "a", "lora_path": "/etc"}, "lora_path"),
                                         ({"lora_name": "a", "lora_path": ["alpha"]}, "lora_path"),
                                         ({"lora_name": "a"}, "lora_path")])
def test_bad_loads_are_400_naming_the_field(lora_dir, body, param):
    with _client(lora_dir=str(lora_dir), allow_runtime_lora=True) as client:
        assert _error(client.post("/v1/load_lora_adapter", json=body), 400)["param"] == param


def test_behind_the_api_key(lora_dir):
    with _client(lora_dir=str(lora_dir), allow_runtime_lora=True, api_key=KEY) as client:
        body = {"lora_name": "a", "lora_path": "alpha"}
        assert _error(client.post("/v1/load_lora_adapter", json=body), 401)["code"] == "invalid_api_key"
        _error(client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY}"}), 503)


def test_openapi_describes_the_routes(lora_dir):
    with _client(lora_dir=str(lora_dir), allow_runtime_lora=True) as client:
        paths = client.get("/openapi.json").json()["paths"]
    load = paths["/v1/load_lora_adapter"]["post"]
    assert load["requestBody"]["content"]["application/json"]["schema"]["required"] == ["lora_name", "lora_path"]
    assert "text/plain" in load["responses"]["200"]["content"]
    assert all(set(load["responses"][status]["content"]) == {"application/json"} for status in ("400", "404", "503"))
    assert set(paths["/v1/unload_lora_adapter"]["post"]["responses"]) == {"200", "400", "404", "503"}
