"""The Ollama API's model routes over the cluster state (tags, ps, a pull's
progress), its error shape, its bodies read as JSON whatever their content
type, and `/` on the `--ollama-port`."""

from typing import Any

import ollama
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from starlette.responses import PlainTextResponse

from exo.api.errors import APIError, install_error_handlers, stream_error_event
from exo.api.ollama_models import model_digest, pull_line, running, tag
from exo.api.ollama_routes import OLLAMA_ROOT_TEXT, JsonBodyRoute, with_ollama_root
from exo.api.ollama_types import OllamaChatRequest
from exo.shared.types.state import NodeTelemetry, State
from tests.unit.test_apply import CARD, I1, I2, MODEL, A, B, inst, node, progress, runner


def telemetry(backend: str) -> NodeTelemetry:
    return NodeTelemetry.model_validate(
        {
            "ram_total": 1 << 30,
            "ram_available": 1 << 30,
            "disk_free": 1 << 30,
            "cpu_count": 2,
            "platform": "darwin",
            "mlx_backend": backend,
        }
    )


def state(**fields: Any) -> State:
    return State(**({"cards": {MODEL: CARD}, "instances": {I1: inst(I1, A, B)}} | fields))


def test_a_pull_reports_the_bytes_its_ranks_downloaded_then_success() -> None:
    downloading = state(
        downloads={A: {MODEL: progress(MODEL, "downloading")}, B: {MODEL: progress(MODEL)}}
    )
    assert pull_line(downloading, MODEL) == {
        "status": f"pulling {MODEL}",
        "digest": model_digest(MODEL, CARD),
        "total": 20,
        "completed": 11,
    }
    loading = state(runners={I1: {A: runner(I1, A, "ready"), B: runner(I1, B, "loading")}})
    assert pull_line(loading, MODEL) == {"status": f"loading {MODEL}"}
    serving = state(runners={I1: {A: runner(I1, A, "ready"), B: runner(I1, B, "ready")}})
    assert pull_line(serving, MODEL) == {"status": "success"}


def test_a_pull_ends_with_why_its_instance_failed_or_went() -> None:
    failed = state(runners={I1: {A: runner(I1, A, "failed", "out of memory")}})
    assert pull_line(failed, MODEL) == {"error": f"{MODEL} failed: out of memory"}
    assert "no longer placed" in pull_line(State(), MODEL)["error"]


def test_ps_lists_each_serving_model_once_with_its_memory() -> None:
    on_gpus = state(
        nodes={A: node(A, telemetry=telemetry("metal")), B: node(B, telemetry=telemetry("cuda"))},
        instances={I1: inst(I1, A, B), I2: inst(I2, B)},
        runners={
            I1: {A: runner(I1, A, "ready"), B: runner(I1, B, "running")},
            I2: {B: runner(I2, B, "ready")},
        },
    )
    listed = running(on_gpus, {MODEL: 2048})
    assert len(listed) == 1
    (entry,) = listed
    assert entry["size"] == entry["size_vram"] == CARD.total_bytes
    assert entry["context_length"] == 2048
    parsed = ollama.ProcessResponse.model_validate({"models": listed}).models[0]
    assert parsed.details is not None and parsed.details.family == "llama"
    assert parsed.expires_at is not None and parsed.expires_at.year == 9999
    on_cpu = on_gpus.model_copy(update={"nodes": {A: node(A, telemetry=telemetry("cpu"))}})
    assert running(on_cpu, {})[0]["size_vram"] == 0
    assert running(on_cpu, {})[0]["context_length"] == CARD.context_length
    assert running(state(), {}) == []  # nothing serves yet


def test_a_tag_describes_the_model_from_its_card() -> None:
    entry = ollama.ListResponse.model_validate(
        {"models": [tag(MODEL, CARD, 1_700_000_000)]}
    ).models[0]
    assert entry.model == MODEL and entry.size == CARD.total_bytes
    assert entry.modified_at is not None and entry.modified_at.year == 2023
    assert entry.details is not None
    assert (entry.details.parameter_size, entry.details.quantization_level) == ("800.0M", "Q4")
    unknown = tag(MODEL, None, 0)
    assert unknown["size"] == 0 and unknown["details"]["family"] == ""


def app_with_ollama_routes() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    routes = APIRouter(route_class=JsonBodyRoute)

    @routes.post("/api/chat")
    async def chat(body: OllamaChatRequest) -> dict[str, str]:  # pyright: ignore[reportUnusedFunction]
        return {"model": body.model}

    @routes.post("/api/failing")
    async def failing() -> None:  # pyright: ignore[reportUnusedFunction]
        raise APIError(429, "busy", "rate_limit_error")

    @app.get("/")
    async def dashboard() -> PlainTextResponse:  # pyright: ignore[reportUnusedFunction]
        return PlainTextResponse("dashboard")

    app.include_router(routes)
    return app


def test_errors_come_in_ollamas_shape() -> None:
    client = TestClient(app_with_ollama_routes())
    invalid = client.post("/api/chat", json={"model": "m", "messages": [], "bogus": 1})
    assert invalid.status_code == 400
    assert invalid.json() == {"error": "bogus: unknown parameter; exo does not support it"}
    assert client.post("/api/failing").json() == {"error": "busy"}
    assert client.get("/api/nothing").json() == {"error": "Not Found"}
    assert stream_error_event("/api/chat", APIError(504, "silent", "server_error")) == (
        '{"error": "silent"}\n'
    )


def test_a_body_is_read_as_json_whatever_its_content_type() -> None:
    client = TestClient(app_with_ollama_routes())
    # What `curl -d '{...}'` sends, as Ollama's documentation does.
    sent = client.post(
        "/api/chat",
        content=b'{"model": "m"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert sent.status_code == 200 and sent.json() == {"model": "m"}


def test_the_ollama_port_answers_its_root_as_ollama_does() -> None:
    app = app_with_ollama_routes()
    on_ollama_port = TestClient(with_ollama_root(app, 80))  # the test client's port
    assert on_ollama_port.get("/").text == OLLAMA_ROOT_TEXT
    assert on_ollama_port.head("/").status_code == 200
    assert on_ollama_port.post("/api/chat", json={"model": "m"}).json() == {"model": "m"}
    on_api_port = TestClient(with_ollama_root(app, 81))
    assert on_api_port.get("/").text == "dashboard"
