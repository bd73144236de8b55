"""A member of the cluster (it holds the secret and a key of its own) that
states another node's id."""

from dataclasses import dataclass

from exo.cluster.tls import NodeCertificate
from exo.shared.types.ids import NodeId


@dataclass(frozen=True)
class Impostor(NodeCertificate):
    """Its own certificate and key, and `claimed` where its node id goes."""

    claimed: NodeId

    @property
    def node_id(self) -> NodeId:
        return self.claimed

    @classmethod
    def of(cls, own: NodeCertificate, claimed: NodeId) -> "Impostor":
        return cls(own.certificate_pem, own.key_pem, claimed)
