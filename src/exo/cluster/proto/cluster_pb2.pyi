from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChallengeRequest(_message.Message):
    __slots__ = ("client_nonce",)
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    client_nonce: bytes
    def __init__(self, client_nonce: _Optional[bytes] = ...) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("server_nonce", "server_proof")
    SERVER_NONCE_FIELD_NUMBER: _ClassVar[int]
    SERVER_PROOF_FIELD_NUMBER: _ClassVar[int]
    server_nonce: bytes
    server_proof: bytes
    def __init__(self, server_nonce: _Optional[bytes] = ..., server_proof: _Optional[bytes] = ...) -> None: ...

class ProofRequest(_message.Message):
    __slots__ = ("client_nonce", "server_nonce", "client_proof", "node_id", "certificate", "signature")
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    SERVER_NONCE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PROOF_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    client_nonce: bytes
    server_nonce: bytes
    client_proof: bytes
    node_id: str
    certificate: bytes
    signature: bytes
    def __init__(self, client_nonce: _Optional[bytes] = ..., server_nonce: _Optional[bytes] = ..., client_proof: _Optional[bytes] = ..., node_id: _Optional[str] = ..., certificate: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SessionGrant(_message.Message):
    __slots__ = ("token", "valid_for_ms")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VALID_FOR_MS_FIELD_NUMBER: _ClassVar[int]
    token: str
    valid_for_ms: int
    def __init__(self, token: _Optional[str] = ..., valid_for_ms: _Optional[int] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("node_id", "address", "started_at_ms", "force_master", "last_applied_idx", "master_id", "term")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    FORCE_MASTER_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_IDX_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    started_at_ms: int
    force_master: bool
    last_applied_idx: int
    master_id: str
    term: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., started_at_ms: _Optional[int] = ..., force_master: _Optional[bool] = ..., last_applied_idx: _Optional[int] = ..., master_id: _Optional[str] = ..., term: _Optional[int] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("node_id", "address", "started_at_ms", "force_master", "last_applied_idx", "master_id", "term", "peers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    FORCE_MASTER_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_IDX_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    started_at_ms: int
    force_master: bool
    last_applied_idx: int
    master_id: str
    term: int
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., started_at_ms: _Optional[int] = ..., force_master: _Optional[bool] = ..., last_applied_idx: _Optional[int] = ..., master_id: _Optional[str] = ..., term: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class CommandEnvelope(_message.Message):
    __slots__ = ("id", "origin", "payload")
    ID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    id: str
    origin: str
    payload: bytes
    def __init__(self, id: _Optional[str] = ..., origin: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class CommandReply(_message.Message):
    __slots__ = ("last_idx",)
    LAST_IDX_FIELD_NUMBER: _ClassVar[int]
    last_idx: int
    def __init__(self, last_idx: _Optional[int] = ...) -> None: ...

class LocalEventEnvelope(_message.Message):
    __slots__ = ("id", "origin", "payload")
    ID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    id: str
    origin: str
    payload: bytes
    def __init__(self, id: _Optional[str] = ..., origin: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[LocalEventEnvelope]
    def __init__(self, events: _Optional[_Iterable[_Union[LocalEventEnvelope, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("from_idx",)
    FROM_IDX_FIELD_NUMBER: _ClassVar[int]
    from_idx: int
    def __init__(self, from_idx: _Optional[int] = ...) -> None: ...

class IndexedEventEnvelope(_message.Message):
    __slots__ = ("idx", "payload", "snapshot")
    IDX_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    idx: int
    payload: bytes
    snapshot: bytes
    def __init__(self, idx: _Optional[int] = ..., payload: _Optional[bytes] = ..., snapshot: _Optional[bytes] = ...) -> None: ...

class FetchFileRequest(_message.Message):
    __slots__ = ("model_id", "path", "offset")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    path: str
    offset: int
    def __init__(self, model_id: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset", "data", "total_size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ...) -> None: ...

class ListModelFilesRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ModelFile(_message.Message):
    __slots__ = ("path", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ModelFileList(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    def __init__(self, files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ...) -> None: ...
