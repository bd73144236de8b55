"""What a node tells the cluster about the replicas whose first rank it holds:
their load and what their prefix caches hold (`ReplicaReported`), so that
every node's API can route requests among replicas (`exo.api.routing`)."""

from collections.abc import Sequence

from exo.shared.cluster_view import ClusterView
from exo.shared.types.events import ReplicaReported
from exo.shared.types.ids import InstanceId, ModelId


def local_replica(cluster: ClusterView, model_id: ModelId) -> InstanceId | None:
    """The instance of `model_id` whose first rank is this node's, if any."""
    for instance_id, instance in sorted(cluster.state.instances.items()):
        if instance.model_id == model_id and instance.ranks[0].node_id == cluster.node_id:
            return instance_id
    return None


def has_replicas(cluster: ClusterView, model_id: ModelId) -> bool:
    """Whether the cluster has more than one instance of `model_id`: only then
    is there a choice to route (a lone instance's reports would only grow the log)."""
    return sum(i.model_id == model_id for i in cluster.state.instances.values()) > 1


def report_load(
    cluster: ClusterView, model_id: ModelId, load: int, wait_tokens: int | None = None
) -> None:
    """`wait_tokens`: what a request waiting for a slot costs there (None: not measured)."""
    instance_id = local_replica(cluster, model_id)
    if instance_id is not None and has_replicas(cluster, model_id):
        cluster.publish(
            ReplicaReported(
                node_id=cluster.node_id,
                instance_id=instance_id,
                load=load,
                wait_tokens=wait_tokens,
            )
        )


class CacheReports:
    """Publishes what each first-rank runner's prefix cache holds, as the
    digests added and removed since the last report (or since the state's)."""

    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster
        self._published: dict[InstanceId, frozenset[int]] = {}

    def changed(self, instance_id: InstanceId, summary: Sequence[int]) -> None:
        instance = self.cluster.state.instances.get(instance_id)
        if instance is None or not has_replicas(self.cluster, instance.model_id):
            return  # reported once there are replicas: at the next change
        new = frozenset(summary)
        old = self._published.get(instance_id)
        if old is None:
            known = self.cluster.state.replicas.get(instance_id)
            old = known.cached if known is not None else frozenset[int]()
        self._published[instance_id] = new
        added, removed = tuple(sorted(new - old)), tuple(sorted(old - new))
        if added or removed:
            self.cluster.publish(
                ReplicaReported(
                    node_id=self.cluster.node_id,
                    instance_id=instance_id,
                    cached_added=added,
                    cached_removed=removed,
                )
            )

    def forget(self, instance_id: InstanceId) -> None:
        self._published.pop(instance_id, None)
