"""Call the Triton model `llm` over plain HTTP with Triton's generate extension (no tritonclient needed).

    python examples/http_generate.py --url http://127.0.0.1:8000 "The capital of France is"          # one response
    python examples/http_generate.py --url http://127.0.0.1:8000 --stream "The capital of France is" # SSE

JSON fields map to the model's input tensors by name; `sampling_parameters` is a JSON string, as in
Triton's vllm_backend. Against a server started with an API key, give the same key (TRITONLLM_API_KEY or
--api-key-file): Triton then requires a header derived from it on every call but health (docs/security.md)."""

import argparse
import json
import os

import httpx

from tritonllm.interface.api_key import API_KEY_ENV, read_api_key, triton_headers


def check(response: httpx.Response) -> None:
    """Exit with Triton's own message (e.g. 403: a restricted API called without the key's header)."""
    if response.is_error:
        raise SystemExit(f"error {response.status_code}: {response.read().decode()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--api-key-file", help=f"the server's API key (else ${API_KEY_ENV}, if set)")
    args = parser.parse_args()
    headers = triton_headers(read_api_key(os.environ.get(API_KEY_ENV), args.api_key_file))

    body = {"text_input": args.prompt, "stream": args.stream, "exclude_input_in_output": True,
            "return_finish_reason": True,
            "sampling_parameters": json.dumps({"max_tokens": args.max_tokens, "temperature": 0})}
    if not args.stream:
        response = httpx.post(f"{args.url}/v2/models/llm/generate", json=body, headers=headers, timeout=300)
        check(response)
        print(response.json()["text_output"])
        return
    with httpx.stream("POST", f"{args.url}/v2/models/llm/generate_stream", json=body, headers=headers,
                      timeout=300) as response:
        check(response)
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise SystemExit(f"error: {event['error']}")
                print(event["text_output"], end="", flush=True)
    print()


if __name__ == "__main__":
    main()
