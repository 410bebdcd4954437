"""The SMG gateway (`smg launch`, https://github.com/lightseekorg/smg) in front of tritonllm stacks: one OpenAI
endpoint that routes each request to a stack (cache-aware by default: a conversation keeps landing on the stack
that holds its prefix in KV cache). SMG registers each stack as a generic OpenAI worker and reads its /health,
/v1/models and /v1/loads. `tritonllm gateway` runs it over stacks anywhere; `tritonllm scale-out` over stacks it
starts itself."""

from __future__ import annotations

import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

from tritonllm.interface.api_key import API_KEY_ENV
from tritonllm.interface.settings import setting

SHUTDOWN_GRACE_S = 5  # SMG would otherwise wait up to 180 s for in-flight requests on SIGTERM


@dataclass(frozen=True)
class GatewaySettings:
    worker_urls: str = setting("", "the stacks' OpenAI API addresses, comma-separated "
                                   "(e.g. http://10.0.0.1:9000,http://10.0.0.2:9000)")
    host: str = setting("127.0.0.1", "gateway bind address (0.0.0.0: every interface)")
    port: int = setting(9000, "gateway port: the public OpenAI API")
    policy: str = setting("cache_aware", "SMG routing policy (cache_aware, random, round_robin, power_of_two, "
                                         "least_load, prefix_hash, ...)")
    metrics_port: int = setting(29000, "the gateway's Prometheus port", option="gateway-metrics-port")
    options: str = setting(
        "--health-check-interval-secs 5 --cb-timeout-duration-secs 10",
        "more `smg launch` options (shell syntax); the default notices a dead stack, and takes it back once "
        "restarted, within seconds", option="gateway-options")

    @property
    def urls(self) -> list[str]:
        return [url.strip() for url in self.worker_urls.split(",") if url.strip()]

    @property
    def local_url(self) -> str:
        """Where this host reaches the gateway."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def gateway_command(config: GatewaySettings) -> list[str]:
    """`smg launch` as configured, through this module's `main` (see there), with `gateway_env`."""
    if not config.urls:
        raise ValueError("the gateway needs the stacks' addresses (--worker-urls)")
    return [sys.executable, "-m", "tritonllm.gateway", "launch", "--host", config.host, "--port", str(config.port),
            "--worker-urls", *config.urls, "--policy", config.policy,
            "--prometheus-host", config.host, "--prometheus-port", str(config.metrics_port),
            "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S), *shlex.split(config.options)]


def gateway_env(api_key: str | None) -> dict[str, str]:
    """The gateway's environment: with the stacks' API key, it asks clients for the same key and presents it to
    the stacks."""
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    return env if api_key is None else {**env, API_KEY_ENV: api_key}


def routes_to_every_stack(config: GatewaySettings, api_key: str | None = None) -> bool:
    """SMG lists each stack as a healthy worker (GET /workers, its worker API)."""
    request = urllib.request.Request(f"{config.local_url}/workers",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            workers = json.load(response)["workers"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return False
    return {worker["url"] for worker in workers if worker.get("is_healthy")} >= set(config.urls)


def main() -> None:
    """smg with the key of the environment: smg takes it only as --api-key, added here inside the process, so no
    command line (ps) shows it."""
    from smg.cli import main as smg_main

    api_key = os.environ.pop(API_KEY_ENV, None)
    smg_main([*sys.argv[1:], *(["--api-key", api_key] if api_key else [])])


if __name__ == "__main__":
    main()
