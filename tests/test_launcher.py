"""The launcher side: model resolution, config.pbtxt parameters, tritonserver discovery and layout, the CLI,
and one real tritonserver run with a stand-in decoupled model."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import queue
import re
import socket
import sys
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tritonllm import launcher, model_files
from tritonllm.engine.config import EngineConfig, InstanceGroup
from tritonllm.interface import settings
from tritonllm.interface import tensors
from stack_helpers import free_ports
from tritonllm import cli, scale_out
from tritonllm.gateway import GatewaySettings, gateway_command

# --- config.pbtxt parameters ---------------------------------------------------------------------------------

CONFIG = '''name: "llm"
parameters { key: "model_path" value: { string_value: "" } }
parameters {
  key: "dtype"
  value: { string_value: "auto" }
}
parameters { key: "block_size" value: { string_value: "16" } }
'''


def _parameters(config_text: str) -> dict[str, str]:
    pattern = r'parameters\s*\{\s*key:\s*"([^"]*)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"\s*\}\s*\}'
    return {key: value for key, value in re.findall(pattern, config_text)}


def test_set_parameters_replaces_existing_entries_in_place():
    text = launcher.set_pbtxt_parameters(CONFIG, {"model_path": "/models/x", "dtype": "float16"})
    assert _parameters(text) == {"model_path": "/models/x", "dtype": "float16", "block_size": "16"}
    assert text.index("model_path") < text.index("dtype") < text.index("block_size")
    assert text.count("parameters") == 3


def test_set_parameters_appends_new_keys_and_is_idempotent():
    once = launcher.set_pbtxt_parameters(CONFIG, {"max_num_seqs": "8"})
    assert _parameters(once)["max_num_seqs"] == "8"
    assert launcher.set_pbtxt_parameters(once, {"max_num_seqs": "8"}) == once


def test_set_parameters_escapes_quotes_and_backslashes():
    text = launcher.set_pbtxt_parameters(CONFIG, {"model_path": 'C:\\a "b"'})
    assert 'string_value: "C:\\\\a \\"b\\""' in text
    # A second substitution still finds the entry despite the escaped quotes.
    assert _parameters(launcher.set_pbtxt_parameters(text, {"model_path": "/m"}))["model_path"] == "/m"


def test_engine_parameters_are_written_from_the_one_declaration(tmp_path):
    """The checked-in config.pbtxt holds no engine parameter (no second copy of the settings); the written
    repository holds every EngineConfig setting, and reads back as the same config."""
    source = (launcher.SOURCE_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    assert _parameters(source) == {} and "decoupled: true" in source
    config = EngineConfig(max_num_seqs=5, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    repository = launcher.write_model_repository(tmp_path / "repo", config.to_strings())
    written = _parameters((repository / "llm" / "config.pbtxt").read_text())
    assert set(written) == {field.name for field in dataclasses.fields(EngineConfig)}
    assert EngineConfig.from_strings(written) == config


def test_tensor_names_agree_with_config_pbtxt():
    source = (launcher.SOURCE_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    declared = re.findall(r'name:\s*"(\w+)"', source)
    assert declared == ["llm", *tensors.INPUTS, *tensors.OUTPUTS]


def test_write_model_repository(tmp_path):
    source = _stand_in_source(tmp_path / "source", "")
    repository = launcher.write_model_repository(tmp_path / "repo", {"kv_cache_memory": "64MiB"}, source=source)
    model_py = repository / "llm" / "1" / "model.py"
    assert model_py.is_symlink() and model_py.resolve() == (source / "llm" / "1" / "model.py").resolve()
    assert _parameters((repository / "llm" / "config.pbtxt").read_text())["kv_cache_memory"] == "64MiB"


def _instance_group(config_text: str) -> str:
    [line] = [line for line in config_text.splitlines() if line.startswith("instance_group")]
    return line


def test_instance_group_is_written_from_its_declaration(tmp_path):
    """The checked-in entry is the declared default; --instances and --gpus rewrite it."""
    source = (launcher.SOURCE_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    assert _instance_group(source) == InstanceGroup().to_pbtxt() == "instance_group [{ count: 1, kind: KIND_MODEL }]"
    for instances, expected in [
        (InstanceGroup(instances=2), "instance_group [{ count: 2, kind: KIND_MODEL }]"),
        (InstanceGroup(gpus="0,1"), "instance_group [{ count: 1, kind: KIND_GPU, gpus: [ 0, 1 ] }]"),
    ]:
        repository = launcher.write_model_repository(tmp_path / "repo", {}, instances)
        assert _instance_group((repository / "llm" / "config.pbtxt").read_text()) == expected


@pytest.mark.parametrize("option, value", [("--instances", "0"), ("--gpus", "0,0"), ("--gpus", "cuda:0")])
def test_instance_group_options_refuse_what_triton_cannot_place(option, value):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", option, value])
    assert cli.build_parser().parse_args(["serve", "--gpus", " 2, 3"]).gpus == "2,3"


def test_each_tritonserver_names_its_own_shared_memory_regions(tmp_path):
    """Python-backend stubs of two tritonservers on one host must not share /dev/shm regions."""
    commands = [launcher.TritonServer(tmp_path, tmp_path, grpc_port=port, tritonserver=Path("/bin/true"))
                ._command(tmp_path) for port in (8001, 9001)]
    options = [[arg for arg in command if arg.startswith("--backend-config=python,shm-region-prefix-name=")]
               for command in commands]
    assert options == [["--backend-config=python,shm-region-prefix-name=tritonllm_8001_"],
                       ["--backend-config=python,shm-region-prefix-name=tritonllm_9001_"]]


# --- tritonserver discovery and environment ---------------------------------------------------------------------

def _fake_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_tritonserver_env_var_wins(tmp_path, monkeypatch):
    configured = _fake_executable(tmp_path / "env" / "tritonserver")
    _fake_executable(tmp_path / "path" / "tritonserver")
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setenv("TRITONSERVER", str(configured))
    assert launcher.find_tritonserver() == configured


def test_find_tritonserver_path_before_wheel(tmp_path, monkeypatch):
    on_path = _fake_executable(tmp_path / "path" / "tritonserver")
    monkeypatch.delenv("TRITONSERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert launcher.find_tritonserver() == on_path


def test_find_tritonserver_falls_back_to_the_wheel(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITONSERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    found = launcher.find_tritonserver()
    assert found.parts[-4:] == ("pytriton", "tritonserver", "bin", "tritonserver")


def test_find_tritonserver_rejects_a_missing_env_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONSERVER", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="TRITONSERVER"):
        launcher.find_tritonserver()


def _wheel_tritonserver() -> Path:
    spec = importlib.util.find_spec("pytriton")
    return Path(spec.origin).parent / "tritonserver" / "bin" / "tritonserver"


def test_backend_dir_for_the_wheel_links_the_stub_of_this_python(tmp_path):
    tritonserver = _wheel_tritonserver()
    backend_dir = launcher.build_backend_dir(tritonserver, tmp_path)
    python_dir = backend_dir / "python"
    names = sorted(path.name for path in python_dir.iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    stub = (python_dir / "triton_python_backend_stub").resolve()
    assert stub.parent.name == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert all(path.exists() for path in python_dir.iterdir())
    # Rebuilding over an existing one works (serve runs again with the same state dir).
    assert launcher.build_backend_dir(tritonserver, tmp_path) == backend_dir


def test_backend_dir_for_an_ngc_install_is_its_own(tmp_path):
    tritonserver = _fake_executable(tmp_path / "opt" / "tritonserver" / "bin" / "tritonserver")
    (tmp_path / "opt" / "tritonserver" / "backends" / "python").mkdir(parents=True)
    assert launcher.build_backend_dir(tritonserver, tmp_path / "state") == tmp_path / "opt" / "tritonserver" / "backends"
    assert not (tmp_path / "state").exists()


def test_server_env_runs_stubs_on_this_interpreter():
    env = launcher.server_env(_wheel_tritonserver())
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    library_dirs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert library_dirs[0] == sysconfig.get_config_var("LIBDIR")
    assert any(Path(directory).name == "nvidia_pytriton.libs" for directory in library_dirs)
    assert env["PYTHONUTF8"] == "1"


def test_the_engine_gets_huge_pages_for_its_large_buffers_unless_told_otherwise(monkeypatch):
    """ENGINE_ENV reaches the stubs, a value already set wins, and this venv's torch honours it: a large CPU tensor
    made under it is backed by transparent huge pages (none where the kernel's THP is `never`)."""
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    env = launcher.server_env(_wheel_tritonserver())
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert launcher.server_env(_wheel_tritonserver())["THP_MEM_ALLOC_ENABLE"] == "0"
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # e.g. "always [madvise] never"
    setting = re.search(r"\[(\w+)\]", mode.read_text()).group(1) if mode.exists() else "never"
    probe = ("import re, torch; x = torch.zeros(16 << 20); "
             "found = re.search(r'AnonHugePages:\\s+(\\d+)', open('/proc/self/smaps_rollup').read()); "
             "print(found.group(1) if found else 0)")
    huge_kib = {value: int(subprocess.run([sys.executable, "-c", probe], env={**env, "THP_MEM_ALLOC_ENABLE": value},
                                          capture_output=True, text=True, check=True).stdout) for value in ("0", "1")}
    if setting == "never":  # this kernel gives none, asked or not
        assert huge_kib == {"0": 0, "1": 0}
        return
    assert huge_kib["1"] >= 32 << 10  # most of the 64 MiB tensor
    if setting == "madvise":  # (under "always" the kernel may give any large buffer huge pages)
        assert huge_kib["0"] < 32 << 10


# --- model resolution ---------------------------------------------------------------------------------------------

def test_resolve_model_path_accepts_an_hf_directory(tmp_path):
    model_dir = tmp_path / "My-Model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert model_files.resolve_model_path(str(model_dir)) == model_dir.resolve()
    assert model_files.served_model_name(model_dir) == "My-Model"


@pytest.mark.parametrize("name", ["missing", "empty-dir", "weights.bin"])
def test_resolve_model_path_rejects_what_is_not_a_model(tmp_path, name):
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a model"):
        model_files.resolve_model_path(str(tmp_path / name))


def test_model_cache_locations(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    assert model_files.prepared_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    gguf = tmp_path / "Tiny.Q8_0.gguf"
    gguf.write_bytes(b"0123")
    converted = model_files.converted_gguf_dir(gguf)
    assert converted == tmp_path / "gguf" / "Tiny.Q8_0.gguf-4" / "Tiny.Q8_0"


def test_default_gguf_is_found():
    assert model_files.default_gguf_path().suffix == ".gguf"


# --- CLI --------------------------------------------------------------------------------------------------------

def test_serve_options_default_from_env(monkeypatch):
    monkeypatch.setenv("TRITONLLM_PORT", "9123")
    monkeypatch.setenv("TRITONLLM_KV_CACHE_MEMORY", "2GiB")
    args = cli.build_parser().parse_args(["serve"])
    assert (args.port, args.kv_cache_memory, args.grpc_port) == (9123, 2 << 30, 8001)
    assert cli.build_parser().parse_args(["serve", "--port", "1"]).port == 1


def test_write_repository_command(tmp_path):
    model_dir = tmp_path / "Some-Model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert cli.main(["write-repository", str(tmp_path / "repo"), "--model", str(model_dir),
                     "--max-num-seqs", "4"]) == 0
    parameters = _parameters((tmp_path / "repo" / "llm" / "config.pbtxt").read_text())
    assert parameters["model_path"] == str(model_dir.resolve())
    assert parameters["max_num_seqs"] == "4"


def test_options_reach_child_commands_through_the_environment(monkeypatch):
    """What scale-out gives each stack: the same engine and adapter settings, secrets off the command line."""
    args = cli.build_parser().parse_args(["scale-out", "--kv-cache-memory", "128MiB", "--enable-prefix-caching",
                                          "false", "--instances", "2", "--api-key", "sk-secret"])
    env = {**settings.to_env(EngineConfig, args), **settings.to_env(InstanceGroup, args),
           **settings.to_env(cli.AdapterSettings, args)}
    assert "TRITONLLM_MAX_TOKENS" not in env  # unset stays unset
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = cli.build_parser().parse_args(["serve"])
    assert (child.kv_cache_memory, child.enable_prefix_caching, child.instances, child.api_key) == (
        128 << 20, False, 2, "sk-secret")


def test_scale_out_places_each_stack_on_its_ports_state_dir_and_gpu(tmp_path):
    places = scale_out.stack_places(scale_out.ScaleOutSettings(stacks=2, first_stack_port=9100, stack_gpus="2,3"),
                                    tmp_path)
    assert [(p.ports, p.state_dir, p.gpu, p.url) for p in places] == [
        ((9100, 9101, 9102, 9103), tmp_path / "stack0", "2", "http://127.0.0.1:9100"),
        ((9104, 9105, 9106, 9107), tmp_path / "stack1", "3", "http://127.0.0.1:9104")]
    with pytest.raises(scale_out.FleetError, match="one per stack"):
        scale_out.stack_places(scale_out.ScaleOutSettings(stacks=3, stack_gpus="0,1"), tmp_path)


def test_gateway_command_routes_over_the_stacks_with_the_declared_defaults():
    args = cli.build_parser().parse_args(["gateway", "--worker-urls", "http://a:9000, http://b:9000", "--policy",
                                          "random"])
    command = gateway_command(settings.from_options(GatewaySettings, args))
    assert command[:4] == [sys.executable, "-m", "tritonllm.gateway", "launch"]
    text = " ".join(command)
    assert "--worker-urls http://a:9000 http://b:9000 --policy random" in text
    assert text.endswith(GatewaySettings().options)


def test_cli_reports_a_bad_model_path(tmp_path):
    assert cli.main(["write-repository", str(tmp_path / "repo"), "--model", str(tmp_path / "nope")]) == 1


# --- a real tritonserver with a stand-in decoupled model --------------------------------------------------------

STAND_IN_MODEL = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils
import tritonllm.engine  # the project must be importable from the stub


class TritonPythonModel:
    def initialize(self, args):
        FAIL_HERE
        config = json.loads(args["model_config"])
        self.kv = config["parameters"]["kv_cache_memory"]["string_value"]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0].decode()
            for chunk in (prompt, " " + self.kv):
                text = pb_utils.Tensor("text_output", np.array([chunk.encode()], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[text]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def _stand_in_source(root: Path, fail_here: str) -> Path:
    """A model repository like the project's (same config.pbtxt) whose model.py streams two chunks back."""
    (root / "llm" / "1").mkdir(parents=True)
    (root / "llm" / "config.pbtxt").write_text((launcher.SOURCE_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text())
    (root / "llm" / "1" / "model.py").write_text(STAND_IN_MODEL.replace("FAIL_HERE", fail_here))
    return root


def _server(tmp_path: Path, fail_here: str = "") -> launcher.TritonServer:
    source = _stand_in_source(tmp_path / "source", fail_here)
    repository = launcher.write_model_repository(tmp_path / "repo", {"kv_cache_memory": "64MiB"}, source=source)
    http_port, grpc_port, metrics_port = free_ports(3)
    return launcher.TritonServer(repository, tmp_path / "state", http_port=http_port, grpc_port=grpc_port,
                                 metrics_port=metrics_port)


def test_tritonserver_streams_from_a_decoupled_model(tmp_path):
    with _server(tmp_path) as server:
        server.wait_ready(120)
        responses = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        prompt = grpcclient.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
        client.async_stream_infer(launcher.MODEL_NAME, [prompt], enable_empty_final_response=True)
        chunks = []
        while True:
            result, error = responses.get(timeout=30)
            assert error is None, error
            if result.as_numpy("text_output") is not None:
                chunks.append(result.as_numpy("text_output")[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        assert chunks == ["hello", " 64MiB"]
    assert not server.is_running()


def test_wait_ready_fails_fast_with_the_log_tail(tmp_path):
    server = _server(tmp_path, fail_here='raise RuntimeError("stand-in refuses to load")')
    with server:
        with pytest.raises(launcher.TritonStartError, match="stand-in refuses to load"):
            server.wait_ready(120)


def test_start_refuses_a_port_in_use(tmp_path):
    server = _server(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.grpc_port))
        taken.listen()
        with pytest.raises(launcher.TritonStartError, match=str(server.grpc_port)):
            server.start()
    assert server.process is None


def test_serves_stop_signal_escapes_a_librarys_except_exception():
    """serve's SIGINT/SIGTERM handler raises where the main thread is; a library's `except Exception` there (as
    pydantic's, building the adapter's schemas) must not end the stop."""
    import signal
    previous = signal.signal(signal.SIGTERM, cli._raise_stop)
    try:
        with pytest.raises(cli._Stop):
            try:
                signal.raise_signal(signal.SIGTERM)
            except Exception:  # the library's
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)
