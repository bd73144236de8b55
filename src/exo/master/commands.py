"""`decide(state, command) -> events`: pure; a command that cannot be carried
out raises `CommandRejected` with a message for the user. A command that brings
the card of a model the state has none of publishes it with the instance."""

from collections.abc import Sequence

from exo.master.placement import (
    MIN_TENSOR_RANKS,
    PlacementError,
    PlacementRequest,
    place,
)
from exo.shared.architectures import tensor_refusal
from exo.shared.tensor_split import TensorSplit, card_split
from exo.shared.types.commands import (
    Command,
    CommandRejected,
    CreateInstance,
    DeleteInstance,
    ForgetNode,
    PlaceInstance,
)
from exo.shared.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    ModelCardPublished,
    NodeForgotten,
)
from exo.shared.types.ids import ModelId
from exo.shared.types.model_card import ModelCard
from exo.shared.types.state import Instance, InstanceRank, Sharding, State

# The ranks of multi-node instances listen for mx.distributed on ports in
# [RING_BASE_PORT, RING_BASE_PORT + RING_PORT_SPAN).
RING_BASE_PORT = 52500
RING_PORT_SPAN = 1000


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def ring_hosts(state: State, ranks: Sequence[InstanceRank]) -> tuple[str, ...]:
    """ "ip:port" for each rank's runner: the node's gRPC host and the lowest
    ports from `RING_BASE_PORT` that no other instance uses on that host."""
    if len(ranks) == 1:
        return ()
    taken = {address for instance in state.instances.values() for address in instance.ring_hosts}
    hosts: list[str] = []
    for rank in ranks:
        grpc_address = state.nodes[rank.node_id].grpc_address
        if grpc_address is None:
            raise CommandRejected(f"node {rank.node_id} has no cluster address for its rank")
        start = (state.last_idx + 1) % RING_PORT_SPAN
        port = next(
            RING_BASE_PORT + (start + i) % RING_PORT_SPAN
            for i in range(RING_PORT_SPAN)
            if f"{_host(grpc_address)}:{RING_BASE_PORT + (start + i) % RING_PORT_SPAN}" not in taken
        )
        address = f"{_host(grpc_address)}:{port}"
        taken.add(address)
        hosts.append(address)
    return tuple(hosts)


def _layout(ranks: Sequence[InstanceRank]) -> str:
    return ", ".join(f"{r.node_id}[{r.start_layer},{r.end_layer})" for r in ranks)


def _check_pipeline(
    model_id: ModelId, card: ModelCard | None, ranks: Sequence[InstanceRank]
) -> None:
    start = 0
    for rank in ranks:
        if rank.start_layer != start or rank.end_layer <= rank.start_layer:
            raise CommandRejected(
                f"ranks must cover the layers in order without gaps: {_layout(ranks)}"
            )
        start = rank.end_layer
    if card is not None and start != card.n_layers:
        raise CommandRejected(f"{model_id} has {card.n_layers} layers, the ranks cover {start}")
    if any(rank.kv_heads is not None for rank in ranks):
        raise CommandRejected("kv_heads is for tensor ranks; a pipeline rank holds whole layers")


def _check_tensor(model_id: ModelId, card: ModelCard | None, ranks: Sequence[InstanceRank]) -> None:
    """Every rank holds a slice of every layer, of a model that splits so."""
    if len(ranks) < MIN_TENSOR_RANKS:
        raise CommandRejected(
            f"a tensor instance needs at least {MIN_TENSOR_RANKS} ranks, not {len(ranks)}"
        )
    n_layers = card.n_layers if card is not None else ranks[0].end_layer
    if n_layers < 1 or any(r.start_layer != 0 or r.end_layer != n_layers for r in ranks):
        raise CommandRejected(
            f"every rank of a tensor instance holds all {n_layers} layers of {model_id}, "
            f"[0,{n_layers}): {_layout(ranks)}"
        )
    if card is not None:
        split = card_split(card, len(ranks))
        why = tensor_refusal(card.architecture) or (split if isinstance(split, str) else None)
        if why is not None:
            raise CommandRejected(f"cannot split {model_id} by tensors: {why}")
        given = tuple(rank.kv_heads for rank in ranks)
        if any(given) and isinstance(split, TensorSplit) and given != split.kv_heads:
            raise CommandRejected(
                f"{len(ranks)} tensor ranks split {model_id}'s {card.n_kv_heads} KV heads "
                f"{'/'.join(map(str, split.kv_heads or ()))} in this order, not as the ranks "
                f"give them ({'/'.join(str(k) for k in given)}); leave kv_heads out"
            )


def _check_ranks(
    state: State,
    model_id: ModelId,
    card: ModelCard | None,
    ranks: Sequence[InstanceRank],
    sharding: Sharding,
) -> None:
    for rank in ranks:
        if rank.node_id not in state.nodes:
            raise CommandRejected(f"no node {rank.node_id!r} in the cluster", not_found=True)
    if len({rank.node_id for rank in ranks}) != len(ranks):
        raise CommandRejected("a node can hold only one rank of an instance")
    if sharding == "tensor":
        _check_tensor(model_id, card, ranks)
    else:
        _check_pipeline(model_id, card, ranks)
    for instance in state.instances.values():
        if instance.model_id == model_id and set(instance.node_ids) & {r.node_id for r in ranks}:
            raise CommandRejected(
                f"{model_id} already has an instance on {', '.join(instance.node_ids)} "
                f"(instance {instance.instance_id}); delete it first"
            )


def _card(state: State, command: CreateInstance | PlaceInstance) -> ModelCard | None:
    """The state's card of the model (a node that has it measured it), else the command's."""
    if command.card is not None and command.card.model_id != command.model_id:
        raise CommandRejected(
            f"the card sent describes {command.card.model_id}, not {command.model_id}"
        )
    return state.cards.get(command.model_id) or command.card


def _kv_heads(card: ModelCard | None, n_ranks: int, sharding: Sharding) -> tuple[int | None, ...]:
    """Each tensor rank's KV heads, as the runners split them; None where unknown."""
    split = card_split(card, n_ranks) if card is not None and sharding == "tensor" else None
    if isinstance(split, TensorSplit) and split.kv_heads is not None:
        return split.kv_heads
    return (None,) * n_ranks


def _create(
    state: State, command: CreateInstance | PlaceInstance, ranks: Sequence[InstanceRank]
) -> list[Event]:
    card = _card(state, command)
    _check_ranks(state, command.model_id, card, ranks, command.sharding)
    new_card = (
        [] if card is None or card.model_id in state.cards else [ModelCardPublished(card=card)]
    )
    instance = Instance(
        instance_id=command.instance_id,
        model_id=command.model_id,
        ranks=tuple(
            InstanceRank(
                node_id=r.node_id, start_layer=r.start_layer, end_layer=r.end_layer, kv_heads=kv
            )
            for r, kv in zip(ranks, _kv_heads(card, len(ranks), command.sharding), strict=True)
        ),
        ring_hosts=ring_hosts(state, ranks),
        min_nodes=command.min_nodes if isinstance(command, PlaceInstance) else 1,
        max_nodes=command.max_nodes if isinstance(command, PlaceInstance) else None,
        sharding=command.sharding,
        moved=command.moved if isinstance(command, PlaceInstance) else None,
        replicas=max(command.replicas, 1 + len(command.replica_ids))
        if isinstance(command, PlaceInstance)
        else 1,
    )
    return [*new_card, InstanceCreated(instance=instance)]


def _place_replicas(state: State, command: PlaceInstance) -> list[Event]:
    """Each instance the command asks for, placed in turn (`place` leaves out
    the nodes that serve the model already, the earlier replicas' too)."""
    card = _card(state, command)
    if card is None:
        raise CommandRejected(
            f"no node knows model {command.model_id!r}: put it in a node's models "
            "directory or make it reachable on the Hugging Face hub",
            not_found=True,
        )
    request = PlacementRequest(
        min_nodes=command.min_nodes, max_nodes=command.max_nodes, sharding=command.sharding
    )
    instance_ids = (command.instance_id, *command.replica_ids)
    events: list[Event] = []
    for number, instance_id in enumerate(instance_ids, start=1):
        try:
            placement = place(card, state, request=request)
        except PlacementError as error:
            if len(instance_ids) == 1:
                raise CommandRejected(str(error)) from error
            raise CommandRejected(
                f"cannot place {len(instance_ids)} replicas of {command.model_id}: replica "
                f"{number} does not fit ({error})"
            ) from error
        one = command.model_copy(update={"instance_id": instance_id})
        created = _create(state, one, placement.ranks)
        events += created
        for event in created:  # what the next replica's placement must see
            if isinstance(event, InstanceCreated):
                instances = {**state.instances, instance_id: event.instance}
                state = state.model_copy(update={"instances": instances})
            elif isinstance(event, ModelCardPublished):
                state = state.model_copy(update={"cards": {**state.cards, card.model_id: card}})
    return events


def decide(state: State, command: Command) -> list[Event]:
    match command:
        case CreateInstance() | PlaceInstance() if command.instance_id in state.instances:
            return []  # a retried command
        case CreateInstance():
            return _create(state, command, command.ranks)
        case PlaceInstance():
            return _place_replicas(state, command)
        case DeleteInstance():
            if command.instance_id not in state.instances:
                raise CommandRejected(f"no instance {command.instance_id!r}", not_found=True)
            return [InstanceDeleted(instance_id=command.instance_id)]
        case ForgetNode():
            if command.node_id in state.nodes:
                raise CommandRejected(
                    f"node {command.node_id} is still in the cluster: only a node that timed "
                    "out can be forgotten"
                )
            if command.node_id not in state.gone_nodes:
                raise CommandRejected(f"no node {command.node_id!r} timed out", not_found=True)
            return [NodeForgotten(node_id=command.node_id)]
