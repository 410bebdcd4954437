"""API-key authentication of the /v1 routes (Bearer tokens, as OpenAI's SDKs send them, or Anthropic's
`x-api-key` header)."""

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Depends
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from tritonllm.adapter.errors import invalid_api_key

# auto_error=False: a missing or non-Bearer header reaches us as None, so the refusal keeps OpenAI's format.
# Declared as a dependency, it also puts the bearer security scheme into the OpenAPI document.
_bearer = HTTPBearer(auto_error=False)
_x_api_key = APIKeyHeader(name="x-api-key", auto_error=False)  # what Anthropic's SDK sends


def api_key_dependency(api_key: str) -> Callable[..., Awaitable[None]]:
    """A route dependency that refuses (401) any request without `Authorization: Bearer <api_key>`."""
    expected = api_key.encode()

    async def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(_bearer),
                              x_api_key: str | None = Depends(_x_api_key)) -> None:
        given = credentials.credentials if credentials is not None else x_api_key
        if given is None:
            raise invalid_api_key(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or in an x-api-key header."
            )
        # Constant-time comparison: response timing must not reveal how much of a guess was right.
        if not hmac.compare_digest(given.encode(), expected):
            raise invalid_api_key("Incorrect API key provided.")

    return require_api_key
