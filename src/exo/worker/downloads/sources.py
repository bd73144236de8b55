"""Where a node reads a model's files from: the peers that have files of it
(the most complete first), then the hub where it is enabled."""

from exo.cluster.model_files import PeerSource
from exo.cluster.tls import NodeCertificate
from exo.models.file_source import FileSource
from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.state import State
from exo.worker.downloads.hub import HubSource, hub_enabled


def model_sources(
    state: State, model_id: ModelId, self_id: NodeId, secret: str, caller: NodeCertificate
) -> list[FileSource]:
    peers: list[tuple[int, PeerSource]] = []
    for node_id, models in state.downloads.items():
        node = state.nodes.get(node_id)
        download = models.get(model_id)
        if node_id == self_id or node is None or node.grpc_address is None:
            continue
        if download is not None and download.have_files:
            source = PeerSource(node_id, node.grpc_address, secret, caller)
            peers.append((-len(download.have_files), source))
    sources: list[FileSource] = [source for _, source in sorted(peers, key=lambda p: p[0])]
    if hub_enabled():
        sources.append(HubSource())
    return sources
