"""A peer node as a source of model files: `ListModelFiles` and `FetchFile` over
the cluster's gRPC link."""

from collections.abc import AsyncIterator

import anyio
import grpc

from exo.cluster.auth import cluster_channel
from exo.cluster.proto import cluster_pb2 as pb
from exo.cluster.proto import cluster_pb2_grpc as pb_grpc
from exo.shared.types.ids import ModelId, NodeId
from exo.worker.downloads.source import RemoteFile, SourceUnavailable, TransientError

LIST_TIMEOUT_SECONDS = 120.0  # the peer hashes files it has not hashed before
# A stream that delivers nothing for this long is treated as broken (resumed).
CHUNK_TIMEOUT_SECONDS = 30.0


class PeerSource:
    def __init__(self, node_id: NodeId, address: str, secret: str) -> None:
        self.name = f"peer {node_id}"
        self.address = address
        self.secret = secret

    async def list_files(self, model_id: ModelId) -> list[RemoteFile]:
        async with cluster_channel(self.address, self.secret) as channel:
            try:
                reply = await pb_grpc.ClusterStub(channel).ListModelFiles(
                    pb.ListModelFilesRequest(model_id=model_id), timeout=LIST_TIMEOUT_SECONDS
                )
            except grpc.aio.AioRpcError as error:
                raise SourceUnavailable(f"{self.name}: {error.details()}") from error
        return [RemoteFile(path=f.path, size=f.size, sha256=f.sha256) for f in reply.files]

    async def read(self, model_id: ModelId, path: str, offset: int) -> AsyncIterator[bytes]:
        async with cluster_channel(self.address, self.secret) as channel:
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
                raise TransientError(
                    f"{self.name}: {error.code().name} {error.details()}"
                ) from error
            except TimeoutError as error:
                raise TransientError(
                    f"{self.name}: no data for {CHUNK_TIMEOUT_SECONDS:.0f}s"
                ) from error
            finally:
                call.cancel()
