"""`tritonllm scale-out`: N `tritonllm serve` stacks on this machine behind one SMG gateway (`smg launch`,
https://github.com/lightseekorg/smg), which routes each OpenAI request to a stack (cache-aware by default: a
conversation keeps landing on the stack that holds its prefix in KV cache).

Stack i listens on 127.0.0.1 only, on four consecutive ports from first_stack_port + 4i (OpenAI API, then
tritonserver's HTTP, gRPC and metrics ports), with its files in <state_dir>/stack<i>; the gateway alone listens on
the public address. A stack that exits is started again (the gateway routes around it meanwhile and takes it
back once its /health answers); if the gateway exits, or a stack fails to come up at the start, everything
stops."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from backend.interface.settings import setting
from backend.parent_death import die_with_parent

log = logging.getLogger("tritonllm.scale_out")

STACK_READY_TIMEOUT_S = 900  # generous: N models loading at once on a small host
GATEWAY_READY_TIMEOUT_S = 120
STOP_GRACE_S = 30  # a stack stops its tritonserver first (whose own exit timeout is 10 s)
RESTART_INTERVAL_S = 30  # a stack that keeps failing is started again at most this often
GATEWAY_SHUTDOWN_GRACE_S = 5  # SMG would otherwise wait up to 180 s for in-flight requests on SIGTERM
PORTS_PER_STACK = 4


@dataclasses.dataclass(frozen=True)
class ScaleOutSettings:
    """What `tritonllm scale-out` runs, and where."""

    stacks: int = setting(2, "tritonllm serve stacks behind the gateway (one per GPU where there are GPUs)")
    host: str = setting("127.0.0.1", "gateway bind address (0.0.0.0: every interface); stacks listen on 127.0.0.1")
    port: int = setting(9000, "gateway port: the public OpenAI API")
    policy: str = setting("cache_aware", "SMG routing policy (cache_aware, random, round_robin, power_of_two, "
                                         "least_load, prefix_hash, ...)")
    first_stack_port: int = setting(9100, "stack i uses the 4 ports from here + 4i (OpenAI API, tritonserver "
                                          "HTTP, gRPC, metrics)")
    gateway_metrics_port: int = setting(29000, "the gateway's Prometheus port")
    stack_gpus: str = setting("", "one GPU id per stack, e.g. 0,1: stack i sees only the i-th "
                                  "(CUDA_VISIBLE_DEVICES); empty: every stack sees every device")
    gateway_options: str = setting(
        "--health-check-interval-secs 5 --cb-timeout-duration-secs 10",
        "more `smg launch` options (shell syntax); the default notices a dead stack, and takes it back once "
        "restarted, within seconds")


class FleetError(RuntimeError):
    pass


def gateway_command(worker_urls: list[str], policy: str, host: str, port: int, metrics_port: int,
                    options: list[str] = (), api_key: str | None = None) -> list[str]:
    """`smg launch` routing the OpenAI API at host:port over worker_urls (tritonllm stacks: generic OpenAI
    workers; SMG reads their /health, /v1/models and /v1/loads). With the stacks' api_key, the gateway asks
    clients for the same key and presents it to the stacks."""
    return [sys.executable, "-m", "smg", "launch", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--shutdown-grace-period-secs", str(GATEWAY_SHUTDOWN_GRACE_S), *options,
            *(["--api-key", api_key] if api_key else [])]


def gateway_routes_to(gateway_url: str, worker_urls: list[str], api_key: str | None = None) -> bool:
    """SMG lists each of worker_urls as a healthy worker (GET /workers, its worker API)."""
    request = urllib.request.Request(f"{gateway_url}/workers",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            workers = json.load(response)["workers"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return False
    return {worker["url"] for worker in workers if worker.get("is_healthy")} >= set(worker_urls)


def _answers_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as file:
            return "".join(deque(file, maxlen=lines))
    except FileNotFoundError:
        return ""


@dataclasses.dataclass
class Child:
    """One process of the fleet, in its own process group, logging to a file; it ends if we die."""

    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                self.command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        self.started_at = time.monotonic()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        if self.running():
            self.process.terminate()

    def wait_stopped(self, grace_s: float) -> None:
        """After terminate(): wait, then kill the whole process group."""
        if self.process is None:
            return
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", self.name, grace_s)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def exit_report(self) -> str:
        return f"{self.name} exited with code {self.process.returncode}; the end of {self.log_path}:\n" + _tail(
            self.log_path)


@dataclasses.dataclass(frozen=True)
class StackPlace:
    index: int
    ports: tuple[int, int, int, int]  # OpenAI API, tritonserver HTTP, gRPC, metrics
    state_dir: Path
    gpu: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"


def stack_places(config: ScaleOutSettings, state_dir: Path) -> list[StackPlace]:
    gpus = [gpu.strip() for gpu in config.stack_gpus.split(",") if gpu.strip()]
    if gpus and len(gpus) != config.stacks:
        raise FleetError(f"--stack-gpus lists {len(gpus)} GPUs for {config.stacks} stacks: give one per stack")
    return [StackPlace(i, tuple(config.first_stack_port + PORTS_PER_STACK * i + k for k in range(PORTS_PER_STACK)),
                       state_dir / f"stack{i}", gpus[i] if gpus else None)
            for i in range(config.stacks)]


class Fleet:
    """The stacks and the gateway: started, watched and stopped together."""

    def __init__(self, config: ScaleOutSettings, state_dir: Path, stack_env: dict[str, str], log_level: str,
                 api_key: str | None):
        self.config = config
        self.api_key = api_key
        self.places = stack_places(config, state_dir)
        self.stacks = [self._stack(place, stack_env, log_level) for place in self.places]
        self.gateway = Child("gateway", gateway_command(
            [place.url for place in self.places], config.policy, config.host, config.port,
            config.gateway_metrics_port, shlex.split(config.gateway_options), api_key), state_dir / "gateway.log",
            dict(os.environ))

    @staticmethod
    def _stack(place: StackPlace, stack_env: dict[str, str], log_level: str) -> Child:
        adapter, http, grpc, metrics = place.ports
        command = [sys.executable, "-m", "tritonllm", "serve", "--host", "127.0.0.1", "--port", str(adapter),
                   "--triton-host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
                   "--metrics-port", str(metrics), "--state-dir", str(place.state_dir), "--log-level", log_level]
        env = {**os.environ, **stack_env}
        if place.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = place.gpu
        return Child(f"stack {place.index}", command, place.state_dir / "serve.log", env)

    @property
    def public_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self) -> None:
        if importlib.util.find_spec("smg") is None:  # found out now, not after the stacks have loaded
            raise FleetError("the SMG gateway is not installed: pip install 'tritonllm[gateway]' (or smg)")
        started = time.monotonic()
        for place, stack in zip(self.places, self.stacks):
            _, http, grpc, metrics = place.ports
            log.info("starting %s%s: OpenAI API %s/v1, tritonserver HTTP %d, gRPC %d, metrics %d; log %s",
                     stack.name, "" if place.gpu is None else f" on GPU {place.gpu}", place.url, http, grpc,
                     metrics, stack.log_path)
            stack.start()
        for place, stack in zip(self.places, self.stacks):
            self._wait(lambda: _answers_ok(place.url + "/health"), stack, STACK_READY_TIMEOUT_S)
            log.info("%s ready (%.0f s)", stack.name, time.monotonic() - started)
        log.info("starting the gateway: smg --policy %s on %s/v1 (metrics port %d); log %s", self.config.policy,
                 self.public_url, self.config.gateway_metrics_port, self.gateway.log_path)
        self.gateway.start()
        self._wait(self._gateway_has_every_stack, self.gateway, GATEWAY_READY_TIMEOUT_S)
        log.info("ready in %.0f s: %d stacks behind %s/v1", time.monotonic() - started, len(self.stacks),
                 self.public_url)

    def _wait(self, ready, child: Child, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not child.running():
                raise FleetError(child.exit_report())
            if time.monotonic() > deadline:
                raise FleetError(f"{child.name} not ready after {timeout_s:.0f} s; see {child.log_path}")
            time.sleep(0.5)

    def _gateway_has_every_stack(self) -> bool:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return gateway_routes_to(f"http://{host}:{self.config.port}", [place.url for place in self.places],
                                 self.api_key)

    def supervise(self) -> None:
        """Until the gateway exits (FleetError): start again each stack that exits."""
        while True:
            if not self.gateway.running():
                raise FleetError(self.gateway.exit_report())
            for stack in self.stacks:
                if not stack.running() and time.monotonic() - stack.started_at >= RESTART_INTERVAL_S:
                    log.error("%s\nstarting %s again; the gateway routes around it meanwhile", stack.exit_report(),
                              stack.name)
                    stack.start()
            time.sleep(1)

    def stop(self) -> None:
        """The gateway first (no new requests), then every stack at once."""
        self.gateway.terminate()
        self.gateway.wait_stopped(GATEWAY_SHUTDOWN_GRACE_S + 5)
        for stack in self.stacks:
            stack.terminate()
        for stack in self.stacks:
            stack.wait_stopped(STOP_GRACE_S)
        log.info("stopped the gateway and %d stacks", len(self.stacks))
