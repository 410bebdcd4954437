"""--model as a Hugging Face hub id: resolved through huggingface_hub into its cache, offline mode respected, one
clear line and exit 1 when it cannot be had. No hub is reached: the cache is filled by hand in the hub client's
layout (tests/hub_cache.py), and the network failure is a closed port."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tritonllm import model_files
from tritonllm.model_files import HubModel, HubModelError
from hub_cache import add_model_dir_to_hub_cache, add_to_hub_cache
from stack_helpers import REPO_ROOT, free_ports
from tiny_models import write_tiny_model

REPO_ID = "tritonllm-test/tiny-llama"


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama", default_model_dir, "llama")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, offline. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, at import: this
    process sets what it read (the CLI tests set the variables themselves, for a fresh process)."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize("text, expected", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", HubModel("HuggingFaceTB/SmolLM2-135M-Instruct")),
    ("org/name@v1.0", HubModel("org/name", revision="v1.0")),
    ("org/name:model-Q4_1.gguf", HubModel("org/name", gguf_file="model-Q4_1.gguf")),
    ("org/name@main:model-Q4_1.gguf", HubModel("org/name", revision="main", gguf_file="model-Q4_1.gguf")),
    ("./org/name", None), ("../org/name", None), ("~/name", None), ("/abs/name", None), ("a/b/c", None),
    ("org/name:weights.bin", None), ("model.gguf", None),
])
def test_hub_id_syntax(text, expected):
    assert HubModel.parse(text) == expected


def test_a_cached_hub_id_resolves_to_its_snapshot_offline(hub_cache, tiny_llama_dir):
    snapshot = add_model_dir_to_hub_cache(hub_cache, REPO_ID, tiny_llama_dir)
    model = model_files.resolve_model(REPO_ID)
    assert model.path == snapshot and model.name == REPO_ID  # served under the id as given, as vLLM does
    assert model_files.resolve_model_path(REPO_ID) == snapshot


def test_a_revision_picks_its_snapshot(hub_cache, tiny_llama_dir):
    main = add_model_dir_to_hub_cache(hub_cache, REPO_ID, tiny_llama_dir)
    tagged = add_model_dir_to_hub_cache(hub_cache, REPO_ID, tiny_llama_dir, revision="v1")
    assert main != tagged
    assert model_files.resolve_model(f"{REPO_ID}@v1") == model_files.Model(tagged, REPO_ID, HubModel(REPO_ID, "v1"))


def test_a_missing_hub_id_offline_names_the_id_and_the_offline_mode(hub_cache):
    with pytest.raises(HubModelError) as raised:
        model_files.resolve_model_path("tritonllm-test/not-cached")
    message = str(raised.value)
    assert "tritonllm-test/not-cached" in message and "HF_HUB_OFFLINE=1" in message and str(hub_cache) in message
    assert "\n" not in message


def test_a_gguf_only_repository_asks_for_the_file(hub_cache, tmp_path):
    gguf_only = tmp_path / "gguf-only"
    gguf_only.mkdir()
    (gguf_only / "README.json").write_text("{}")  # only GGUF files and metadata: no config.json
    add_model_dir_to_hub_cache(hub_cache, REPO_ID, gguf_only)
    with pytest.raises(HubModelError, match=f"name the file as {REPO_ID}:FILE.gguf"):
        model_files.resolve_model_path(REPO_ID)


def test_a_gguf_file_of_a_hub_repository_is_served_converted(hub_cache, default_model_dir, tmp_path, monkeypatch):
    """ORG/NAME:FILE.gguf takes that file from the cache and converts it once, into our cache. Its conversion is
    laid there first (the default model's, which is this very file): converting anew takes a minute here."""
    gguf = model_files.default_gguf_path()
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path / "tritonllm"))
    snapshot = add_to_hub_cache(hub_cache, REPO_ID, {gguf.name: gguf})
    converted = model_files.converted_gguf_dir(snapshot / gguf.name)
    converted.parent.mkdir(parents=True)
    converted.symlink_to(default_model_dir)
    model = model_files.resolve_model(f"{REPO_ID}:{gguf.name}")
    assert model.path == converted and model.name == REPO_ID
    with pytest.raises(HubModelError, match=f"{REPO_ID}:other.gguf is not in the Hugging Face cache"):
        model_files.resolve_model(f"{REPO_ID}:other.gguf")


def test_a_local_path_wins_over_a_hub_id(hub_cache, tiny_llama_dir, tmp_path, monkeypatch):
    add_model_dir_to_hub_cache(hub_cache, REPO_ID, tiny_llama_dir)
    local = tmp_path / REPO_ID
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert model_files.resolve_model(REPO_ID) == model_files.Model(local, "tiny-llama")


# --- the CLI, in a fresh process with the real environment variables --------------------------------------------

def _prepare(model: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tritonllm", "prepare", "--model", model], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}, capture_output=True, text=True,
                          timeout=120)


def _error_lines(done: subprocess.CompletedProcess) -> list[str]:
    """The CLI's error lines; a traceback fails the test on its own."""
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if " ERROR " in line]


def test_prepare_finds_a_hub_id_under_hf_home_offline(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snapshot = add_model_dir_to_hub_cache(tmp_path / "hf-home" / "hub", REPO_ID, tiny_llama_dir)
    done = _prepare(REPO_ID, {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert f"model ready at {snapshot}" in done.stderr


def test_prepare_of_a_missing_hub_id_offline_is_one_line_and_exit_1(tmp_path):
    done = _prepare("tritonllm-test/not-cached", {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    errors = _error_lines(done)
    assert len(errors) == 1, done.stderr
    assert "tritonllm-test/not-cached" in errors[0] and "HF_HUB_OFFLINE=1" in errors[0]


def test_prepare_without_network_is_one_line_and_exit_1(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    closed_port = free_ports(1)[0]  # nothing listens there: the connection is refused, as with no network
    done = _prepare("tritonllm-test/not-cached", {"HF_HUB_CACHE": str(tmp_path),
                                                  "HF_ENDPOINT": f"http://127.0.0.1:{closed_port}"})
    assert done.returncode == 1
    errors = _error_lines(done)
    assert len(errors) == 1, done.stderr
    assert "cannot get the Hugging Face hub model tritonllm-test/not-cached" in errors[0]


class _HubWithoutRepositories(BaseHTTPRequestHandler):
    """Answers every request as the hub answers for a repository that does not exist (or is private)."""

    def do_GET(self):
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_prepare_of_a_hub_id_that_does_not_exist_is_one_line_and_exit_1(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    hub = ThreadingHTTPServer(("127.0.0.1", 0), _HubWithoutRepositories)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    try:
        done = _prepare("tritonllm-test/no-such-model", {"HF_HUB_CACHE": str(tmp_path),
                                                         "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}"})
    finally:
        hub.shutdown()
    assert done.returncode == 1
    errors = _error_lines(done)
    assert len(errors) == 1, done.stderr
    assert "tritonllm-test/no-such-model" in errors[0] and "does not exist" in errors[0]
