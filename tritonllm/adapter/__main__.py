"""python -m tritonllm.adapter: serve the OpenAI-compatible API in front of a running tritonserver."""

import argparse

from tritonllm.interface import settings
from tritonllm.adapter.app import run
from tritonllm.adapter.settings import AdapterSettings


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonllm.adapter", description=__doc__)
    parser.add_argument("--served-model-name", required=True, help="model name clients must send")
    settings.add_options(parser, AdapterSettings)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args()
    run(settings.from_options(AdapterSettings, args, served_model_name=args.served_model_name),
        host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
