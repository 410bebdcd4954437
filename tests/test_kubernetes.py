"""deploy/kubernetes: every manifest valid against the Kubernetes API schemas (kubernetes-validate ships them: no
cluster, no network), and the wiring checked the way tests/test_compose.py checks the compose files: ports,
probes, selectors, the gateway's stacks, the settings the stacks read, and the images the compose files build."""

from __future__ import annotations

import argparse
import base64
import inspect
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tritonllm import launcher
from tritonllm.engine.config import EngineConfig, InstanceGroup
from tritonllm.interface.settings import env_name, settings_fields
from tritonllm.adapter.settings import AdapterSettings
from tritonllm import cli
from tritonllm.cli import ServeSettings
from tritonllm.gateway import GatewaySettings
from tritonllm.interface.api_key import API_KEY_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = REPO_ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")  # the oldest still widely run, and a recent one
KUSTOMIZATION = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())


def _documents() -> list[dict]:
    return [document for name in KUSTOMIZATION["resources"]
            for document in yaml.safe_load_all((MANIFESTS / name).read_text()) if document]


def _one(kind: str, name: str) -> dict:
    [found] = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


STACKS = _one("StatefulSet", "tritonllm-stack")
STACK_SERVICE = _one("Service", "tritonllm-stack")
GATEWAY = _one("Deployment", "tritonllm-gateway")
GATEWAY_SERVICE = _one("Service", "tritonllm-gateway")


def _container(workload: dict) -> dict:
    [container] = workload["spec"]["template"]["spec"]["containers"]
    return container


def _ports(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def _command(workload: dict) -> argparse.Namespace:
    """The container's `tritonllm` command line as the CLI parses it (an unknown option fails here)."""
    args = _container(workload)["args"]
    assert args[0] == "tritonllm"
    return cli.build_parser().parse_args(args[1:])


def _generated_secrets() -> list[dict]:
    """The Secrets kustomize makes from the kustomization's secretGenerator, each file's content as a value (the
    files themselves are the user's, git-ignored: a stand-in value here)."""
    return [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": generator["name"]},
             "data": {name: base64.b64encode(b"stand-in").decode() for name in generator["files"]}}
            for generator in KUSTOMIZATION.get("secretGenerator", [])]


def test_the_kustomization_lists_every_manifest():
    on_disk = {path.name for path in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(KUSTOMIZATION["resources"]) == sorted(on_disk)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("document", _documents() + _generated_secrets(),
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_against_the_kubernetes_schemas(document, version):
    kubernetes_validate.validate(document, version, strict=True)  # raises on an unknown or mistyped field


def test_the_schema_check_catches_a_mistake():
    broken = yaml.safe_load(yaml.safe_dump(STACKS))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_services_select_their_pods_and_target_named_ports():
    for service, workload in ((STACK_SERVICE, STACKS), (GATEWAY_SERVICE, GATEWAY)):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items()
        ports = _ports(_container(workload))
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']} targets a port the pod lacks"
    assert STACK_SERVICE["spec"]["clusterIP"] == "None"  # headless: each stack has a name of its own
    assert STACKS["spec"]["serviceName"] == STACK_SERVICE["metadata"]["name"]


def test_each_stack_is_serve_on_one_gpu_with_its_shared_memory_and_volumes():
    container = _container(STACKS)
    command = _command(STACKS)
    assert command.command == "serve"
    ports = _ports(container)
    assert (command.host, command.port) == ("0.0.0.0", ports["http"])
    # tritonserver on the pod's address too
    assert command.triton_host == "0.0.0.0"
    assert (ports["triton-http"], ports["triton-grpc"], ports["metrics"]) == (
        command.http_port, command.grpc_port, command.metrics_port)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    pod = STACKS["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claims = {d["metadata"]["name"] for d in _documents() if d["kind"] == "PersistentVolumeClaim"}
    for path in ("/models", "/adapters"):
        assert volumes[mounts[path]]["persistentVolumeClaim"]["claimName"] in claims
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsNonRoot"]


def test_probes_ask_the_adapter_and_triton():
    container = _container(STACKS)
    ports = _ports(container)

    def target(probe: str) -> tuple[str, int]:
        get = container[probe]["httpGet"]
        return get["path"], ports[get["port"]]

    # the adapter: 503 while Triton is not ready, or while it drains
    assert target("readinessProbe") == ("/health", ports["http"])
    assert target("livenessProbe") == target("startupProbe") == ("/v2/health/ready", _command(STACKS).http_port)
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "a large model gets minutes to load"
    gateway = _container(GATEWAY)
    assert {gateway[probe]["httpGet"]["port"] for probe in ("readinessProbe", "livenessProbe")} <= set(_ports(gateway))


def test_a_stack_stops_within_its_termination_grace_period():
    """SIGTERM: the adapter drains for shutdown_grace_s, then tritonserver exits within its exit timeout."""
    triton_exit_s = inspect.signature(launcher.TritonServer).parameters["exit_timeout_s"].default
    grace = STACKS["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > AdapterSettings.shutdown_grace_s + triton_exit_s + 5


def test_prometheus_scrapes_every_metrics_port():
    def scraped(annotations: dict) -> int:
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        return int(annotations["prometheus.io/port"])

    assert scraped(STACKS["spec"]["template"]["metadata"]["annotations"]) == _ports(_container(STACKS))["metrics"]
    assert scraped(STACK_SERVICE["metadata"]["annotations"]) == _ports(_container(STACKS))["http"]  # adapter
    gateway = _container(GATEWAY)
    assert scraped(GATEWAY["spec"]["template"]["metadata"]["annotations"]) == _ports(gateway)["metrics"]
    assert _ports(gateway)["metrics"] == _command(GATEWAY).metrics_port


def test_the_gateway_routes_to_every_stack_by_its_stable_name():
    command = _command(GATEWAY)
    assert command.command == "gateway"
    assert (command.host, command.port) == ("0.0.0.0", _ports(_container(GATEWAY))["http"])
    expected = [f"http://{STACKS['metadata']['name']}-{i}.{STACK_SERVICE['metadata']['name']}:"
                f"{STACK_SERVICE['spec']['ports'][0]['port']}" for i in range(STACKS["spec"]["replicas"])]
    assert GatewaySettings(worker_urls=command.worker_urls).urls == expected


def test_the_config_map_sets_only_real_settings():
    config = _one("ConfigMap", "tritonllm-config")
    assert [ref["configMapRef"]["name"] for ref in _container(STACKS)["envFrom"]] == ["tritonllm-config"]
    known = {env_name(field) for cls in (EngineConfig, InstanceGroup, AdapterSettings, ServeSettings)
             for field in settings_fields(cls)}
    assert set(config["data"]) <= known
    mounts = {mount["name"]: mount["mountPath"] for mount in _container(STACKS)["volumeMounts"]}
    assert config["data"]["TRITONLLM_LORA_DIR"] == mounts["adapters"]


# --- the doors: the API key from a Secret, and who may reach which port ------------------------------------------

def _policy(workload: dict) -> dict:
    """The NetworkPolicy that selects the workload's pods (exactly one)."""
    labels = workload["spec"]["template"]["metadata"]["labels"]
    [policy] = [d for d in _documents() if d["kind"] == "NetworkPolicy"
                and d["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    return policy


def _admitted(workload: dict) -> set[tuple[str, str]]:
    """(who, port name) pairs the workload's policy admits: who is a workload's name, `ns:<namespace>`, or `any`."""
    workloads = {STACKS["metadata"]["name"]: STACKS, GATEWAY["metadata"]["name"]: GATEWAY}
    ports = _ports(_container(workload))
    admitted = set()
    for rule in _policy(workload)["spec"]["ingress"]:
        peers = []
        for peer in rule.get("from", [{}]):
            if "podSelector" in peer:
                selector = peer["podSelector"]["matchLabels"].items()
                [name] = [name for name, other in workloads.items()
                          if selector <= other["spec"]["template"]["metadata"]["labels"].items()]
                peers.append(name)
            elif "namespaceSelector" in peer:
                peers.append("ns:" + peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
            else:
                peers.append("any")
        assert "ports" in rule, "a rule without ports admits every port"
        for port in rule["ports"]:
            assert port["port"] in ports, f"the policy names a port the pod lacks: {port['port']}"
            admitted |= {(peer, port["port"]) for peer in peers}
    return admitted


def test_only_the_gateway_reaches_a_stacks_api_and_monitoring_its_metrics():
    gateway = GATEWAY["metadata"]["name"]
    # 9000 for monitoring too: the adapter's /metrics is there (every other route asks for the key)
    assert _admitted(STACKS) == {(gateway, "http"), ("ns:monitoring", "metrics"), ("ns:monitoring", "http")}
    # Triton's own APIs: no pod but its own (the kubelet's probes come from the node)
    assert not {port for _, port in _admitted(STACKS)} & {"triton-http", "triton-grpc"}
    assert _admitted(GATEWAY) == {("any", "http"), ("ns:monitoring", "metrics")}


def test_the_key_comes_from_a_secret_as_a_file():
    [secret] = _generated_secrets()
    [key_file] = secret["data"]
    assert (MANIFESTS / key_file).relative_to(REPO_ROOT).as_posix() in (REPO_ROOT / ".gitignore").read_text()
    for workload in (STACKS, GATEWAY):
        container = _container(workload)
        volumes = {volume["name"]: volume for volume in workload["spec"]["template"]["spec"]["volumes"]}
        [mount] = [mount for mount in container["volumeMounts"]
                   if volumes[mount["name"]].get("secret", {}).get("secretName") == secret["metadata"]["name"]]
        assert mount["readOnly"]
        env = {variable["name"]: variable for variable in container["env"]}
        assert env[API_KEY_ENV + "_FILE"]["value"] == f"{mount['mountPath']}/{key_file}"
        assert API_KEY_ENV not in env and not any("secretRef" in ref for ref in container.get("envFrom", []))
        command = _command(workload)
        assert command.api_key is None and command.api_key_file is None  # nothing on the command line
    config = _one("ConfigMap", "tritonllm-config")
    assert not [name for name in config["data"] if "KEY" in name]


def test_the_images_are_those_the_compose_files_build():
    [version] = re.findall(r'^version = "([^"]+)"$', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert {image["name"]: image["newTag"] for image in KUSTOMIZATION["images"]} == {
        "tritonllm": version, "tritonllm-gateway": version}
    assert (_container(STACKS)["image"], _container(GATEWAY)["image"]) == ("tritonllm", "tritonllm-gateway")
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.scale.yml").read_text())["services"]
    built = {re.fullmatch(r"\$\{\w+:-([\w-]+):([\w.]+)\}", service["image"]).groups() for service in compose.values()}
    assert built == {("tritonllm", version), ("tritonllm-gateway", version)}


def test_a_wildcard_triton_host_is_reached_on_loopback(tmp_path):
    """The stack binds tritonserver to 0.0.0.0; serve itself (readiness, the adapter) connects on loopback."""
    server = launcher.TritonServer(tmp_path, tmp_path, host="0.0.0.0", tritonserver=Path("/bin/true"))
    assert (server.http_url, server.grpc_url, server.metrics_url) == (
        "http://127.0.0.1:8000", "127.0.0.1:8001", "http://127.0.0.1:8002/metrics")
    assert "--http-address=0.0.0.0" in server._command(tmp_path)
