"""A node's id is its certificate's, kept in its data dir: a restart is the
same node, and the random id an older exo kept there gives way (with a warning)."""

from pathlib import Path

from loguru import logger

from exo.node import load_identity


def test_a_node_keeps_its_certificates_id_in_its_data_dir(tmp_path: Path) -> None:
    first = load_identity(tmp_path)
    assert load_identity(tmp_path) == first
    assert (tmp_path / "tls" / "cert.pem").is_file()


def test_the_random_id_of_an_older_exo_gives_way_to_the_certificates(tmp_path: Path) -> None:
    (tmp_path / "node_id").write_text("node-0123456789ab\n")
    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        identity = load_identity(tmp_path)
    finally:
        logger.remove(sink)
    assert not (tmp_path / "node_id").exists()
    assert [w.strip() for w in warnings] == [
        f"this node's id is now {identity.node_id}, its certificate's "
        "(it was 'node-0123456789ab': other nodes time that id out)"
    ]
    assert load_identity(tmp_path) == identity
