"""Stream a completion from the Triton model `llm` directly with tritonclient's gRPC client (no adapter).

    python examples/grpc_stream.py --url 127.0.0.1:8001 "The capital of France is"

Against a server started with an API key, give the same key (TRITONLLM_API_KEY or --api-key-file): Triton then
requires a header derived from it on every call but health (docs/security.md).
"""

import argparse
import json
import os
import queue

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tritonllm.interface.api_key import API_KEY_ENV, read_api_key, triton_headers


def tensor(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    value = grpcclient.InferInput(name, list(array.shape), datatype)
    value.set_data_from_numpy(array)
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key-file", help=f"the server's API key (else ${API_KEY_ENV}, if set)")
    args = parser.parse_args()
    headers = triton_headers(read_api_key(os.environ.get(API_KEY_ENV), args.api_key_file))

    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    inputs = [
        tensor("text_input", np.array([args.prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL"),
    ]
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    # A decoupled model answers only streaming RPCs; each new piece of text is one response.
    client.start_stream(callback=lambda result, error: responses.put((result, error)), headers=headers)
    try:
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
    except InferenceServerException:  # the stream was refused at once (e.g. no API key): the callback says why
        pass
    tokens = 0
    while True:
        result, error = responses.get()
        if error is not None:
            raise SystemExit(f"error: {error}")
        if result.as_numpy("text_output") is not None:
            print(result.as_numpy("text_output")[0].decode(), end="", flush=True)
            tokens += int(result.as_numpy("num_output_tokens")[0])  # the tokens of this response
            reason = result.as_numpy("finish_reason")[0].decode()
            if reason != "None":  # "None" while running (vllm_backend's convention)
                print(f"\n[finish_reason={reason}, tokens={tokens}]")
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()


if __name__ == "__main__":
    main()
