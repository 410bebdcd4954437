"""`tritonllm scale-out`: N `tritonllm serve` stacks on this machine behind one SMG gateway
(tritonllm/gateway.py), started together and stopped together.

Stack i listens on 127.0.0.1 only, on four consecutive ports from first_stack_port + 4i (OpenAI API, then
tritonserver's HTTP, gRPC and metrics ports), with its files in <state_dir>/stack<i>; the gateway alone listens on
the public address. A stack that exits is started again (the gateway routes around it meanwhile and takes it
back once its /health answers); if the gateway exits, or a stack fails to come up at the start, everything
stops."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tritonllm.interface.settings import setting
from tritonllm.launcher import answers_ok, log_tail
from tritonllm.parent_death import die_with_parent
from tritonllm.gateway import (SHUTDOWN_GRACE_S, GatewaySettings, gateway_command, gateway_env,
                               routes_to_every_stack)

log = logging.getLogger("tritonllm.scale_out")

STACK_READY_TIMEOUT_S = 900  # generous: N models loading at once on a small host
GATEWAY_READY_TIMEOUT_S = 120
STOP_GRACE_S = 30  # a stack stops its tritonserver first (whose own exit timeout is 10 s)
RESTART_INTERVAL_S = 30  # a stack that keeps failing is started again at most this often
PORTS_PER_STACK = 4


@dataclasses.dataclass(frozen=True)
class ScaleOutSettings:
    """The stacks `tritonllm scale-out` runs behind its gateway (GatewaySettings), and where."""

    stacks: int = setting(2, "tritonllm serve stacks behind the gateway (one per GPU where there are GPUs)")
    first_stack_port: int = setting(9100, "stack i uses the 4 ports from here + 4i (OpenAI API, tritonserver "
                                          "HTTP, gRPC, metrics)")
    stack_gpus: str = setting("", "one GPU id per stack, e.g. 0,1: stack i sees only the i-th "
                                  "(CUDA_VISIBLE_DEVICES); empty: every stack sees every device")


class FleetError(RuntimeError):
    pass


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
        return (f"{self.name} exited with code {self.process.returncode}; the end of {self.log_path}:\n"
                + log_tail(self.log_path, 30))


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

    def __init__(self, config: ScaleOutSettings, gateway: GatewaySettings, state_dir: Path,
                 stack_env: dict[str, str], log_level: str, api_key: str | None):
        self.places = stack_places(config, state_dir)
        self.stacks = [self._stack(place, stack_env, log_level) for place in self.places]
        self.gateway_config = dataclasses.replace(gateway, worker_urls=",".join(place.url for place in self.places))
        self.api_key = api_key
        self.gateway = Child("gateway", gateway_command(self.gateway_config), state_dir / "gateway.log",
                             gateway_env(api_key))

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
            self._wait(lambda: answers_ok(place.url + "/health"), stack, STACK_READY_TIMEOUT_S)
            log.info("%s ready (%.0f s)", stack.name, time.monotonic() - started)
        gateway = self.gateway_config
        log.info("starting the gateway: smg --policy %s on http://%s:%d/v1 (metrics port %d); log %s",
                 gateway.policy, gateway.host, gateway.port, gateway.metrics_port, self.gateway.log_path)
        self.gateway.start()
        self._wait(lambda: routes_to_every_stack(gateway, self.api_key), self.gateway, GATEWAY_READY_TIMEOUT_S)
        log.info("ready in %.0f s: %d stacks behind http://%s:%d/v1", time.monotonic() - started, len(self.stacks),
                 gateway.host, gateway.port)

    def _wait(self, ready, child: Child, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not child.running():
                raise FleetError(child.exit_report())
            if time.monotonic() > deadline:
                raise FleetError(f"{child.name} not ready after {timeout_s:.0f} s; see {child.log_path}")
            time.sleep(0.5)

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
        self.gateway.wait_stopped(SHUTDOWN_GRACE_S + 5)
        for stack in self.stacks:
            stack.terminate()
        for stack in self.stacks:
            stack.wait_stopped(STOP_GRACE_S)
        log.info("stopped the gateway and %d stacks", len(self.stacks))
