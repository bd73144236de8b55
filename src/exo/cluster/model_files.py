"""Model files between nodes: a node serves the files of its models to peers
(`ListModelFiles`, `FetchFile`), and `PeerSource` reads them from a peer as a
download source."""

from collections.abc import AsyncIterator
from typing import BinaryIO

import anyio
import grpc
import grpc.aio

from exo.cluster.auth import LinkError, peer_channel
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.cluster.tls import NodeCertificate
from exo.models.file_source import RemoteFile, SourceUnavailable, TransientError
from exo.models.local_store import ModelStore
from exo.shared.types.ids import InvalidModelId, ModelId, NodeId, validate_model_id

# Model file chunks (gRPC's default message limit is 4 MiB).
FILE_CHUNK_BYTES = 1 << 20
CHUNKS_PER_READ = 8
LIST_TIMEOUT_SECONDS = 120.0  # the peer hashes files it has not hashed before
# A stream that delivers nothing for this long is treated as broken (resumed).
CHUNK_TIMEOUT_SECONDS = 30.0


def _valid_model_id(value: str) -> ModelId | None:
    try:
        return validate_model_id(value)
    except InvalidModelId:
        return None


def _read_chunks(f: BinaryIO) -> list[bytes]:
    chunks: list[bytes] = []
    for _ in range(CHUNKS_PER_READ):
        data = f.read(FILE_CHUNK_BYTES)
        if not data:
            break
        chunks.append(data)
    return chunks


class ModelFileService:
    """This node's model files, as peers see them (None: it serves none)."""

    def __init__(self, models: ModelStore | None) -> None:
        self._models = models

    async def list_files(
        self, request: pb.ListModelFilesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelFileList:
        models = self._models
        model_id = _valid_model_id(request.model_id)
        if models is None or model_id is None or models.find(model_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no copy of {request.model_id!r} here")
            raise AssertionError  # abort raises
        files = await anyio.to_thread.run_sync(models.list_files, model_id)
        return pb.ModelFileList(
            files=[pb.ModelFile(path=f.path, size=f.size, sha256=f.sha256) for f in files]
        )

    async def fetch_file(
        self, request: pb.FetchFileRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FileChunk]:
        models = self._models
        model_id = _valid_model_id(request.model_id)
        path = models.file(model_id, request.path) if models and model_id else None
        if path is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no file {request.path!r} of {request.model_id!r} here"
            )
            raise AssertionError  # abort raises
        size = path.stat().st_size
        offset = max(0, request.offset)
        with path.open("rb") as f:
            f.seek(offset)
            while offset < size:
                # Several chunks per thread hop: the hop costs more than a read.
                chunks = await anyio.to_thread.run_sync(_read_chunks, f)
                if not chunks:
                    break
                for data in chunks:
                    yield pb.FileChunk(offset=offset, data=data, total_size=size)
                    offset += len(data)


class PeerSource:
    """A peer node as a source of model files (a `FileSource`)."""

    def __init__(self, node_id: NodeId, address: str, secret: str, caller: NodeCertificate) -> None:
        """`node_id` at `address`: the peer; `caller`: this node's identity."""
        self.name = f"peer {node_id}"
        self.address = address
        self.secret = secret
        self.caller = caller

    async def list_files(self, model_id: ModelId) -> list[RemoteFile]:
        try:
            async with peer_channel(self.address, self.secret, self.caller) as channel:
                reply = await pb_grpc.ClusterStub(channel).ListModelFiles(
                    pb.ListModelFilesRequest(model_id=model_id), timeout=LIST_TIMEOUT_SECONDS
                )
        except grpc.aio.AioRpcError as error:
            raise SourceUnavailable(f"{self.name}: {error.details()}") from error
        except LinkError as error:
            raise SourceUnavailable(f"{self.name}: {error}") from error
        return [RemoteFile(path=f.path, size=f.size, sha256=f.sha256) for f in reply.files]

    async def read(self, model_id: ModelId, path: str, offset: int) -> AsyncIterator[bytes]:
        try:
            async with peer_channel(self.address, self.secret, self.caller) as channel:
                async for data in self._read(channel, model_id, path, offset):
                    yield data
        except LinkError as error:
            raise TransientError(f"{self.name}: {error}") from error

    async def _read(
        self, channel: grpc.aio.Channel, model_id: ModelId, path: str, offset: int
    ) -> AsyncIterator[bytes]:
        call = pb_grpc.ClusterStub(channel).FetchFile(
            pb.FetchFileRequest(model_id=model_id, path=path, offset=offset)
        )
        chunks = aiter(call)
        try:
            while True:
                with anyio.fail_after(CHUNK_TIMEOUT_SECONDS):
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        return
                yield chunk.data
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                raise SourceUnavailable(f"{self.name}: {error.details()}") from error
            raise TransientError(f"{self.name}: {error.code().name} {error.details()}") from error
        except TimeoutError as error:
            raise TransientError(
                f"{self.name}: no data for {CHUNK_TIMEOUT_SECONDS:.0f}s"
            ) from error
        finally:
            call.cancel()
