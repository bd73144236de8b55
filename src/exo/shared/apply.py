"""`apply(state, indexed_event) -> state`: pure and total.

Every event kind is handled; an event that names something unknown (a node
that already timed out, a deleted instance) leaves the state as it was, so
replaying any prefix of the log is always well defined.
"""

from exo.shared.types.events import (
    DownloadProgressed,
    DownloadRemoved,
    HistoryDiverged,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    MasterElected,
    ModelCardPublished,
    ModelFoldersUnreadable,
    ModelUnplaced,
    NodeForgotten,
    NodeJoined,
    NodeReachable,
    NodeTelemetryReported,
    NodeTimedOut,
    NodeUnreachable,
    ReplicaReported,
    RunnerStatusChanged,
)
from exo.shared.types.state import NodeInfo, ReplicaReport, RunnerInfo, State


def _seen(state: State, indexed: IndexedEvent) -> State:
    node = state.nodes.get(indexed.origin)
    if node is None or node.last_seen_ms >= indexed.at_ms:
        return state
    nodes = {**state.nodes, node.node_id: node.model_copy(update={"last_seen_ms": indexed.at_ms})}
    return state.model_copy(update={"nodes": nodes})


def _with_node(state: State, node: NodeInfo) -> State:
    return state.model_copy(update={"nodes": {**state.nodes, node.node_id: node}})


def _apply_event(state: State, indexed: IndexedEvent) -> State:
    event = indexed.event
    match event:
        case NodeJoined():
            known = state.nodes.get(event.node_id)
            node = NodeInfo(
                node_id=event.node_id,
                grpc_address=event.grpc_address,
                api_address=event.api_address,
                started_at_ms=event.started_at_ms,
                hostname=event.hostname,
                telemetry=known.telemetry if known else None,
                last_seen_ms=indexed.at_ms,
                last_heartbeat_ms=known.last_heartbeat_ms if known else None,
                # Whether the master's link hears it is the master's to say.
                unreachable_since_ms=known.unreachable_since_ms if known else None,
            )
            gone = {k: v for k, v in state.gone_nodes.items() if k != event.node_id}
            return _with_node(state, node).model_copy(update={"gone_nodes": gone})
        case NodeTelemetryReported():
            node = state.nodes.get(event.node_id)
            if node is None:
                return state
            updated = node.model_copy(update={"telemetry": event.telemetry})
            return state.model_copy(update={"nodes": {**state.nodes, event.node_id: updated}})
        case NodeTimedOut():
            if event.node_id not in state.nodes:
                return state
            # An instance cannot serve without any of its ranks.
            gone = {i for i, inst in state.instances.items() if event.node_id in inst.node_ids}
            left = state.nodes[event.node_id].model_copy(update={"timed_out_at_ms": indexed.at_ms})
            return state.model_copy(
                update={
                    "nodes": {k: v for k, v in state.nodes.items() if k != event.node_id},
                    "gone_nodes": {**state.gone_nodes, event.node_id: left},
                    "instances": {k: v for k, v in state.instances.items() if k not in gone},
                    "runners": {k: v for k, v in state.runners.items() if k not in gone},
                    "replicas": {k: v for k, v in state.replicas.items() if k not in gone},
                    "downloads": {k: v for k, v in state.downloads.items() if k != event.node_id},
                    "unreadable_models": {
                        k: v for k, v in state.unreadable_models.items() if k != event.node_id
                    },
                    "master_id": None if state.master_id == event.node_id else state.master_id,
                }
            )
        case NodeUnreachable():
            node = state.nodes.get(event.node_id)
            if node is None:
                return state
            heard = max(node.last_heartbeat_ms or 0, event.last_heard_ms or 0) or None
            since = node.unreachable_since_ms or indexed.at_ms
            return _with_node(
                state,
                node.model_copy(update={"last_heartbeat_ms": heard, "unreachable_since_ms": since}),
            )
        case NodeReachable():
            node = state.nodes.get(event.node_id)
            if node is None or node.unreachable_since_ms is None:
                return state
            heard = max(node.last_heartbeat_ms or 0, indexed.at_ms)
            return _with_node(
                state,
                node.model_copy(update={"unreachable_since_ms": None, "last_heartbeat_ms": heard}),
            )
        case NodeForgotten():
            gone = {k: v for k, v in state.gone_nodes.items() if k != event.node_id}
            return state.model_copy(update={"gone_nodes": gone})
        case MasterElected():
            if event.term < state.master_term:
                return state  # a stale election result
            return state.model_copy(
                update={"master_id": event.master_id, "master_term": event.term}
            )
        case InstanceCreated():
            if any(node_id not in state.nodes for node_id in event.instance.node_ids):
                return state
            instances = {**state.instances, event.instance.instance_id: event.instance}
            # Placed again (or by hand): no longer waiting for a placement.
            model_id = event.instance.model_id
            unplaced = {k: v for k, v in state.unplaced.items() if k != model_id}
            return state.model_copy(update={"instances": instances, "unplaced": unplaced})
        case InstanceDeleted():
            return state.model_copy(
                update={
                    "instances": {
                        k: v for k, v in state.instances.items() if k != event.instance_id
                    },
                    "runners": {k: v for k, v in state.runners.items() if k != event.instance_id},
                    "replicas": {k: v for k, v in state.replicas.items() if k != event.instance_id},
                }
            )
        case RunnerStatusChanged():
            instance = state.instances.get(event.instance_id)
            if instance is None or event.node_id not in instance.node_ids:
                return state
            known = state.runners.get(event.instance_id, {}).get(event.node_id)
            runner = RunnerInfo(
                instance_id=event.instance_id,
                node_id=event.node_id,
                status=event.status,
                error=event.error,
                served=event.status in ("ready", "running") or (known is not None and known.served),
            )
            ranks = {**state.runners.get(event.instance_id, {}), event.node_id: runner}
            return state.model_copy(update={"runners": {**state.runners, event.instance_id: ranks}})
        case ModelCardPublished():
            cards = {**state.cards, event.card.model_id: event.card}
            return state.model_copy(update={"cards": cards})
        case DownloadProgressed():
            if event.node_id not in state.nodes:
                return state
            models = {
                **state.downloads.get(event.node_id, {}),
                event.progress.model_id: event.progress,
            }
            return state.model_copy(
                update={"downloads": {**state.downloads, event.node_id: models}}
            )
        case DownloadRemoved():
            models = {
                k: v
                for k, v in state.downloads.get(event.node_id, {}).items()
                if k != event.model_id
            }
            downloads = {**state.downloads, event.node_id: models}
            if not models:
                downloads.pop(event.node_id)
            return state.model_copy(update={"downloads": downloads})
        case ModelFoldersUnreadable():
            if event.node_id not in state.nodes:
                return state
            unreadable = {
                k: v for k, v in state.unreadable_models.items() if k != event.node_id
            } | ({event.node_id: event.folders} if event.folders else {})
            return state.model_copy(update={"unreadable_models": unreadable})
        case ReplicaReported():
            instance = state.instances.get(event.instance_id)
            if instance is None or instance.ranks[0].node_id != event.node_id:
                return state
            known = state.replicas.get(event.instance_id, ReplicaReport())
            report = ReplicaReport(
                cached=(known.cached - set(event.cached_removed)) | set(event.cached_added),
                load=known.load if event.load is None else event.load,
                wait_tokens=known.wait_tokens if event.wait_tokens is None else event.wait_tokens,
            )
            return state.model_copy(
                update={"replicas": {**state.replicas, event.instance_id: report}}
            )
        case HistoryDiverged():
            set_aside = {**state.set_aside, event.node_id: event.set_aside}
            return state.model_copy(update={"set_aside": set_aside})
        case ModelUnplaced():
            unplaced = {k: v for k, v in state.unplaced.items() if k != event.model_id}
            if event.unplaced is not None:
                unplaced[event.model_id] = event.unplaced
            return state.model_copy(update={"unplaced": unplaced})


def apply(state: State, indexed: IndexedEvent) -> State:
    """The state after `indexed`; the caller feeds events in `idx` order."""
    applied = _seen(_apply_event(state, indexed), indexed)
    return applied.model_copy(update={"last_idx": indexed.idx})
