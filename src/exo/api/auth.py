"""Who may use the HTTP API: the API key, and the Host/Origin check that keeps
web pages on other sites away from an API bound to this machine only.

With an API key, every route but `/health` and the dashboard's own files (the
page must load to ask for the key) needs it, as `Authorization: Bearer KEY`
(OpenAI's clients) or `x-api-key: KEY` (Anthropic's). All nodes of a cluster
share it: a node relays a request to the node serving its model with the
client's key.

An API bound to a loopback address answers only requests that name a loopback
host and, from a browser, come from a loopback origin. A page on another site
that rebinds its DNS name to 127.0.0.1 (DNS rebinding) still sends its own name
as `Host`, so it gets a 403 rather than the cluster.
"""

import hmac
import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from exo.api.errors import APIError, error_response
from exo.shared.types.frozen import FrozenModel

LOOPBACK_NAMES = ("localhost",)
PUBLIC_PATHS = ("/health", "/")
PUBLIC_PREFIXES = ("/dashboard/",)


class APIAccess(FrozenModel):
    """Who may use the API: those who present `api_key` (anyone when None);
    with `loopback_only`, only requests to and from this machine."""

    api_key: str | None = None
    loopback_only: bool = False

    @classmethod
    def for_bind(cls, host: str, api_key: str | None) -> "APIAccess":
        """The access rules of an API bound to `host`."""
        return cls(api_key=api_key or None, loopback_only=is_loopback_address(host))

    @property
    def open_to_the_network(self) -> bool:
        """Anyone on the network may use the API: no key, and not bound to loopback."""
        return self.api_key is None and not self.loopback_only


def is_loopback_address(host: str) -> bool:
    """`host` (a name or an address, IPv6 maybe in brackets) is this machine only."""
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(authority: str) -> str:
    """The host of a `Host` header value (`name:port`, `[::1]:port`, `name`)."""
    if authority.startswith("["):
        return authority[: authority.find("]") + 1] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


def is_loopback_origin(origin: str) -> bool:
    """A browser `Origin` (`scheme://host[:port]`) on this machine; `null` is not."""
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and is_loopback_address(parts.hostname or "")


def presented_key(request: Request) -> str | None:
    """The API key the request carries: a bearer token, or Anthropic's `x-api-key`."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key")


def key_matches(presented: str | None, expected: str) -> bool:
    # Constant time: the comparison must not tell how much of a guess was right.
    return presented is not None and hmac.compare_digest(
        presented.encode("utf-8"), expected.encode("utf-8")
    )


def is_public(path: str) -> bool:
    """Routes open without a key: health checks, and the dashboard's files."""
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def access_error(
    request: Request, access: APIAccess, node_label: str | None = None
) -> APIError | None:
    """Why `request` may not use the API; None when it may. `node_label` names
    this node (its id and host name) in a refusal, so that a user who reaches
    several nodes knows which one asked for a key."""
    if access.loopback_only:
        host = host_of(request.headers.get("host", ""))
        if not is_loopback_address(host):
            return APIError(
                403,
                f"this API is bound to a loopback address and answers only requests to "
                f"localhost, 127.0.0.1 or [::1], not to {host!r} (a DNS rebinding guard)",
                "invalid_request_error",
                "forbidden_host",
            )
        origin = request.headers.get("origin")
        if origin is not None and not is_loopback_origin(origin):
            return APIError(
                403,
                f"this API is bound to a loopback address and answers only pages served "
                f"from this machine, not from {origin!r}",
                "invalid_request_error",
                "forbidden_origin",
            )
    if (
        access.api_key is not None
        and not is_public(request.url.path)
        and not key_matches(presented_key(request), access.api_key)
    ):
        presented = presented_key(request)
        who = f"{node_label or 'this node'} at {request.headers.get('host', '?')}"
        problem = (
            "needs an API key"
            if presented is None
            else "refused the API key it was sent (not this node's key)"
        )
        return APIError(
            401,
            f"{who} {problem}: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            "invalid_request_error",
            "invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


class AccessMiddleware:
    """Answers a request that may not use the API (`access_error`) before any
    route sees it."""

    def __init__(
        self, app: ASGIApp, access: APIAccess, node_label: Callable[[], str] | None = None
    ) -> None:
        self.app = app
        self.access = access
        self.node_label = node_label

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        # Only a refused key names the node (and a node without a key never asks).
        label = self.node_label() if self.node_label and self.access.api_key else None
        error = access_error(request, self.access, label)
        if error is None:
            await self.app(scope, receive, send)
            return
        await error_response(request, error)(scope, receive, send)
