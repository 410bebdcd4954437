"""docker-compose.yml: its wiring checked from the YAML always, and `docker compose config` where the plugin exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

COMPOSE_FILE = Path(__file__).resolve().parent.parent / "docker-compose.yml"


def _compose_plugin_available() -> bool:
    docker = shutil.which("docker")
    return docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0


def test_compose_file_is_valid_where_docker_compose_exists():
    if not _compose_plugin_available():
        return  # the YAML checks below still run; only Compose's own validation needs the plugin
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE_FILE), "config", "--quiet"],
                            cwd=COMPOSE_FILE.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _services() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


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
