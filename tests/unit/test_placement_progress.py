"""`placement.download_progress`: a node's share of its shard's bytes, from the state."""

import pytest

from exo.master.placement import download_progress
from exo.shared.types.downloads import DownloadProgress, DownloadStatus
from exo.shared.types.ids import ModelId, NodeId
from exo.shared.types.model_card import WeightFile
from exo.shared.types.state import State
from tests.unit.sharded_card import CONFIG, SIZES, TOKENIZER, W1, W2, W3, sharded_card

A, B = NodeId("a"), NodeId("b")
M, N = ModelId("org/m"), ModelId("org/n")
CARD = sharded_card(M)
S1, S2, S3 = SIZES[W1], SIZES[W2], SIZES[W3]
META = 2  # config.json and tokenizer.json count one byte each


def progress(
    have: tuple[str, ...], status: DownloadStatus = "complete", model_id: ModelId = M
) -> DownloadProgress:
    return DownloadProgress(
        model_id=model_id, status=status, files_total=5, files_done=len(have),
        bytes_total=0, bytes_done=0, have_files=have,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("downloads", "start", "end", "fraction"),
    [
        ({}, 0, 4, 0.0),
        ({B: progress((W1, W2, W3, CONFIG, TOKENIZER))}, 0, 4, 0.0),  # another node's files
        ({A: progress(())}, 0, 4, 0.0),
        ({A: progress((W1, W2, W3, CONFIG, TOKENIZER))}, 0, 4, 1.0),
        ({A: progress((W1, W2, W3, CONFIG, TOKENIZER))}, 2, 4, 1.0),
        # whole model: weights by size, metadata as one byte each
        ({A: progress((W1,))}, 0, 4, S1 / (S1 + S2 + S3 + META)),
        ({A: progress((W2, CONFIG))}, 0, 4, (S2 + 1) / (S1 + S2 + S3 + META)),
        ({A: progress((CONFIG, TOKENIZER))}, 0, 4, META / (S1 + S2 + S3 + META)),
        # only the files of the shard count
        ({A: progress((W1, CONFIG, TOKENIZER))}, 0, 2, 1.0),
        ({A: progress((W1,))}, 0, 2, S1 / (S1 + META)),
        ({A: progress((W1,))}, 2, 4, 0.0),
        ({A: progress((W1, W3))}, 2, 4, S3 / (S2 + S3 + META)),
        ({A: progress((W3, TOKENIZER))}, 3, 4, (S3 + 1) / (S3 + META)),
        # files the card does not know add nothing
        ({A: progress(("extra.bin", W2))}, 2, 3, S2 / (S2 + META)),
        # what counts is the files listed, whatever the download's status
        ({A: progress((W1,), "failed")}, 0, 2, S1 / (S1 + META)),
        ({A: progress((W1,), "downloading")}, 0, 2, S1 / (S1 + META)),
        # another model's files do not count
        ({A: progress((W1, W2, W3, CONFIG, TOKENIZER), model_id=N)}, 0, 4, 0.0),
    ],
)
def test_download_progress(
    downloads: dict[NodeId, DownloadProgress], start: int, end: int, fraction: float
) -> None:
    state = State(downloads={n: {p.model_id: p} for n, p in downloads.items()})
    assert download_progress(CARD, state)(A, start, end) == pytest.approx(fraction, abs=1e-12)


def test_weight_files_of_unknown_size_count_one_byte() -> None:
    card = sharded_card(
        M,
        weight_files=tuple(f.model_copy(update={"size_bytes": None}) for f in CARD.weight_files),
    )
    state = State(downloads={A: {M: progress((W1, CONFIG))}})
    assert download_progress(card, state)(A, 0, 4) == pytest.approx(2 / 5)
    assert download_progress(card, state)(A, 0, 2) == pytest.approx(2 / 3)


def test_a_weight_file_of_size_zero_still_counts() -> None:
    card = sharded_card(
        M,
        weight_files=(
            WeightFile(name=W1, layers=(0, 1, 2, 3), embedding=True, head=True, size_bytes=0),
        ),
        files=(W1, CONFIG),
    )
    state = State(downloads={A: {M: progress((CONFIG,))}})
    assert download_progress(card, state)(A, 0, 4) == pytest.approx(1 / 2)
