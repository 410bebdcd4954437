"""Run tritonserver for the `llm` model: find the binary, lay out the backend directory and a runtime model
repository (the repo's config.pbtxt with engine parameters filled in), start, wait for readiness, stop."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import Callable

from tritonllm.engine.config import InstanceGroup
from tritonllm.interface.api_key import API_KEY_ENV, RESTRICTED_APIS, TRITON_KEY_HEADER, triton_headers, triton_secret
from tritonllm.parent_death import die_with_parent

MODEL_NAME = "llm"
SOURCE_MODEL_REPOSITORY = Path(__file__).resolve().parent / "model_repository"
# The engine process's environment, read before torch allocates anything (a value already set wins).
# THP_MEM_ALLOC_ENABLE: torch's CPU allocator backs each buffer of 2 MiB or more with transparent huge pages
# (2 MiB aligned, madvise), so the weights and the KV cache stream through a few TLB entries instead of one per
# 4 KiB: the one-token step took 0.85x the time on a 2-core EPYC (and the 32-stream one 0.96x).
ENGINE_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


# --- tritonserver and its Python backend --------------------------------------------------------------------

def find_tritonserver() -> Path:
    """$TRITONSERVER, else `tritonserver` on PATH (the NGC container), else the one in the nvidia-pytriton wheel."""
    configured = os.environ.get("TRITONSERVER")
    if configured:
        path = Path(configured)
        if not path.is_file():
            raise FileNotFoundError(f"TRITONSERVER={configured} is not a file")
        return path
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    spec = importlib.util.find_spec("pytriton")  # located, not imported: pytriton's import is slow
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "tritonserver" / "bin" / "tritonserver"
        if bundled.is_file():
            return bundled
    raise FileNotFoundError(
        "tritonserver not found: set TRITONSERVER, put it on PATH (NGC image), or `pip install nvidia-pytriton`")


def _install_root(tritonserver: Path) -> Path:
    """The folder holding bin/tritonserver and backends/ (e.g. /opt/tritonserver)."""
    return tritonserver.resolve().parent.parent


def _is_pytriton_wheel(tritonserver: Path) -> bool:
    # The wheel keeps one Python backend stub per Python version beside the server instead of in backends/python.
    return (_install_root(tritonserver) / "python_backend_stubs").is_dir()


def build_backend_dir(tritonserver: Path, state_dir: Path) -> Path:
    """The --backend-directory for this tritonserver.

    NGC's install already has a complete backends/ folder. The wheel's lacks the stub, so we assemble
    <state_dir>/backends/python from symlinks: the backend library, its utils and the stub for this Python."""
    root = _install_root(tritonserver)
    if not _is_pytriton_wheel(tritonserver):
        return root / "backends"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    sources = [
        root / "backends" / "python" / "libtriton_python.so",
        root / "backends" / "python" / "triton_python_backend_utils.py",
        root / "python_backend_stubs" / version / "triton_python_backend_stub",
    ]
    for source in sources:
        if not source.is_file():
            raise FileNotFoundError(f"{source} missing: nvidia-pytriton does not support Python {version}?")
    backend_dir = state_dir / "backends"
    python_dir = backend_dir / "python"
    shutil.rmtree(backend_dir, ignore_errors=True)
    python_dir.mkdir(parents=True)
    for source in sources:
        (python_dir / source.name).symlink_to(source)
    return backend_dir


def server_env(tritonserver: Path) -> dict[str, str]:
    """Environment for tritonserver, whose Python stubs must run this interpreter's environment."""
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)  # tritonserver gets a value derived from it (restriction_options), never the key
    # The stub locates its site-packages from the `python3` it finds on PATH: make that ours (the venv's).
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    # The stub must load this interpreter's libpython, else it takes the system one and stdlib extensions
    # built for ours fail with undefined symbols.
    library_dirs = [sysconfig.get_config_var("LIBDIR")]
    if _is_pytriton_wheel(tritonserver):
        library_dirs.append(str(_install_root(tritonserver).parent.parent / "nvidia_pytriton.libs"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [*library_dirs, env.get("LD_LIBRARY_PATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")  # the engine loads local files only
    for name, value in ENGINE_ENV.items():  # the stubs inherit it
        env.setdefault(name, value)
    # The stub's embedded Python would otherwise take the C locale's ASCII for file names and files.
    env.setdefault("PYTHONUTF8", "1")
    return env


# --- the runtime model repository ---------------------------------------------------------------------------

def _pbtxt_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def set_pbtxt_parameters(config_text: str, parameters: dict[str, str]) -> str:
    """Set `parameters { key: "K" value: { string_value: "V" } }` entries in a model config, replacing an
    existing entry for the same key in place and appending new keys at the end."""
    quoted_string = r'"(?:[^"\\]|\\.)*"'
    for key, value in parameters.items():
        entry = f"parameters {{ key: {_pbtxt_string(key)} value: {{ string_value: {_pbtxt_string(str(value))} }} }}"
        existing = re.compile(
            r"parameters\s*:?\s*\{\s*key\s*:\s*" + re.escape(_pbtxt_string(key))
            + r"\s*value\s*:?\s*\{\s*string_value\s*:\s*" + quoted_string + r"\s*\}\s*\}")
        config_text, found = existing.subn(lambda _: entry, config_text)
        if not found:
            config_text = config_text.rstrip("\n") + "\n" + entry + "\n"
    return config_text


def set_pbtxt_instance_group(config_text: str, instance_group: str) -> str:
    """Replace the one-line `instance_group [...]` entry of a model config."""
    config_text, found = re.subn(r"^instance_group\b.*$", lambda _: instance_group, config_text, flags=re.MULTILINE)
    if found != 1:
        raise ValueError(f"expected one single-line instance_group entry in the model config, found {found}")
    return config_text


def write_model_repository(repository: Path, engine_parameters: dict[str, str],
                           instances: InstanceGroup = InstanceGroup(), source: Path = SOURCE_MODEL_REPOSITORY) -> Path:
    """(Re)create `repository`/llm with config.pbtxt (source's, parameters and instance group set) and
    1/model.py (a symlink to source's, so the engine code stays the repo's). Returns `repository`."""
    shutil.rmtree(repository / MODEL_NAME, ignore_errors=True)
    version_dir = repository / MODEL_NAME / "1"
    version_dir.mkdir(parents=True)
    config_text = (source / MODEL_NAME / "config.pbtxt").read_text()
    config_text = set_pbtxt_instance_group(set_pbtxt_parameters(config_text, engine_parameters), instances.to_pbtxt())
    (repository / MODEL_NAME / "config.pbtxt").write_text(config_text)
    (version_dir / "model.py").symlink_to((source / MODEL_NAME / "1" / "model.py").resolve())
    return repository


def restriction_options(api_key: str | None) -> list[str]:
    """tritonserver's options that make every API but health require the API key's header (HTTP and gRPC); none
    without a key."""
    if api_key is None:
        return []
    restriction = f"{','.join(RESTRICTED_APIS)}:{TRITON_KEY_HEADER}={triton_secret(api_key)}"
    return [f"--http-restricted-api={restriction}", f"--grpc-restricted-protocol={restriction}"]


# --- the server process -------------------------------------------------------------------------------------

log = logging.getLogger(__name__)

_STUB = "triton_python_backend_stub"
_AFTER_ENGINES_S = 2.0
"""Stopping, tritonserver gets this long to exit once every engine process has ended (each after its finalize).
tritonserver 2.51 never finishes unloading a model version whose engine process died (that process's requests stay
held), and would otherwise wait out its exit timeout for it."""
_INSTANCE_NAME = re.compile(rf"^{MODEL_NAME}_\d+_\d+$")  # Triton's instance names: <model>_<group>_<index>


def _child_pids(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        try:  # /proc/<pid>/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # a process that just ended
            continue
    return children


def _stub_instance(pid: int) -> str | None:
    """The engine instance a Python-backend stub runs (its command line names it), or None for another process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if Path(argv[0]).name != _STUB:
        return None
    return next((arg for arg in argv[1:] if _INSTANCE_NAME.match(arg)), None)


def answers_ok(url: str) -> bool:
    """GET url answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log, without blank lines and table borders (Triton's startup tables would otherwise
    push the interesting lines out)."""
    try:
        with open(path, errors="replace") as log:
            kept = (line for line in log if line.strip() and not line.startswith("+"))
            return "".join(deque(kept, maxlen=lines))
    except FileNotFoundError:
        return ""


class TritonStartError(RuntimeError):
    pass


class TritonServer:
    """One tritonserver process serving `model_repository`; logs go to <state_dir>/tritonserver.log."""

    def __init__(self, model_repository: Path, state_dir: Path, *, host: str = "127.0.0.1",
                 http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 tritonserver: Path | None = None, exit_timeout_s: int = 10, api_key: str | None = None):
        self.model_repository = model_repository
        self.state_dir = state_dir
        self.host = host
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.tritonserver = tritonserver or find_tritonserver()
        self.exit_timeout_s = exit_timeout_s
        self.api_key = api_key
        self.log_path = state_dir / "tritonserver.log"
        self.process: subprocess.Popen | None = None
        self._stopping = threading.Event()

    @property
    def local_host(self) -> str:
        """Where this machine reaches the server: a wildcard bind address (every interface) on loopback."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def http_url(self) -> str:
        return f"http://{self.local_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port, the form tritonclient.grpc expects."""
        return f"{self.local_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.local_host}:{self.metrics_port}/metrics"

    @property
    def headers(self) -> dict[str, str]:
        """What every call to this server sends (its health API excepted, which is open)."""
        return triton_headers(self.api_key)

    @property
    def shm_region_prefix(self) -> str:
        return f"tritonllm_{self.grpc_port}_"

    def _command(self, backend_dir: Path) -> list[str]:
        return [
            str(self.tritonserver),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            # Explicit model control: the model loads at start as before, and `serve` may reload it through the
            # model-repository API when an engine process dies (tritonllm/engine_supervisor.py).
            "--model-control-mode=explicit", f"--load-model={MODEL_NAME}",
            # config.pbtxt declares the model whole: auto-completing it would start a Python stub of its own, which
            # imports model.py (torch, the engine) only to find nothing to add
            "--disable-auto-complete-config",
            # Python-backend stubs talk to the server through /dev/shm regions named from this prefix: distinct for
            # each tritonserver on the host (as its gRPC port is), so several never share a region, and a region
            # left by a killed server names its owner.
            f"--backend-config=python,shm-region-prefix-name={self.shm_region_prefix}",
            *restriction_options(self.api_key),
        ]

    def _check_ports_free(self) -> None:
        # Fail before starting: with a port taken, readiness probes could be answered by another server.
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            with socket.socket() as probe:
                # Like the servers themselves: ignore TIME_WAIT leftovers, but not a live listener.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((self.host, port))
                except OSError as error:
                    raise TritonStartError(f"port {self.host}:{port} is not available: {error}") from None

    def start(self) -> None:
        if self._stopping.is_set():  # stop() was called: a supervisor's restart must not start a new one
            raise TritonStartError("tritonserver is being stopped")
        self._check_ports_free()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        command = self._command(build_backend_dir(self.tritonserver, self.state_dir))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=server_env(self.tritonserver),
                # Own process group: a terminal's Ctrl-C reaches only us, and we stop the server in order.
                # If the launcher is killed outright, tritonserver stops too instead of holding the ports.
                start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))

    def exec(self) -> None:
        """Become tritonserver (a container's main process: its signals, its exit code, its log on stdout)."""
        command = self._command(build_backend_dir(self.tritonserver, self.state_dir))
        os.execve(command[0], command, server_env(self.tritonserver))

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def is_live(self) -> bool:
        """Whether tritonserver answers its liveness probe (within 2 s)."""
        return answers_ok(self.http_url + "/v2/health/live")

    def kill(self) -> None:
        """SIGKILL to the whole process group at once (a hung tritonserver, its stubs with it)."""
        if self.is_running():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def wait_ready(self, timeout: float) -> None:
        """Block until the server and the model answer ready; raise TritonStartError with the log tail if the
        process exits or the timeout passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                code = self.process.returncode if self.process else None
                raise TritonStartError(f"tritonserver exited with code {code}:\n{self.log_tail()}")
            if all(answers_ok(self.http_url + path) for path in ("/v2/health/ready", f"/v2/models/{MODEL_NAME}/ready")):
                return
            time.sleep(0.5)
        raise TritonStartError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL to the whole process group (stubs included) after the grace period, or
        _AFTER_ENGINES_S after the last engine process ended."""
        self._stopping.set()
        if not self.is_running():
            return
        deadline = time.monotonic() + (self.exit_timeout_s + 5 if grace_s is None else grace_s)
        self.process.terminate()
        engines_ended = None  # when no engine process was left
        while True:
            try:
                self.process.wait(0.2)
                return
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.engine_processes():
                engines_ended = None
            elif engines_ended is None:
                engines_ended = now
            elif now - engines_ended >= _AFTER_ENGINES_S:
                log.warning("every engine has stopped but tritonserver still waits to unload a model version whose "
                            "engine process died; ending it")
                break
            if now >= deadline:
                break
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def engine_processes(self) -> dict[int, str]:
        """The model's Python-backend stubs now running: pid → engine instance name (e.g. llm_0_1; after a reload,
        two processes may have the same name)."""
        if not self.is_running():
            return {}
        return {pid: instance for pid in _child_pids(self.process.pid)
                if (instance := _stub_instance(pid)) is not None}

    def model_control(self, action: str, timeout_s: float = 600) -> None:
        """POST the model-repository API's `action` (load: load again, i.e. reload, a loaded model; unload) for the
        `llm` model, with the API key's header when the API is restricted; RuntimeError with Triton's answer if it
        fails. Triton answers once the new instances are ready (or failed)."""
        request = urllib.request.Request(f"{self.http_url}/v2/repository/models/{MODEL_NAME}/{action}", data=b"{}",
                                         method="POST", headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                return
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"Triton refused to {action} model {MODEL_NAME}: HTTP {error.code} "
                               f"{error.read().decode(errors='replace')[:500]}") from None
        except (urllib.error.URLError, OSError) as error:
            raise RuntimeError(f"Triton did not {action} model {MODEL_NAME}: {error}") from None

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
