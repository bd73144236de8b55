"""The committed gRPC modules are exactly what `proto/exo/cluster.proto` generates."""

import tempfile
from pathlib import Path

import pytest

from exo.cluster import codegen
from exo.cluster.proto import cluster_pb2, cluster_pb2_grpc

COMMITTED = Path(codegen.__file__).parent / "proto"


@pytest.fixture(scope="module")
def fresh_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("codegen")
    codegen.generate(out)
    return out


@pytest.mark.parametrize("name", codegen.GENERATED_FILES)
def test_generated_code_is_not_stale(fresh_dir: Path, name: str) -> None:
    fresh = (fresh_dir / name).read_bytes()
    committed = (COMMITTED / name).read_bytes()
    assert fresh == committed, (
        f"src/exo/cluster/proto/{name} is stale: regenerate with `uv run python -m exo.cluster.codegen`"
    )


def test_generate_writes_exactly_the_generated_files(fresh_dir: Path) -> None:
    assert sorted(p.name for p in fresh_dir.iterdir()) == sorted(codegen.GENERATED_FILES)


def test_grpc_module_imports_the_messages_by_package() -> None:
    text = (COMMITTED / "cluster_pb2_grpc.py").read_text()
    assert "from exo.cluster.proto import cluster_pb2" in text
    assert "\nimport cluster_pb2" not in text
    assert "from exo import cluster_pb2" not in text
    assert cluster_pb2_grpc.exo_dot_cluster__pb2 is cluster_pb2


def test_no_machine_paths_in_generated_code() -> None:
    for name in codegen.GENERATED_FILES:
        text = (COMMITTED / name).read_text()
        assert str(codegen.REPO_ROOT) not in text
        assert tempfile.gettempdir() not in text


def test_messages_round_trip() -> None:
    reply = cluster_pb2.HelloReply(
        node_id="node-a",
        address="127.0.0.1:52414",
        started_at_ms=1_700_000_000_000,
        force_master=True,
        last_applied_idx=41,
        master_id="node-a",
        term=3,
        peers=[cluster_pb2.Peer(node_id="node-b", address="127.0.0.1:52415")],
    )
    decoded = cluster_pb2.HelloReply.FromString(reply.SerializeToString())
    assert decoded == reply
    assert decoded.peers[0].address == "127.0.0.1:52415"
    assert type(decoded).__module__ == "exo.cluster.proto.cluster_pb2"

    batch = cluster_pb2.EventBatch(
        events=[
            cluster_pb2.LocalEventEnvelope(id=f"e{i}", origin="node-b", payload=b'{"kind":"X"}')
            for i in range(3)
        ]
    )
    assert cluster_pb2.EventBatch.FromString(batch.SerializeToString()) == batch

    answered = cluster_pb2.CommandReply(last_idx=2**62)
    assert cluster_pb2.CommandReply.FromString(answered.SerializeToString()).last_idx == 2**62

    chunk = cluster_pb2.FileChunk(
        offset=1 << 40, data=bytes(range(256)), total_size=(1 << 40) + 256
    )
    assert cluster_pb2.FileChunk.FromString(chunk.SerializeToString()) == chunk


def test_service_shape() -> None:
    service = cluster_pb2.DESCRIPTOR.services_by_name["Cluster"]
    shapes = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
        for m in service.methods
    }
    assert shapes == {
        "Challenge": ("ChallengeRequest", "ChallengeReply", False, False),
        "Prove": ("ProofRequest", "SessionGrant", False, False),
        "Hello": ("HelloRequest", "HelloReply", False, False),
        "SendCommand": ("CommandEnvelope", "CommandReply", False, False),
        "PublishEvents": ("EventBatch", "Ack", False, False),
        "SubscribeEvents": ("SubscribeRequest", "IndexedEventEnvelope", False, True),
        "ListModelFiles": ("ListModelFilesRequest", "ModelFileList", False, False),
        "FetchFile": ("FetchFileRequest", "FileChunk", False, True),
    }
    assert cluster_pb2.DESCRIPTOR.package == "exo.cluster"
