"""`plan`: the next action of a worker, one table row per situation."""

from collections.abc import Iterable, Mapping, Set
from dataclasses import replace

import pytest

from exo.models.weight_files import shard_files
from exo.shared.types.downloads import DownloadProgress, DownloadStatus
from exo.shared.types.ids import InstanceId, ModelId, NodeId
from exo.shared.types.state import Instance, InstanceRank, NodeInfo, State
from exo.worker.plan import (
    Action,
    CancelDownload,
    LocalFacts,
    StartDownload,
    StartRunner,
    StopRunner,
    needed_files,
    plan,
    wants_standby,
)
from tests.unit.sharded_card import CONFIG, METADATA, TOKENIZER, W1, W2, W3, sharded_card

ME, OTHER, THIRD = NodeId("me"), NodeId("other"), NodeId("third")
M = ModelId("org/m")  # 4 layers; its card is in the state
N = ModelId("org/n")  # another model with a card
NO_CARD = ModelId("org/no-card")
CARD, N_CARD = sharded_card(M), sharded_card(N)
ALL = frozenset(CARD.files)
# Files of each half of the model (layers [0, 2) and [2, 4)).
FIRST = frozenset({W1, CONFIG, TOKENIZER})
SECOND = frozenset({W2, W3, CONFIG, TOKENIZER})


def inst(i: str, *nodes: NodeId, model_id: ModelId = M) -> Instance:
    """One rank per node; one node gets all 4 layers, two split them 2 + 2, three 1 + 1 + 2."""
    bounds = {1: (0, 4), 2: (0, 2, 4), 3: (0, 1, 2, 4)}[len(nodes)]
    ranks = tuple(
        InstanceRank(node_id=n, start_layer=bounds[k], end_layer=bounds[k + 1])
        for k, n in enumerate(nodes)
    )
    return Instance(instance_id=InstanceId(i), model_id=model_id, ranks=ranks)


def tensor_inst(i: str, *nodes: NodeId) -> Instance:
    """One rank per node, each a slice of all 4 layers."""
    ranks = tuple(InstanceRank(node_id=n, start_layer=0, end_layer=4) for n in nodes)
    return Instance(instance_id=InstanceId(i), model_id=M, ranks=ranks, sharding="tensor")


def dl(
    have: Iterable[str], status: DownloadStatus = "complete", model_id: ModelId = M
) -> DownloadProgress:
    files = tuple(sorted(have))
    return DownloadProgress(
        model_id=model_id, status=status, files_total=5, files_done=len(files),
        bytes_total=0, bytes_done=0, have_files=files,
    )  # fmt: skip


def state(*instances: Instance, downloads: dict[NodeId, DownloadProgress] | None = None) -> State:
    nodes = {
        n: NodeInfo(node_id=n, grpc_address=None, started_at_ms=0, last_seen_ms=0)
        for n in (ME, OTHER, THIRD)
    }
    return State(
        nodes=nodes,
        instances={i.instance_id: i for i in instances},
        downloads={n: {p.model_id: p} for n, p in (downloads or {}).items()},
        cards={M: CARD, N: N_CARD},
    )


def facts(
    running: Iterable[str] = (),
    have: Mapping[ModelId, Set[str]] | None = None,
    downloading: Iterable[ModelId] = (),
    failed: Iterable[str] = (),
    stale: Iterable[str] = (),
) -> LocalFacts:
    return LocalFacts(
        running=frozenset(InstanceId(i) for i in running),
        have_files=have or {},
        downloading=frozenset(downloading),
        download_failed=frozenset(InstanceId(i) for i in failed),
        stale=frozenset(InstanceId(i) for i in stale),
    )


def fetch(i: str, files: frozenset[str] | None, model_id: ModelId = M) -> StartDownload:
    return StartDownload(model_id=model_id, files=files, instance_id=InstanceId(i))


SOLO, RING0, RING1 = inst("a", ME), inst("r", ME, OTHER), inst("r", OTHER, ME)
TENSOR0, TENSOR1 = tensor_inst("t", ME, OTHER), tensor_inst("t", OTHER, ME)
MINE = {M: ALL}  # this node has every file of M

CASES: list[tuple[str, State, LocalFacts, Action | None]] = [
    ("nothing to do", state(), facts(), None),
    ("an instance of another node", state(inst("a", OTHER)), facts(), None),
    ("already running", state(SOLO), facts(running=["a"], have=MINE), None),
    # Stops first, to free memory, then cancels, then downloads and starts.
    ("the runner of a deleted instance is stopped", state(), facts(running=["a"]),
     StopRunner(InstanceId("a"))),
    ("stop comes before start", state(inst("b", ME)), facts(running=["a"], have=MINE),
     StopRunner(InstanceId("a"))),
    ("stop comes before cancel", state(), facts(running=["a"], downloading=[M]),
     StopRunner(InstanceId("a"))),
    ("stop comes before a download", state(inst("b", ME)), facts(running=["a"]),
     StopRunner(InstanceId("a"))),
    ("a download no instance needs is cancelled", state(), facts(downloading=[M]),
     CancelDownload(M)),
    ("a download for another node's instance is cancelled", state(inst("a", OTHER)),
     facts(downloading=[M]), CancelDownload(M)),
    ("a download for an instance already running is cancelled", state(SOLO),
     facts(running=["a"], downloading=[M]), CancelDownload(M)),
    ("a download of a stale instance is cancelled", state(SOLO),
     facts(downloading=[M], stale=["a"]), CancelDownload(M)),
    ("cancel comes before a download", state(SOLO), facts(downloading=[N]), CancelDownload(N)),
    ("a needed download is kept", state(SOLO), facts(downloading=[M]), None),
    # Downloads: exactly the files of this node's rank.
    ("a single rank fetches every file", state(SOLO), facts(), fetch("a", ALL)),
    ("rank 0 of two fetches the first half", state(RING0), facts(), fetch("r", FIRST)),
    ("rank 1 of two fetches the second half", state(RING1), facts(), fetch("r", SECOND)),
    ("tensor rank 0 fetches every file", state(TENSOR0), facts(), fetch("t", ALL)),
    ("tensor rank 1 fetches every file", state(TENSOR1), facts(), fetch("t", ALL)),
    ("a tensor rank's half of the files is not enough", state(TENSOR0),
     facts(have={M: FIRST}), fetch("t", ALL)),
    ("an unknown card: fetch everything", state(inst("a", ME, model_id=NO_CARD)), facts(),
     fetch("a", None, NO_CARD)),
    ("partial files in the state: fetch", state(SOLO, downloads={ME: dl({W1, W2}, "downloading")}),
     facts(), fetch("a", ALL)),
    ("a failed download in the state without files: fetch",
     state(SOLO, downloads={ME: dl((), "failed")}), facts(), fetch("a", ALL)),
    ("files of another model do not count",
     state(SOLO, downloads={ME: dl(ALL, model_id=N)}), facts(), fetch("a", ALL)),
    ("the local files override a complete state",
     state(SOLO, downloads={ME: dl(ALL)}), facts(have={M: frozenset({CONFIG})}), fetch("a", ALL)),
    ("the local files override an empty state", state(SOLO), facts(have=MINE),
     StartRunner(SOLO, 0)),
    ("the local files of another model do not count", state(SOLO), facts(have={N: ALL}),
     fetch("a", ALL)),
    ("a rank needs only its own files", state(RING0, downloads={OTHER: dl(SECOND)}),
     facts(have={M: FIRST}), StartRunner(RING0, 0)),
    ("rank 1's files are not rank 0's", state(RING1, downloads={OTHER: dl(FIRST)}),
     facts(have={M: FIRST}), fetch("r", SECOND)),
    ("no second download while one runs", state(SOLO), facts(downloading=[M]), None),
    ("no retry after a failed download", state(SOLO), facts(failed=["a"]), None),
    ("a failed download of one instance does not hold back another",
     state(inst("a", ME), inst("b", ME, model_id=N)), facts(failed=["a"]),
     fetch("b", frozenset(N_CARD.files), N)),
    # Runners: only when every other rank's node has its files, by the state.
    # This node trusts what is on its disk, not the state it replayed (a folder
    # deleted while it was down): the download finds present files at once.
    ("the state's word on this node's files is not enough", state(SOLO, downloads={ME: dl(ALL)}),
     facts(), fetch("a", frozenset(CARD.files))),
    ("this node's own files start the runner", state(SOLO), facts(have={M: ALL}),
     StartRunner(SOLO, 0)),
    ("other rank has no files", state(RING0), facts(have=MINE), None),
    ("other rank is still downloading",
     state(RING0, downloads={OTHER: dl({W2, CONFIG}, "downloading")}), facts(have=MINE), None),
    ("other rank has only this rank's files", state(RING0, downloads={OTHER: dl(FIRST)}),
     facts(have=MINE), None),
    ("other rank's download failed", state(RING0, downloads={OTHER: dl((), "failed")}),
     facts(have=MINE), None),
    ("other rank complete: rank 0 starts", state(RING0, downloads={OTHER: dl(SECOND)}),
     facts(have=MINE), StartRunner(RING0, 0)),
    ("other rank complete: rank 1 starts", state(RING1, downloads={OTHER: dl(FIRST)}),
     facts(have=MINE), StartRunner(RING1, 1)),
    ("other rank has its files while fetching more",
     state(RING0, downloads={OTHER: dl(SECOND, "downloading")}), facts(have=MINE),
     StartRunner(RING0, 0)),
    ("other tensor rank has half of the files", state(TENSOR0, downloads={OTHER: dl(SECOND)}),
     facts(have=MINE), None),
    ("other tensor rank has every file: tensor rank 1 starts",
     state(TENSOR1, downloads={OTHER: dl(ALL)}), facts(have=MINE), StartRunner(TENSOR1, 1)),
    ("three ranks, one other missing",
     state(inst("t", OTHER, ME, THIRD), downloads={OTHER: dl(ALL)}), facts(have=MINE), None),
    ("three ranks, all there",
     state(inst("t", OTHER, THIRD, ME), downloads={OTHER: dl(ALL), THIRD: dl(ALL)}),
     facts(have=MINE), StartRunner(inst("t", OTHER, THIRD, ME), 2)),
    # Stable order among instances.
    ("the first instance id first", state(inst("c", ME), inst("b", ME)), facts(have=MINE),
     StartRunner(inst("b", ME), 0)),
    ("then the next", state(inst("c", ME), inst("b", ME)), facts(running=["b"], have=MINE),
     StartRunner(inst("c", ME), 0)),
    ("a waiting instance does not block the next", state(RING0, inst("s", ME)),
     facts(have=MINE), StartRunner(inst("s", ME), 0)),
    # Stale instances (from before a restart, being deleted) get nothing.
    ("stale: no download", state(SOLO), facts(stale=["a"]), None),
    ("stale: no runner", state(SOLO), facts(have=MINE, stale=["a"]), None),
    ("stale: a runner of it is stopped", state(SOLO), facts(running=["a"], stale=["a"]),
     StopRunner(InstanceId("a"))),
    ("stale: the others still start", state(inst("old", ME), inst("new", ME)),
     facts(have=MINE, stale=["old"]), StartRunner(inst("new", ME), 0)),
    ("stale: and nothing once they run", state(inst("old", ME), inst("new", ME)),
     facts(running=["new"], have=MINE, stale=["old"]), None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "current", "local", "action"), CASES, ids=[c[0] for c in CASES])
def test_plan(name: str, current: State, local: LocalFacts, action: Action | None) -> None:
    assert plan(ME, current, local) == action


def test_halves_are_the_cards_shard_files() -> None:
    assert shard_files(CARD, 0, 2) == FIRST
    assert shard_files(CARD, 2, 4) == SECOND
    assert needed_files(state(RING1), RING1, ME) == SECOND
    assert needed_files(state(RING1), RING1, THIRD) is None


def test_every_tensor_rank_needs_every_file_of_the_model() -> None:
    for node_id in (ME, OTHER):
        assert needed_files(state(TENSOR1), TENSOR1, node_id) == ALL == {W1, W2, W3} | METADATA


def test_carrying_out_the_plan_ends() -> None:
    """Following the actions (downloads finish, runners start) reaches None."""
    current = state(RING0, inst("b", ME, model_id=N), downloads={OTHER: dl(SECOND)})
    local = facts(running=["gone"], downloading=[NO_CARD])
    taken: list[Action] = []
    while (action := plan(ME, current, local)) is not None:
        taken.append(action)
        assert len(taken) < 10
        match action:
            case StopRunner():
                local = replace(local, running=local.running - {action.instance_id})
            case CancelDownload():
                local = replace(local, downloading=local.downloading - {action.model_id})
            case StartDownload():  # finished at once
                assert action.files is not None
                local = replace(
                    local, have_files={**local.have_files, action.model_id: action.files}
                )
            case StartRunner():
                local = replace(local, running={*local.running, action.instance.instance_id})
    assert taken == [
        StopRunner(InstanceId("gone")),
        CancelDownload(NO_CARD),
        fetch("b", frozenset(N_CARD.files), N),
        StartRunner(inst("b", ME, model_id=N), 0),
        fetch("r", FIRST),
        StartRunner(RING0, 0),
    ]


def test_a_download_being_cancelled_blocks_a_new_one_and_is_not_cancelled_twice() -> None:
    current = state(SOLO)
    cancelling = LocalFacts(downloading=frozenset({N}), cancelling=frozenset({N}))
    assert plan(ME, current, cancelling) == fetch("a", frozenset(CARD.files))
    still = LocalFacts(downloading=frozenset({M}), cancelling=frozenset({M}))
    assert plan(ME, current, still) is None  # no second download of M while it ends


@pytest.mark.parametrize(
    ("name", "current", "wanted"),
    [
        ("no instance", state(), False),
        ("a model on one node only", state(inst("a", OTHER)), False),
        ("a model across nodes", state(inst("r", ME, OTHER)), True),
        ("across nodes, this one not among them", state(inst("r", OTHER, THIRD)), True),
        (
            "a single node left",
            state(inst("r", ME, OTHER)).model_copy(update={"nodes": {}}),
            False,
        ),
    ],
)
def test_a_runner_process_is_started_ahead_while_a_model_runs_across_nodes(
    name: str, current: State, wanted: bool
) -> None:
    assert wants_standby(current) is wanted, name
