"""docker-compose.yml and docker-compose.scale.yml: their wiring checked from the YAML always, and `docker compose
config` where the plugin exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMPOSE_FILE = Path(__file__).resolve().parent.parent / "docker-compose.yml"
SCALE_FILE = COMPOSE_FILE.with_name("docker-compose.scale.yml")


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


def test_triton_service_wiring():
    triton = _services()["triton"]
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3", triton["image"])
    [gpu] = triton["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    volumes = triton["volumes"]
    assert any(volume.split(":")[0] == "." for volume in volumes), "the project (model_repository) is not mounted"
    assert "model_repository" in " ".join(triton["command"])
    assert any(re.match(r"\$\{MODEL_DIR[:}]", volume) for volume in volumes), "no host model dir from MODEL_DIR"
    health = " ".join(triton["healthcheck"]["test"])
    assert re.search(r":8000/v2/(health|models/llm)/ready", health)


def test_adapter_service_wiring():
    adapter = _services()["adapter"]
    assert adapter["depends_on"]["triton"]["condition"] == "service_healthy"
    assert "9000:9000" in adapter["ports"]
    command = " ".join(adapter["command"])
    assert "--triton-url triton:8001" in command and "--port 9000" in command


def test_lora_dir_reaches_the_engine_and_the_adapter():
    """LORA_DIR mounts the same adapters directory into both services: the engine loads from it (TRITONLLM_LORA_DIR,
    read by `tritonllm write-repository`), the adapter lists it and reads which are loaded from Triton's metrics."""
    services = _services()
    for service in services.values():
        assert any(re.match(r"\$\{LORA_DIR[:}].*:/adapters", volume) for volume in service["volumes"])
    assert services["triton"]["environment"]["TRITONLLM_LORA_DIR"] == "${LORA_DIR:+/adapters}"
    command = " ".join(services["adapter"]["command"])
    assert "${LORA_DIR:+--lora-dir /adapters}" in command and "--triton-metrics-url http://triton:8002/metrics" in command


# --- docker-compose.scale.yml: stacks behind the SMG gateway ------------------------------------------------------

def _stacks() -> dict:
    return {name: service for name, service in _services(SCALE_FILE).items() if name.startswith("stack")}


def test_each_stack_runs_serve_pinned_to_its_own_gpu():
    stacks = _stacks()
    assert len(stacks) >= 2
    gpus = []
    for service in stacks.values():
        assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3", service["image"])
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and "count" not in device
        gpus += device["device_ids"]
        command = " ".join(service["command"])
        assert "tritonllm serve --host 0.0.0.0 --port 9000" in command
        assert ":9000/health" in " ".join(service["healthcheck"]["test"])
        assert "ports" not in service, "only the gateway is published"
        assert service["restart"] == "unless-stopped"
    assert len(set(gpus)) == len(gpus) == len(stacks), "each stack on a GPU of its own"


def test_the_gateway_alone_is_published_and_routes_over_every_stack():
    gateway = _services(SCALE_FILE)["gateway"]
    assert gateway["ports"] == ["9000:9000"]
    command = " ".join(gateway["command"])
    assert "tritonllm gateway --host 0.0.0.0 --port 9000" in command and "[adapter,gateway]" in command
    [worker_urls] = re.findall(r"--worker-urls (\S+)", command)
    stacks = _stacks()
    assert worker_urls.split(",") == [f"http://{name}:9000" for name in stacks]
    assert gateway["depends_on"] == {name: {"condition": "service_healthy"} for name in stacks}
