"""The TLS identity of a node's cluster link, and how a peer's is learned.

Every node has a self-signed certificate (an EC P-256 key), made at first start
and kept in its data dir. Nobody vouches for it: a node dials a peer by first
reading the certificate the peer presents, then opening a gRPC channel that
trusts exactly that certificate. Whether the peer belongs to the cluster is
settled afterwards by the challenge in `exo.cluster.auth`, whose proofs are
bound to the certificate's fingerprint, so a relay (a third party in the
middle with a certificate of its own) cannot pass on a proof.

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
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CERTIFICATE_HOST = "exo-node"
CERTIFICATE_FILE = "cert.pem"
KEY_FILE = "key.pem"
CERTIFICATE_YEARS = 100


def fingerprint(certificate_pem: bytes) -> bytes:
    """sha256 of the certificate's DER bytes."""
    der = x509.load_pem_x509_certificate(certificate_pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).digest()


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _self_signed() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
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
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


@dataclass(frozen=True)
class NodeCertificate:
    certificate_pem: bytes
    key_pem: bytes

    @property
    def fingerprint(self) -> bytes:
        return fingerprint(self.certificate_pem)

    @classmethod
    def load_or_create(cls, directory: Path) -> "NodeCertificate":
        """The certificate kept in `directory`, made there first if it has none."""
        cert_path, key_path = directory / CERTIFICATE_FILE, directory / KEY_FILE
        if not (cert_path.exists() and key_path.exists()):
            directory.mkdir(parents=True, exist_ok=True)
            certificate_pem, key_pem = _self_signed()
            _write_atomically(key_path, key_pem, 0o600)
            _write_atomically(cert_path, certificate_pem, 0o644)
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
