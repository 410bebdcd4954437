"""Call the Triton model `llm` over plain HTTP with Triton's generate extension (no tritonclient needed).

    python examples/http_generate.py --url http://127.0.0.1:8000 "The capital of France is"          # one response
    python examples/http_generate.py --url http://127.0.0.1:8000 --stream "The capital of France is" # SSE

JSON fields map to the model's input tensors by name; `sampling_parameters` is a JSON string, as in
Triton's vllm_backend."""

import argparse
import json

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()

    body = {"text_input": args.prompt, "stream": args.stream, "exclude_input_in_output": True,
            "return_finish_reason": True,
            "sampling_parameters": json.dumps({"max_tokens": args.max_tokens, "temperature": 0})}
    if not args.stream:
        response = httpx.post(f"{args.url}/v2/models/llm/generate", json=body, timeout=300)
        response.raise_for_status()
        print(response.json()["text_output"])
        return
    with httpx.stream("POST", f"{args.url}/v2/models/llm/generate_stream", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise SystemExit(f"error: {event['error']}")
                print(event["text_output"], end="", flush=True)
    print()


if __name__ == "__main__":
    main()
