"""Routing tokenizers: a node whose API serves no replica of a model keeps the
model's tokenizer while the model has several replicas elsewhere (from its own
copy here; `tests/integration/test_replicas.py` fetches one from a peer), and
drops it when they go."""

from dataclasses import dataclass
from pathlib import Path

from exo.api.generation import render
from exo.api.routing_tokenizers import RoutingTokenizers
from exo.models.cards import card_from_folder
from exo.models.chat_tokenizer import load_chat_tokenizer
from exo.models.local_store import ModelStore
from exo.shared.types.chat import ChatRequest, ChatTurn
from exo.shared.types.ids import NodeId
from exo.shared.types.state import State
from exo.worker.downloads.disk_space import DiskSpace
from tests.unit.test_apply import I1, I2, I3, MODEL, A, B, inst
from tests.unit.test_routing import node_info, state_of

C = NodeId("node-c")


@dataclass
class Node:
    """A node as the routing tokenizers see it: its id and its copy of the state."""

    node_id: NodeId
    state: State


def two_replicas_elsewhere(smollm_dir: Path) -> State:
    card = card_from_folder(MODEL, smollm_dir)
    return state_of({I2: (B, "ready"), I3: (C, "running")}).model_copy(
        update={
            "nodes": {n: node_info(n) for n in (A, B, C)},
            "cards": {MODEL: card},
        }
    )


def tokenizers_of(node: Node, models_dir: Path, tmp_path: Path) -> RoutingTokenizers:
    return RoutingTokenizers(
        node,  # type: ignore[arg-type]  # the parts of a ClusterView it uses
        ModelStore(models_dir),
        tmp_path / "routing-tokenizers",
        lambda model_id: [],  # no peers: the copy here must do
        DiskSpace(0),
    )


async def test_a_model_with_replicas_elsewhere_is_rendered_as_its_replicas_render_it(
    smollm_dir: Path, tmp_path: Path
) -> None:
    node = Node(A, two_replicas_elsewhere(smollm_dir))
    tokenizers = tokenizers_of(node, smollm_dir.parent, tmp_path)
    assert tokenizers.get(MODEL) is None
    await tokenizers.refresh()
    model = tokenizers.get(MODEL)
    assert model is not None and model.context_length == 8192
    request = ChatRequest(model=MODEL, turns=(ChatTurn(role="user", content="Which file?"),))
    prompt = await render(model, request, fetch_images=False)
    tokenizer = load_chat_tokenizer(smollm_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which file?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.tokens == tokenizer.encode(text, add_special_tokens=False)

    # One replica left: nothing to choose between, the tokenizer goes.
    node.state = state_of({I2: (B, "ready")}).model_copy(
        update={"nodes": node.state.nodes, "cards": node.state.cards}
    )
    await tokenizers.refresh()
    assert tokenizers.get(MODEL) is None


async def test_no_tokenizer_where_a_replica_is_placed_here_or_none_can_be_had(
    smollm_dir: Path, tmp_path: Path
) -> None:
    state = two_replicas_elsewhere(smollm_dir)
    # A replica of this node's own, still loading, brings its own tokenizer.
    placed_here = state.model_copy(update={"instances": {**state.instances, I1: inst(I1, A)}})
    tokenizers = tokenizers_of(Node(A, placed_here), smollm_dir.parent, tmp_path)
    assert tokenizers.wanted() == set()
    # No copy here and no source: it routes by load, and does not try again at once.
    tokenizers = tokenizers_of(Node(A, state), tmp_path / "empty", tmp_path)
    assert tokenizers.wanted() == {MODEL}
    await tokenizers.refresh()
    assert tokenizers.get(MODEL) is None
    tokenizers.models = ModelStore(smollm_dir.parent)  # a copy appears
    await tokenizers.refresh()
    assert tokenizers.get(MODEL) is None  # within the retry delay
