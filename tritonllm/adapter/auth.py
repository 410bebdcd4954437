"""API-key authentication of the /v1 routes (Bearer tokens, as OpenAI's SDKs send them)."""

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tritonllm.adapter.errors import invalid_api_key

# auto_error=False: a missing or non-Bearer header reaches us as None, so the refusal keeps OpenAI's format.
# Declared as a dependency, it also puts the bearer security scheme into the OpenAPI document.
_bearer = HTTPBearer(auto_error=False)


def api_key_dependency(api_key: str) -> Callable[..., Awaitable[None]]:
    """A route dependency that refuses (401) any request without `Authorization: Bearer <api_key>`."""
    expected = api_key.encode()

    async def require_api_key(credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if credentials is None:
            raise invalid_api_key(
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        # Constant-time comparison: response timing must not reveal how much of a guess was right.
        if not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise invalid_api_key("Incorrect API key provided.")

    return require_api_key
