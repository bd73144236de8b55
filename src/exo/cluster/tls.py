"""The TLS identity of a node's cluster link, and how a peer's is learned.

Every node has a self-signed certificate (an EC P-256 key), made at first start
and kept in its data dir, and its node id is a digest of that key
(`node_id_of`): a node cannot take another's id without the other's key. Nobody
vouches for the certificate: a node dials a peer by first reading the
certificate the peer presents, then opening a gRPC channel that trusts exactly
that certificate, so the peer's id is known before a call. Whether the peer
belongs to the cluster is settled afterwards by the challenge in
`exo.cluster.auth`, whose proofs are bound to the certificate's fingerprint, so
a relay (a third party in the middle with a certificate of its own) cannot pass
on a proof; there the caller also signs with its key (`NodeCertificate.sign`,
`signed_by`), which binds its session to its id.

Every certificate names the same host, `CERTIFICATE_HOST`: channels check the
certificate itself, not a name.
"""

import datetime
import hashlib
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from exo.shared.types.ids import NodeId

CERTIFICATE_HOST = "exo-node"
CERTIFICATE_FILE = "cert.pem"
KEY_FILE = "key.pem"
CERTIFICATE_YEARS = 100
# 16 hex digits of the key's digest: a key for a given id takes ~2^64 tries.
NODE_ID_DIGEST_BYTES = 8
_SIGNATURE = ec.ECDSA(hashes.SHA256())


def fingerprint(certificate_pem: bytes) -> bytes:
    """sha256 of the certificate's DER bytes."""
    der = x509.load_pem_x509_certificate(certificate_pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).digest()


def node_id_of(certificate_pem: bytes) -> NodeId:
    """The id of the node that holds the certificate's key: "node-" and the
    first hex digits of the sha256 of its public key (SubjectPublicKeyInfo DER).
    Raises ValueError for bytes that are not a certificate."""
    key = x509.load_pem_x509_certificate(certificate_pem).public_key()
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return NodeId(f"node-{hashlib.sha256(der).digest()[:NODE_ID_DIGEST_BYTES].hex()}")


def signed_by(certificate_pem: bytes, signature: bytes, message: bytes) -> bool:
    """Whether `signature` is the certificate's EC key's signature of `message`
    (False for anything else, a certificate that cannot be read included)."""
    try:
        key = x509.load_pem_x509_certificate(certificate_pem).public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            return False
        key.verify(signature, message, _SIGNATURE)
    except (ValueError, InvalidSignature):
        return False
    return True


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _self_signed(key: ec.EllipticCurvePrivateKey) -> bytes:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CERTIFICATE_HOST)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365 * CERTIFICATE_YEARS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CERTIFICATE_HOST)]), False)
        # Its own trust anchor: peers trust exactly this certificate.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class NodeCertificate:
    """A node's certificate and key: its TLS identity and its node id."""

    certificate_pem: bytes
    key_pem: bytes

    @property
    def fingerprint(self) -> bytes:
        return fingerprint(self.certificate_pem)

    @property
    def node_id(self) -> NodeId:
        return node_id_of(self.certificate_pem)

    def sign(self, message: bytes) -> bytes:
        key = serialization.load_pem_private_key(self.key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("a node's key is an EC key")
        return key.sign(message, _SIGNATURE)

    @classmethod
    def create(cls, key: ec.EllipticCurvePrivateKey | None = None) -> "NodeCertificate":
        """A new self-signed certificate, of a new key or of `key`."""
        key = key or ec.generate_private_key(ec.SECP256R1())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cls(_self_signed(key), key_pem)

    @classmethod
    def load_or_create(cls, directory: Path) -> "NodeCertificate":
        """The certificate kept in `directory`, made there first if it has none:
        a node restarted with its data dir keeps its id."""
        cert_path, key_path = directory / CERTIFICATE_FILE, directory / KEY_FILE
        if not (cert_path.exists() and key_path.exists()):
            directory.mkdir(parents=True, exist_ok=True)
            made = cls.create()
            _write_atomically(key_path, made.key_pem, 0o600)
            _write_atomically(cert_path, made.certificate_pem, 0o644)
        return cls(cert_path.read_bytes(), key_path.read_bytes())


def peer_certificate(address: str, timeout: float) -> bytes:
    """The certificate (PEM) the node at "host:port" presents; blocking.
    Raises OSError when it cannot be read (nothing listens, no TLS)."""
    host, _, port = address.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # Not verified here: the channel trusts only this certificate, the challenge
    # tells whether its holder knows the secret.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=CERTIFICATE_HOST) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    if der is None:
        raise OSError(f"{address} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()


def server_credentials(certificate: NodeCertificate) -> grpc.ServerCredentials:
    """TLS for this node's gRPC server (callers authenticate with the secret, not a certificate)."""
    return grpc.ssl_server_credentials([(certificate.key_pem, certificate.certificate_pem)])
