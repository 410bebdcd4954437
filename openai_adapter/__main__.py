"""python -m openai_adapter: serve the OpenAI-compatible API in front of a running tritonserver."""

import argparse

from openai_adapter.app import run
from openai_adapter.settings import AdapterSettings


def main() -> None:
    defaults = AdapterSettings(served_model_name="")  # so every default is stated once, in AdapterSettings
    parser = argparse.ArgumentParser(prog="python -m openai_adapter", description=__doc__)
    parser.add_argument("--served-model-name", required=True, help="model name clients must send")
    parser.add_argument("--triton-url", default=defaults.triton_url, help="tritonserver gRPC host:port")
    parser.add_argument("--triton-model", default=defaults.triton_model, help="name of the Triton model")
    parser.add_argument(
        "--request-timeout", type=float, default=defaults.request_timeout_s, help="seconds per Triton call"
    )
    parser.add_argument("--health-timeout", type=float, default=defaults.health_timeout_s, help="seconds for /health")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args()
    settings = AdapterSettings(
        served_model_name=args.served_model_name,
        triton_url=args.triton_url,
        triton_model=args.triton_model,
        request_timeout_s=args.request_timeout,
        health_timeout_s=args.health_timeout,
    )
    run(settings, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
