"""The API key guards every door of a real stack: `tritonllm serve --api-key-file KEY --metrics-require-key` (one
start for the module). Triton's own HTTP and gRPC APIs refuse a tritonclient call without the key's header and
serve it with the header (inference, model configuration, the model repository); health stays open for probes;
the adapter and the examples send the header; no process shows the key on its command line, and tritonserver does
not get it in its environment either; the adapter's /metrics asks for the key."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from stack_helpers import (EXACT_OPTIONS, REPO_ROOT, command_line, descendant_pids, grpc_generate, running_stack)
from tritonllm.interface.api_key import API_KEY_ENV, triton_headers, triton_secret

KEY = "sk-stack-security-test-key"
HEADERS = triton_headers(KEY)
PROMPT = "The capital of France is"
PARAMS = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keyed_process(default_model_dir, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("keyed-stack")
    key_file = state_dir / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    with running_stack(default_model_dir, state_dir, *EXACT_OPTIONS, "--kv-cache-memory", "64MiB",
                       "--api-key-file", str(key_file), "--metrics-require-key", "true") as started:
        yield started


@pytest.fixture(scope="module")
def keyed(keyed_process):
    return keyed_process.stack


def _refused(error: Exception | None) -> bool:
    return error is not None and "restricted" in str(error) and KEY not in str(error)


def test_triton_grpc_inference_needs_the_header(keyed):
    responses, error = grpc_generate(keyed, PROMPT, PARAMS, stream=False)
    assert _refused(error) and not responses
    responses, error = grpc_generate(keyed, PROMPT, PARAMS, stream=False, headers={"tritonllm-key": KEY})
    assert _refused(error), "the key itself is not Triton's header value"
    responses, error = grpc_generate(keyed, PROMPT, PARAMS, stream=False, headers=HEADERS)
    assert error is None and responses[-1].as_numpy("text_output")[0].decode()


def test_triton_http_inference_needs_the_header(keyed):
    url = f"http://{keyed.http_url}/v2/models/llm/generate"
    body = {"text_input": PROMPT, "exclude_input_in_output": True, "sampling_parameters": '{"max_tokens": 4}'}
    refused = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 403 and "restricted" in refused.text
    served = httpx.post(url, json=body, headers=HEADERS, timeout=60)
    assert served.status_code == 200 and served.json()["text_output"]


@pytest.mark.parametrize("protocol", [grpcclient, httpclient], ids=["grpc", "http"])
def test_tritonclient_metadata_and_config_need_the_header_and_health_stays_open(keyed, protocol):
    client = protocol.InferenceServerClient(keyed.grpc_url if protocol is grpcclient else keyed.http_url)
    try:
        assert client.is_server_ready() and client.is_model_ready("llm")  # probes need no key
        for call in (client.get_server_metadata, lambda **kw: client.get_model_config("llm", **kw),
                     lambda **kw: client.get_model_repository_index(**kw)):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
            assert call(headers=HEADERS)
    finally:
        client.close()


@pytest.mark.parametrize("protocol", [grpcclient, httpclient], ids=["grpc", "http"])
def test_the_model_repository_unload_is_refused_without_the_header(keyed, protocol):
    client = protocol.InferenceServerClient(keyed.grpc_url if protocol is grpcclient else keyed.http_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("llm")
        assert client.is_model_ready("llm")
    finally:
        client.close()


def test_the_adapter_asks_for_the_key_and_sends_triton_its_header(keyed):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base_url, api_key="wrong", max_retries=0).models.list()
    # served end to end: the adapter's gRPC call passed Triton's restriction
    client = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0, timeout=120)
    completion = client.completions.create(model=keyed.model_name, prompt=PROMPT, **PARAMS)
    assert completion.choices[0].text and completion.usage.completion_tokens == 4


def test_metrics_need_the_key_when_asked_and_health_never(keyed):
    root = keyed.base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{root}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    keyed_metrics = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert keyed_metrics.status_code == 200 and "tritonllm:num_requests_running" in keyed_metrics.text
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200


def test_no_command_line_shows_the_key_and_tritonserver_never_gets_it(keyed_process):
    pids = [keyed_process.process.pid, *descendant_pids(keyed_process.process.pid)]
    lines = {pid: "\0".join(command_line(pid)) for pid in pids}
    assert not [line for line in lines.values() if KEY in line]
    [server] = [pid for pid, line in lines.items() if line.split("\0")[0].endswith("tritonserver")]
    # what ps shows tritonserver: the derived value, on every API but health
    assert f"--grpc-restricted-protocol=metadata,inference,shared-memory,model-config,model-repository," \
           f"statistics,trace,logging:tritonllm-key={triton_secret(KEY)}" in lines[server].split("\0")
    for pid in pids[1:]:  # tritonserver, its stubs and their watchdogs
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:  # ended meanwhile
            continue
        assert KEY.encode() not in environ and f"{API_KEY_ENV}=".encode() not in environ


@pytest.mark.parametrize("example, url", [("grpc_stream.py", "grpc"), ("http_generate.py", "http")])
def test_the_examples_send_the_header(keyed, example, url):
    address = keyed.grpc_url if url == "grpc" else f"http://{keyed.http_url}"
    command = [sys.executable, str(REPO_ROOT / "examples" / example), "--url", address, "--max-tokens", "3", PROMPT]
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "restricted" in (refused.stdout + refused.stderr).lower()
    served = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**env, API_KEY_ENV: KEY})
    assert served.returncode == 0 and served.stdout.strip(), served.stderr
