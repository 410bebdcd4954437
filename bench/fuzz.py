"""Fuzz a running tritonllm stack's OpenAI API with schemathesis, from the API's own /openapi.json.

Start the stack first (`make serve`), then:  .venv/bin/python bench/fuzz.py [--examples 2000] [--seed N]

Valid and invalid requests are generated for every documented operation; each response must not be a 5xx
and must match the documented status codes, content types and schemas. Generation stays quick: every
completion is pointed at the served model with a small max_tokens and at most a few prompts, so the engine
(not the queue) is what gets exercised. tests/test_reliability.py runs a short campaign of the same.
"""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit

import hypothesis
import schemathesis
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_TOKENS = 4
# routes that generate: without a bound a chat request runs to the context's end (as OpenAI's) and the queue fills
OPENAI_SAMPLING_PATHS = ("/v1/completions", "/v1/chat/completions", "/invocations")  # they take min_tokens
GENERATING_PATHS = OPENAI_SAMPLING_PATHS + ("/v1/messages", "/v1/responses")
MAX_TOKENS_FIELD = {"/v1/responses": "max_output_tokens"}  # each generating route's bound, if not max_tokens
MAX_PROMPTS = 3
REQUEST_TIMEOUT_S = 60


def bounded_body(body: object, model: str, path: str = "/v1/completions") -> object:
    """A generated body for a generating route made cheap to serve; anything but a JSON object is left to be
    refused."""
    if not isinstance(body, dict):
        return body
    body = {**body, "model": model}
    if path in OPENAI_SAMPLING_PATHS:
        body["min_tokens"] = 0
    body.pop("max_completion_tokens", None)  # (chat's other spelling: max_tokens alone bounds it)
    bound = MAX_TOKENS_FIELD.get(path, "max_tokens")
    max_tokens = body.get(bound)
    body[bound] = min(max_tokens, MAX_TOKENS) if isinstance(max_tokens, int) else MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:MAX_PROMPTS]  # a batch beyond the engine's queue would only measure 503s
    return body


def run_campaign(root_url: str, model: str, *, examples: int, seed: int, api_key: str | None = None) -> int:
    """Fuzz every operation with up to `examples` cases each; raises on the first failed check.

    Returns the number of requests sent.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{root_url}/openapi.json", headers=headers)
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

        @hypothesis.settings(max_examples=examples, deadline=None, database=None, print_blob=True,
                             suppress_health_check=list(hypothesis.HealthCheck),
                             phases=[hypothesis.Phase.generate])  # no shrinking: keeps the run bounded
        @hypothesis.seed(seed)
        @hypothesis.given(cases)
        def check(case) -> None:
            nonlocal sent
            if operation.path in GENERATING_PATHS:
                case.body = bounded_body(case.body, model, operation.path)
            sent += 1
            case.call_and_validate(base_url=root_url, headers=headers, checks=CHECKS, timeout=REQUEST_TIMEOUT_S)

        check()
    return sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:9000", help="adapter root (not /v1)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    parser.add_argument("--examples", type=int, default=2000, help="cases per operation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    if urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        parser.error("refusing to fuzz a non-loopback server")
    sent = run_campaign(args.url, args.model, examples=args.examples, seed=args.seed, api_key=args.api_key)
    print(f"{sent} requests, all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
