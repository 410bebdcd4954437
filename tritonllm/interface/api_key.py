"""The API key, declared once for `serve`, the adapter, the gateway and tritonserver: where it is read from, and
the header that Triton's own protocols require once a key is set.

Triton's restricted-protocol options take the header's value on tritonserver's command line, which `ps` shows to
every user of the host, so tritonserver is never given the key itself but a value derived from it (HMAC-SHA256,
one-way): reading tritonserver's command line grants what reaching Triton's ports with it grants, not the key that
guards the adapter and the gateway. Whoever holds the key computes the same value (`triton_headers`), so the
tritonclient examples and a tritonserver started elsewhere (Compose) agree with `serve` without sharing anything
more."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

API_KEY_ENV = "TRITONLLM_API_KEY"
"""The variable the `api_key` setting reads (interface/settings.py names it from the field; a test checks they
agree): processes that need no key (tritonserver, the engine) are started without it."""
TRITON_KEY_HEADER = "tritonllm-key"
"""The header Triton's HTTP endpoint checks on the restricted APIs."""
TRITON_GRPC_KEY_HEADER = "triton-grpc-protocol-" + TRITON_KEY_HEADER
"""The metadata key Triton's gRPC endpoint checks: tritonserver prefixes a restricted protocol's header key."""
RESTRICTED_APIS = ("metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics",
                   "trace", "logging")
"""Every API group of tritonserver 2.51 but `health`, which stays open for probes."""
_DERIVATION_LABEL = b"tritonllm: the value of Triton's restricted-protocol header"


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key: the file's content (one line; a trailing newline is not part of it) when a file is named, else
    the value; empty means none."""
    if api_key_file:
        if api_key:
            raise ValueError("give the API key once: --api-key (TRITONLLM_API_KEY) or --api-key-file, not both")
        api_key = Path(api_key_file).read_text().strip()
        if not api_key:
            raise ValueError(f"--api-key-file {api_key_file} is empty")
    return api_key or None


def triton_secret(api_key: str) -> str:
    """The value tritonserver checks in place of the key (what its command line shows)."""
    return hmac.new(api_key.encode(), _DERIVATION_LABEL, hashlib.sha256).hexdigest()


def triton_headers(api_key: str | None) -> dict[str, str]:
    """The headers every call to tritonserver sends, over HTTP or gRPC (each protocol reads its own and ignores
    the other); none without a key."""
    if api_key is None:
        return {}
    secret = triton_secret(api_key)
    return {TRITON_KEY_HEADER: secret, TRITON_GRPC_KEY_HEADER: secret}
