"""python -m openai_adapter: serve the OpenAI-compatible API in front of a running tritonserver."""

import argparse
import os

from openai_adapter.app import run
from openai_adapter.settings import API_KEY_ENV, AdapterSettings


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
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer <key>' on /v1 routes [env {API_KEY_ENV}; default: no auth]",
    )
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="largest request body")
    parser.add_argument("--max-prompts", type=int, default=defaults.max_prompts, help="prompts per request")
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="largest n")
    parser.add_argument("--max-best-of", type=int, default=defaults.max_best_of, help="largest best_of")
    parser.add_argument(
        "--max-tokens", type=int, default=defaults.max_tokens, help="largest max_tokens (default: the context's)"
    )
    parser.add_argument("--lora-dir", default=None, help="the engine's LoRA adapters directory (default: LoRA off)")
    parser.add_argument("--triton-metrics-url", default=None,
                        help="tritonserver's metrics endpoint, e.g. http://127.0.0.1:8002/metrics (loaded adapters)")
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
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_prompts=args.max_prompts,
        max_n=args.max_n,
        max_best_of=args.max_best_of,
        max_tokens=args.max_tokens,
        lora_dir=args.lora_dir,
        triton_metrics_url=args.triton_metrics_url,
    )
    run(settings, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
