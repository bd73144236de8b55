"""The API's access rules (key, Host and Origin checks) and its 500s, on an
in-process app with the real middleware and error handlers."""

import re
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from loguru import logger
from starlette.testclient import TestClient

from exo.api.auth import (
    AccessMiddleware,
    APIAccess,
    host_of,
    is_loopback_address,
    is_loopback_origin,
    is_public,
    key_matches,
)
from exo.api.errors import install_error_handlers

KEY = "s3cret-key"


def _app(access: APIAccess) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(AccessMiddleware, access=access)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/")
    async def page() -> str:
        return "page"

    @app.get("/dashboard/{name}")
    async def asset(name: str) -> str:
        return name

    @app.get("/v1/models")
    async def models() -> dict[str, list[str]]:
        return {"data": []}

    @app.post("/v1/messages")
    async def messages() -> dict[str, str]:
        return {"type": "message"}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret detail /private/path")

    return app


def _client(access: APIAccess, host: str = "127.0.0.1:52415") -> TestClient:
    return TestClient(_app(access), base_url=f"http://{host}", raise_server_exceptions=False)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("evil.example", False),
        ("localhost.evil.example", False),
        ("", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback_address(host) is loopback


@pytest.mark.parametrize(
    ("authority", "host"),
    [
        ("localhost:52415", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:52415", "[::1]"),
        ("[::1]", "[::1]"),
        ("evil.example:80", "evil.example"),
    ],
)
def test_host_of(authority: str, host: str) -> None:
    assert host_of(authority) == host


@pytest.mark.parametrize(
    ("origin", "loopback"),
    [
        ("http://localhost:52415", True),
        ("http://127.0.0.1:52415", True),
        ("https://[::1]:8443", True),
        ("http://evil.example", False),
        ("http://127.0.0.1.evil.example", False),
        ("null", False),
        ("file://", False),
    ],
)
def test_loopback_origins(origin: str, loopback: bool) -> None:
    assert is_loopback_origin(origin) is loopback


@pytest.mark.parametrize(
    ("path", "public"),
    [
        ("/health", True),
        ("/", True),
        ("/dashboard/app.js", True),
        ("/dashboard", False),
        ("/v1/models", False),
        ("/events", False),
        ("/metrics", False),
        ("/healthz", False),
    ],
)
def test_public_paths(path: str, public: bool) -> None:
    assert is_public(path) is public


@pytest.mark.parametrize(
    ("presented", "matches"),
    [(KEY, True), (None, False), ("", False), (KEY + "x", False), (KEY[:-1], False), ("é", False)],
)
def test_key_matches(presented: str | None, matches: bool) -> None:
    assert key_matches(presented, KEY) is matches


@pytest.mark.parametrize(
    ("host", "api_key", "loopback_only", "open_to_the_network"),
    [
        ("127.0.0.1", None, True, False),
        ("localhost", "", True, False),
        ("::1", KEY, True, False),
        ("0.0.0.0", None, False, True),
        ("192.168.1.10", KEY, False, False),
    ],
)
def test_access_for_bind(
    host: str, api_key: str | None, loopback_only: bool, open_to_the_network: bool
) -> None:
    access = APIAccess.for_bind(host, api_key)
    assert access.loopback_only is loopback_only
    assert access.open_to_the_network is open_to_the_network
    assert access.api_key == (api_key or None)


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"x-api-key": KEY}],
)
def test_the_key_opens_every_route(headers: dict[str, str]) -> None:
    client = _client(APIAccess(api_key=KEY))
    assert client.get("/v1/models", headers=headers).json() == {"data": []}
    assert client.post("/v1/messages", headers=headers).json() == {"type": "message"}


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"x-api-key": "wrong"}],
)
def test_no_or_a_wrong_key_is_an_openai_401(headers: dict[str, str]) -> None:
    response = _client(APIAccess(api_key=KEY)).get("/v1/models", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert "API key" in error["message"]


def test_a_wrong_key_under_messages_is_an_anthropic_401() -> None:
    response = _client(APIAccess(api_key=KEY)).post("/v1/messages", headers={"x-api-key": "no"})
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path", ["/health", "/", "/dashboard/app.js"])
def test_health_and_the_dashboard_files_need_no_key(path: str) -> None:
    assert _client(APIAccess(api_key=KEY)).get(path).status_code == 200


def test_without_a_key_the_api_is_open() -> None:
    assert _client(APIAccess()).get("/v1/models").status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.1:52415", "localhost:52415", "[::1]:52415", "localhost"])
def test_a_loopback_api_answers_loopback_hosts(host: str) -> None:
    assert _client(APIAccess(loopback_only=True), host).get("/v1/models").status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/"])
def test_a_loopback_api_refuses_other_hosts(path: str) -> None:
    """A page that rebound its name to 127.0.0.1 still sends its own name."""
    response = _client(APIAccess(loopback_only=True), "rebind.evil.example:52415").get(path)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden_host"
    assert "rebind.evil.example" in response.json()["error"]["message"]


def test_a_loopback_api_refuses_other_origins() -> None:
    client = _client(APIAccess(loopback_only=True))
    assert client.get("/v1/models", headers={"Origin": "http://localhost:52415"}).is_success
    refused = client.post("/v1/messages", headers={"Origin": "https://evil.example"})
    assert refused.status_code == 403
    assert refused.json()["error"]["type"] == "permission_error"  # Anthropic's format


def test_a_network_api_takes_any_host() -> None:
    client = _client(APIAccess(api_key=KEY), "192.168.1.10:52415")
    assert client.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200


@pytest.fixture
def log() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="ERROR")
    yield lines
    logger.remove(sink)


def test_a_500_carries_an_id_and_the_detail_goes_to_the_log(log: list[str]) -> None:
    response = _client(APIAccess()).get("/boom")
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    match = re.fullmatch(
        r"internal error \(id ([0-9a-f]{12})\); see the node's log", error["message"]
    )
    assert match is not None
    assert "secret detail" not in response.text
    logged = "".join(log)
    assert f"id {match.group(1)}" in logged
    assert "RuntimeError: secret detail /private/path" in logged
