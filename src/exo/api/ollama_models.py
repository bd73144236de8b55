"""The Ollama API's model routes, over the cluster state: the models the
cluster serves (`/api/tags`), those serving now (`/api/ps`), one model's
details (`/api/show`), and a pull's progress lines (`/api/pull` places the
model with exo's placement; its nodes download it).

Ollama's fields are filled from the model's card: `size` is its weights'
bytes, `digest` a sha256 of its card (stable while the model's files are),
`details` its architecture, parameter count and quantization; `model_info`
uses Ollama's GGUF-style keys (`<architecture>.context_length`, which clients
read for the context length).
"""

import hashlib
from collections.abc import AsyncIterator
from typing import Any

from exo.api.chat_prompt import chat_template_text
from exo.api.ollama import rfc3339
from exo.api.routing import SERVING
from exo.engine.reasoning import detect_thinking_markers
from exo.shared.cluster_view import ClusterView
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import Instance, State
from exo.worker.served_model import ServedModel

# The Ollama release whose API these routes follow (clients check it for features).
OLLAMA_VERSION = "0.12.11"
# When a model leaves memory: never, until its instance is deleted.
NEVER_EXPIRES = "9999-12-31T23:59:59Z"
# exo's model folders: MLX layout (safetensors).
MODEL_FORMAT = "safetensors"
# Longest wait for the next event before a pull looks at the state again.
PULL_POLL_SECONDS = 10.0


def model_digest(model_id: ModelId, card: ModelCard | None) -> str:
    described = card.model_dump_json() if card is not None else model_id
    return hashlib.sha256(described.encode()).hexdigest()


def parameter_count(card: ModelCard) -> int:
    return card.embedding_params + sum(card.per_layer_params) + card.head_params


def _human(count: int) -> str:
    """A parameter count as Ollama shows it: 135.0M, 8.0B."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def _quantization(card: ModelCard) -> str:
    """Q4 for 4-bit affine quantization; F16 / F32 for unquantized weights."""
    if card.quantization is not None:
        return f"Q{card.quantization.bits}"
    return f"F{card.dtype_bytes * 8}"


def model_details(card: ModelCard | None) -> dict[str, Any]:
    family = card.architecture if card is not None else ""
    return {
        "parent_model": "",
        "format": MODEL_FORMAT,
        "family": family,
        "families": [family] if family else [],
        "parameter_size": _human(parameter_count(card)) if card is not None else "",
        "quantization_level": _quantization(card) if card is not None else "",
    }


def _described(model_id: ModelId, card: ModelCard | None) -> dict[str, Any]:
    """What tags and ps say of every model."""
    return {
        "name": model_id,
        "model": model_id,
        "size": card.total_bytes if card is not None else 0,
        "digest": model_digest(model_id, card),
        "details": model_details(card),
    }


def tag(model_id: ModelId, card: ModelCard | None, served_since: int) -> dict[str, Any]:
    """A model the cluster serves (`served_since`: when, 0 when another node serves it)."""
    return _described(model_id, card) | {"modified_at": rfc3339(served_since)}


def _on_gpus(state: State, instance: Instance) -> bool:
    """Every node of `instance` runs MLX on a GPU (Metal's unified memory, CUDA)."""
    for node_id in instance.node_ids:
        node = state.nodes.get(node_id)
        if node is None or node.telemetry is None or node.telemetry.mlx_backend == "cpu":
            return False
    return True


def running(state: State, context_lengths: dict[ModelId, int]) -> list[dict[str, Any]]:
    """The models with a serving instance, each once (`context_lengths`: the
    served context of the models this node serves; a card's for the others)."""
    models: dict[ModelId, dict[str, Any]] = {}
    for _, instance in sorted(state.instances.items()):
        model_id = instance.model_id
        if model_id in models or state.instance_status(instance) not in SERVING:
            continue
        card = state.cards.get(model_id)
        described = _described(model_id, card)
        context = context_lengths.get(model_id, card.context_length if card is not None else 0)
        models[model_id] = described | {
            "expires_at": NEVER_EXPIRES,
            "size_vram": described["size"] if _on_gpus(state, instance) else 0,
            "context_length": context,
        }
    return list(models.values())


def _parameters(model: ServedModel) -> str:
    """The settings a request starts from, as Ollama's Modelfile parameters:
    the whole context, and the sampling the model's generation config sets."""
    defaults = model.sampling_defaults
    values: dict[str, float | None] = {
        "num_ctx": model.context_length,
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
        "min_p": defaults.min_p,
        "repeat_penalty": defaults.repetition_penalty,
    }
    return "\n".join(f"{name} {value:g}" for name, value in values.items() if value is not None)


def show(model: ServedModel, card: ModelCard | None) -> dict[str, Any]:
    """A model this node serves. `template` is its chat template (Jinja, not
    Ollama's Go templates); capabilities: completion and tools always (exo
    teaches tool calls to a model whose template has none), thinking when the
    template writes thinking markers, vision when it reads images."""
    template = chat_template_text(model.tokenizer) or ""
    thinking = ["thinking"] if detect_thinking_markers(template) is not None else []
    vision = [] if isinstance(model.images, str) else ["vision"]
    architecture = card.architecture if card is not None else "unknown"
    info: dict[str, Any] = {
        "general.architecture": architecture,
        f"{architecture}.context_length": model.context_length,
    }
    if card is not None:
        info |= {
            "general.parameter_count": parameter_count(card),
            f"{architecture}.block_count": card.n_layers,
            f"{architecture}.embedding_length": card.hidden_size,
            f"{architecture}.attention.head_count": card.n_heads,
            f"{architecture}.attention.head_count_kv": card.n_kv_heads,
            f"{architecture}.vocab_size": card.vocab_size,
        }
    return {
        "parameters": _parameters(model),
        "template": template,
        "details": model_details(card),
        "model_info": info,
        "capabilities": ["completion", "tools", *thinking, *vision],
        "modified_at": rfc3339(model.created),
    }


def _failure(state: State, instance: Instance) -> str:
    """Why a failed instance failed: a rank's runner or download error."""
    for node_id in instance.node_ids:
        runner = state.runners.get(instance.instance_id, {}).get(node_id)
        if runner is not None and runner.error:
            return runner.error
        download = state.downloads.get(node_id, {}).get(instance.model_id)
        if download is not None and download.error:
            return download.error
    return "its runner failed"


def pull_line(state: State, model_id: ModelId) -> dict[str, Any]:
    """Where a pull of `model_id` stands: `{"status": "success"}` once an
    instance serves; the bytes downloaded while any rank downloads; the
    instance's status while it starts or loads; an `{"error"}` once its every
    instance failed or none is left."""
    instances = [i for _, i in sorted(state.instances.items()) if i.model_id == model_id]
    statuses = [state.instance_status(i) for i in instances]
    if any(status in SERVING for status in statuses):
        return {"status": "success"}
    if not instances:
        return {"error": f"{model_id} is no longer placed: its instance was deleted"}
    if all(status == "failed" for status in statuses):
        return {"error": f"{model_id} failed: {_failure(state, instances[0])}"}
    downloads = [
        download
        for instance in instances
        for node_id in instance.node_ids
        if (download := state.downloads.get(node_id, {}).get(model_id)) is not None
    ]
    if any(download.status == "downloading" for download in downloads):
        return {
            "status": f"pulling {model_id}",
            "digest": model_digest(model_id, state.cards.get(model_id)),
            "total": sum(download.bytes_total for download in downloads),
            "completed": sum(download.bytes_done for download in downloads),
        }
    waiting = next(status for status in statuses if status != "failed")
    return {"status": f"{waiting} {model_id}"}


async def pull_progress(cluster: ClusterView, model_id: ModelId) -> AsyncIterator[dict[str, Any]]:
    """The pull's lines as its instance changes, until it serves or fails."""
    last: dict[str, Any] | None = None
    while True:
        state = cluster.state
        line = pull_line(state, model_id)
        if line != last:
            yield line
            last = line
        if "error" in line or line["status"] == "success":
            return
        await cluster.wait_until(state.last_idx + 1, PULL_POLL_SECONDS)
