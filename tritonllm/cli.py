"""The `tritonllm` console script: `prepare` converts the default model once; `serve` runs tritonserver with
the `llm` model and the OpenAI-compatible adapter in front of it, and stops both together; `gateway` runs the
SMG gateway over stacks (tritonllm/gateway.py); `scale-out` runs several stacks behind one and stops them all
together (tritonllm/scale_out.py); `write-repository` only writes the model repository, and `tritonserver` runs
tritonserver over it as `serve` would (its own container: docker-compose.yml)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from tritonllm import launcher, model_files
from tritonllm.engine_supervisor import EngineSupervisor, RestartBudget, RestartSettings
from tritonllm.engine.config import EngineConfig, InstanceGroup
from tritonllm.interface import settings
from tritonllm.interface.api_key import read_api_key
from tritonllm.interface.settings import setting
from tritonllm.adapter.settings import AdapterSettings
from tritonllm.gateway import GatewaySettings, gateway_command, gateway_env
from tritonllm.scale_out import Fleet, FleetError, ScaleOutSettings

log = logging.getLogger("tritonllm")

READY_TIMEOUT_S = 600  # generous: a large model loading on a slow host

# AdapterSettings that `serve` fills in itself (from where it starts tritonserver and what it serves).
_DERIVED_ADAPTER_SETTINGS = ("triton_url", "triton_model", "lora_dir", "triton_metrics_url")
# ServeSettings that `scale-out` decides for each stack.
_STACK_PLACE_SETTINGS = ("host", "port", "triton_host", "http_port", "grpc_port", "metrics_port")
# The AdapterSettings the gateway and tritonserver need too: the stacks' API key.
_API_KEY_SETTINGS = ("api_key", "api_key_file")
_ALL_BUT_API_KEY = tuple(field.name for field in settings.settings_fields(AdapterSettings)
                         if field.name not in _API_KEY_SETTINGS)
# ServeSettings that are not tritonserver's (its address, ports and state dir are).
_ALL_BUT_TRITON_PLACE = ("host", "port", "log_level")
# The one EngineConfig setting `prepare` needs: the model.
_ALL_BUT_MODEL = tuple(field.name for field in settings.settings_fields(EngineConfig) if field.name != "model_path")


class _Stop(BaseException):
    """SIGINT/SIGTERM arrived: unwind and stop everything. Not an Exception (as KeyboardInterrupt is not): raised
    wherever the main thread is, it must not end in a library's `except Exception` (pydantic's, building the
    adapter's schemas, swallowed it, and serve ran on)."""


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """Where `tritonllm serve` runs things."""

    host: str = setting("127.0.0.1", "adapter bind address")
    port: int = setting(9000, "adapter port")
    triton_host: str = setting("127.0.0.1", "tritonserver bind address")
    http_port: int = setting(8000, "tritonserver HTTP port")
    grpc_port: int = setting(8001, "tritonserver gRPC port")
    metrics_port: int = setting(8002, "tritonserver metrics port")
    log_level: str = setting("info", "log level of tritonllm and the adapter",
                             choices=("critical", "error", "warning", "info", "debug"))
    state_dir: str = setting("", "runtime files and logs; empty for ./.state (a temp dir if unwritable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonllm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="download (a hub id) or convert (a GGUF) the model into its cache "
                                                  "once, and build the CPU ops; e.g. at a container's build time")
    settings.add_options(prepare, EngineConfig, exclude=_ALL_BUT_MODEL)
    prepare.add_argument("--force", action="store_true", help="convert the default model again even if prepared")

    serve = commands.add_parser("serve", help="run tritonserver and the OpenAI-compatible adapter")
    settings.add_options(serve, EngineConfig)
    settings.add_options(serve, InstanceGroup)
    settings.add_options(serve, AdapterSettings, exclude=_DERIVED_ADAPTER_SETTINGS)
    settings.add_options(serve, ServeSettings)
    settings.add_options(serve, RestartSettings)

    gateway = commands.add_parser("gateway", help="run the SMG gateway in front of stacks (smg launch)")
    settings.add_options(gateway, GatewaySettings)
    settings.add_options(gateway, AdapterSettings, exclude=_ALL_BUT_API_KEY)

    scale = commands.add_parser("scale-out", help="run several serve stacks behind an SMG gateway, stopped together")
    settings.add_options(scale, ScaleOutSettings)
    settings.add_options(scale, GatewaySettings, exclude=("worker_urls",))
    settings.add_options(scale, ServeSettings, exclude=_STACK_PLACE_SETTINGS)
    settings.add_options(scale, RestartSettings)
    settings.add_options(scale, EngineConfig)
    settings.add_options(scale, InstanceGroup)
    settings.add_options(scale, AdapterSettings, exclude=_DERIVED_ADAPTER_SETTINGS)

    repository = commands.add_parser(
        "write-repository", help="write a model repository for running tritonserver yourself (e.g. in NGC)")
    repository.add_argument("repository", type=Path, help="folder to write llm/ into")
    settings.add_options(repository, EngineConfig)
    settings.add_options(repository, InstanceGroup)

    tritonserver = commands.add_parser(
        "tritonserver", help="become tritonserver for a repository from write-repository, its protocols guarded by "
                             "the API key as under serve (e.g. in a container of its own)")
    tritonserver.add_argument("repository", type=Path, help="the folder holding llm/")
    settings.add_options(tritonserver, ServeSettings, exclude=_ALL_BUT_TRITON_PLACE)
    settings.add_options(tritonserver, AdapterSettings, exclude=_ALL_BUT_API_KEY)
    return parser


def _write_repository(args: argparse.Namespace, repository: Path) -> str:
    """Resolve (preparing if needed) the model and write the repository; returns the served model name."""
    log.info("preparing model…")
    # A local GGUF file is prepared by the engine, which imports what that needs anyway: no child of this process
    # importing it all again first (seconds).
    model = model_files.resolve_model(args.model_path, gguf_in_engine=True)
    log.info("model at %s", model.path)
    # tritonserver runs elsewhere: paths go absolute
    config = settings.from_options(EngineConfig, args, model_path=str(model.path), lora_dir=_lora_dir(args.lora_dir))
    launcher.write_model_repository(repository, config.to_strings(), settings.from_options(InstanceGroup, args))
    return model.name


def _lora_dir(configured: str) -> str:
    """The adapters directory as an absolute path (tritonserver runs elsewhere), or empty."""
    if not configured:
        return ""
    path = Path(configured).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"--lora-dir {configured} is not a directory")
    return str(path)


def _state_dir(configured: str) -> Path:
    path = Path(configured or ".state")
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path.resolve()
    except OSError:
        if configured:
            raise
        return Path(tempfile.mkdtemp(prefix="tritonllm-"))


def _raise_stop(signum, frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def prepare(args: argparse.Namespace) -> int:
    log.info("preparing the model…")
    if args.force and not args.model_path:
        model_dir = model_files.prepare_default_model(force=True)
    else:
        model_dir = model_files.resolve_model_path(args.model_path)
    log.info("model ready at %s", model_dir)
    from tritonllm.kernels import cpu  # imports torch: only here
    built = cpu.load(model_files.cpu_ops_dir())
    log.info("CPU ops %s", f"built for this CPU in {model_files.cpu_ops_dir()}" if built else
             "unavailable (no C compiler, or TRITONLLM_CPU_OPS=0): torch ops")
    return 0


def write_repository(args: argparse.Namespace) -> int:
    name = _write_repository(args, args.repository)
    log.info("wrote %s; it serves the model as %r", args.repository / launcher.MODEL_NAME, name)
    return 0


def serve(args: argparse.Namespace) -> int:
    # Interrupt any blocking step (conversion, waiting for readiness) and unwind through `finally`. While the
    # adapter runs, it handles these signals itself: it drains (new requests 503, those in flight get
    # --shutdown-grace to finish, then are cancelled) and re-raises the signal to us once it has stopped; only then
    # is tritonserver stopped, with nothing left in flight.
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    gave_up: list[str] = []  # why serve stopped restarting its engines
    server = supervisor = None
    try:
        state_dir = _state_dir(args.state_dir)
        repository = state_dir / "model_repository"
        model_name = _write_repository(args, repository)

        server = _triton_server(args, repository, state_dir)
        adapter_settings = _adapter_settings(args, server, model_name)  # checked before the long start
        log.info("starting tritonserver on %s (gRPC %s), log: %s", server.http_url, server.grpc_url, server.log_path)
        started = time.monotonic()
        server.start()
        server.wait_ready(READY_TIMEOUT_S)
        log.info("model ready in %.1f s", time.monotonic() - started)

        from tritonllm.adapter.engine_health import EngineHealth  # the adapter's imports are slow: not before here

        engine_health = EngineHealth()

        def give_up(why: str) -> None:
            gave_up.append(why)
            os.kill(os.getpid(), signal.SIGTERM)

        supervisor = EngineSupervisor(server, RestartBudget(settings.from_options(RestartSettings, args)),
                                      on_death=engine_health.mark_dead, on_recovered=engine_health.mark_all_alive,
                                      on_give_up=give_up, ready_timeout_s=READY_TIMEOUT_S)
        supervisor.start()
        _run_adapter(args, adapter_settings, engine_health)
    except _Stop as stop:
        if not gave_up:
            log.info("stopping (%s)", stop)
    except launcher.TritonStartError as error:
        log.error("%s", error)
        return 1
    finally:
        if supervisor is not None:
            supervisor.stop()
        if server is not None:
            server.stop()
    if gave_up:
        log.error("stopped: %s (--engine-max-restarts %d in --engine-restart-window %g s); exiting for the "
                  "supervisor to restart the server", gave_up[0], args.engine_max_restarts,
                  args.engine_restart_window_s)
        return 1
    return 0


def _triton_server(args: argparse.Namespace, repository: Path, state_dir: Path) -> launcher.TritonServer:
    return launcher.TritonServer(repository, state_dir, host=args.triton_host, http_port=args.http_port,
                                 grpc_port=args.grpc_port, metrics_port=args.metrics_port, api_key=args.api_key)


def tritonserver(args: argparse.Namespace) -> int:
    _triton_server(args, args.repository.resolve(), _state_dir(args.state_dir)).exec()


def gateway(args: argparse.Namespace) -> int:
    command = gateway_command(settings.from_options(GatewaySettings, args))
    log.info("gateway: smg --policy %s on http://%s:%d/v1 over %s", args.policy, args.host, args.port,
             args.worker_urls)
    os.execve(command[0], command, gateway_env(args.api_key))  # becomes smg: its signals, its exit code


def scale_out(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    # Resolved (the default model converted, a hub model downloaded) once here, not by each stack in turn.
    log.info("preparing model…")
    model = model_files.resolve_model(args.model_path)
    args.model_path = str(model.hub or model.path)
    args.lora_dir = _lora_dir(args.lora_dir)
    # Every stack gets the same engine and adapter options, through its environment; a hub id stays one, so each
    # stack serves it under its id, found in the cache just filled.
    stack_env = {**settings.to_env(EngineConfig, args), **settings.to_env(InstanceGroup, args),
                 **settings.to_env(AdapterSettings, args), **settings.to_env(RestartSettings, args),
                 "HF_HUB_OFFLINE": "1"}
    fleet = None
    try:
        fleet = Fleet(settings.from_options(ScaleOutSettings, args), settings.from_options(GatewaySettings, args),
                      _state_dir(args.state_dir), stack_env, args.log_level, args.api_key)
        fleet.start()
        fleet.supervise()
    except _Stop as stop:
        log.info("stopping (%s)", stop)
        return 0
    except FleetError as error:
        log.error("%s", error)
        return 1
    finally:
        if fleet is not None:
            fleet.stop()


def _adapter_settings(args: argparse.Namespace, server: launcher.TritonServer, model_name: str) -> AdapterSettings:
    return settings.from_options(
        AdapterSettings, args, triton_url=server.grpc_url, triton_model=launcher.MODEL_NAME,
        served_model_name=model_name, lora_dir=_lora_dir(args.lora_dir) or None,
        triton_metrics_url=server.metrics_url)


def _run_adapter(args: argparse.Namespace, adapter_settings: AdapterSettings, engine_health) -> None:
    from tritonllm.adapter.app import run

    log.info("OpenAI API on http://%s:%d/v1 (model %r)", args.host, args.port, adapter_settings.served_model_name)
    run(adapter_settings, args.host, args.port, args.log_level, engine_health)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    commands = {"prepare": prepare, "serve": serve, "gateway": gateway, "scale-out": scale_out,
                "write-repository": write_repository, "tritonserver": tritonserver}
    try:
        if hasattr(args, "api_key_file"):  # read once, here: the commands and their children get the key itself
            args.api_key, args.api_key_file = read_api_key(args.api_key, args.api_key_file), None
        return commands[args.command](args)
    except (FileNotFoundError, ValueError) as error:  # a bad --model (hub failures too) or a missing tritonserver
        log.error("%s", error)
        return 1


if __name__ == "__main__":
    sys.exit(main())
