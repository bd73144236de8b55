"""`ModelStore`: the models directory and read-only model directories."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from exo.models import local_store
from exo.models.cards import MAX_METADATA_BYTES, card_from_folder
from exo.models.local_store import LocalFile, ModelStore, ModelUnavailable
from exo.models.weight_files import shard_files
from exo.shared.types.ids import ModelId
from tests.model_factory import make_tiny_llama

M = ModelId("org/tiny")
WEIGHTS = tuple(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
INDEX = "model.safetensors.index.json"
FILES = {*WEIGHTS, INDEX, "config.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A 4-layer llama in three weight files (written once per module)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "org--tiny",
        smollm_dir,
        n_layers=4,
        hidden=16,
        weight_files=3,
        tie_word_embeddings=False,
    )


class Dirs:
    def __init__(self, root: Path) -> None:
        self.models = root / "models"
        self.ro1 = root / "ro1"
        self.ro2 = root / "ro2"
        for d in (self.models, self.ro1, self.ro2):
            d.mkdir()

    def store(self) -> ModelStore:
        return ModelStore(self.models, (self.ro1, self.ro2))


@pytest.fixture
def dirs(tmp_path: Path) -> Dirs:
    return Dirs(tmp_path)


def _link_weights(source: str, target: str) -> None:
    """Weights (never written by the tests) are hard links: copying megabytes per test is slow."""
    if source.endswith(".safetensors"):
        os.link(source, target)
    else:
        shutil.copy2(source, target)


def put(tiny: Path, root: Path, name: str = "org--tiny", only: set[str] | None = None) -> Path:
    """A copy of the tiny model (or of `only` its files) as `root/name`."""
    target = root / name
    shutil.copytree(tiny, target, copy_function=_link_weights)
    if only is not None:
        for path in target.iterdir():
            if path.name not in only:
                path.unlink()
    return target


def test_the_tiny_model_has_the_files_the_tests_expect(tiny: Path) -> None:
    assert {p.name for p in tiny.iterdir()} == FILES


# --- find ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "found"),
    [
        ((), None),
        (("ro2",), "ro2"),
        (("ro1", "ro2"), "ro1"),
        (("models", "ro1", "ro2"), "models"),
        (("models", "ro2"), "models"),
    ],
)
def test_find_prefers_the_models_dir_then_the_read_only_dirs_in_order(
    tiny: Path, dirs: Dirs, where: tuple[str, ...], found: str | None
) -> None:
    for name in where:
        put(tiny, getattr(dirs, name))
    path = dirs.store().find(M)
    assert path == (None if found is None else getattr(dirs, found) / "org--tiny")


def test_find_skips_a_folder_without_config(tiny: Path, dirs: Dirs) -> None:
    put(tiny, dirs.models, only=set(WEIGHTS))  # a download in progress
    assert dirs.store().find(M) is None
    put(tiny, dirs.ro2)
    assert dirs.store().find(M) == dirs.ro2 / "org--tiny"


def test_resolve(tiny: Path, dirs: Dirs) -> None:
    with pytest.raises(ModelUnavailable, match="org/tiny"):
        dirs.store().resolve(M)
    put(tiny, dirs.ro1)
    assert dirs.store().resolve(M) == dirs.ro1 / "org--tiny"


# --- complete_files and folder_with ----------------------------------------------------


def test_complete_files_ignore_partial_files(tiny: Path, dirs: Dirs) -> None:
    folder = put(tiny, dirs.models, only={"config.json", WEIGHTS[0]})
    (folder / f"{WEIGHTS[1]}.partial").write_bytes(b"half")
    (folder / "sub").mkdir()
    (folder / "sub" / "x.json").write_text("{}")
    (folder / "sub" / "y.json.partial").write_text("{")
    assert dirs.store().complete_files(M) == {"config.json", WEIGHTS[0], "sub/x.json"}


def test_complete_files_of_an_unknown_model_are_none(dirs: Dirs) -> None:
    assert dirs.store().complete_files(M) == set()
    assert dirs.store().complete_files(M, {"config.json"}) == set()


SHARD0 = {WEIGHTS[0], "config.json", INDEX}


@pytest.mark.parametrize(
    ("writable", "ro1", "ro2", "wanted", "expected"),
    [
        # Only the writable copy.
        (FILES, None, None, None, FILES),
        (SHARD0, None, None, FILES, SHARD0),
        # A read-only copy with every wanted file is used, even over a complete writable one.
        (FILES, FILES, None, SHARD0, FILES),
        (None, SHARD0, None, SHARD0, SHARD0),
        (None, None, SHARD0, SHARD0, SHARD0),
        # A read-only copy missing a wanted file cannot be completed: the writable one counts.
        (SHARD0, {WEIGHTS[1], "config.json"}, None, SHARD0, SHARD0),
        (None, {WEIGHTS[1], "config.json"}, None, SHARD0, set()),
        (SHARD0, SHARD0, None, FILES, SHARD0),
        # The first read-only copy that has them all.
        ({"config.json"}, {WEIGHTS[1], "config.json"}, FILES, SHARD0, FILES),
        ({"config.json"}, SHARD0, FILES, SHARD0, SHARD0),
        # Without a file set, a read-only copy counts as it is.
        ({"config.json"}, SHARD0, None, None, SHARD0),
    ],
)  # fmt: skip
def test_complete_files_use_a_read_only_copy_only_if_it_has_all(
    tiny: Path,
    dirs: Dirs,
    writable: set[str] | None,
    ro1: set[str] | None,
    ro2: set[str] | None,
    wanted: set[str] | None,
    expected: set[str],
) -> None:
    for root, files in ((dirs.models, writable), (dirs.ro1, ro1), (dirs.ro2, ro2)):
        if files is not None:
            put(tiny, root, only=files)
    assert dirs.store().complete_files(M, wanted) == expected


def test_folder_with(tiny: Path, dirs: Dirs) -> None:
    store = dirs.store()
    assert store.folder_with(M, SHARD0) is None
    put(tiny, dirs.models, only=SHARD0)
    assert store.folder_with(M, SHARD0) == dirs.models / "org--tiny"
    assert store.folder_with(M, FILES) is None
    put(tiny, dirs.ro2)
    assert store.folder_with(M, FILES) == dirs.ro2 / "org--tiny"
    assert store.folder_with(M, SHARD0) == dirs.ro2 / "org--tiny"  # read-only copies first


def test_a_shards_files_from_the_card_are_found(tiny: Path, dirs: Dirs) -> None:
    card = card_from_folder(M, tiny)
    first = shard_files(card, 0, 2)
    assert WEIGHTS[2] not in first
    put(tiny, dirs.models, only=first)
    store = dirs.store()
    assert store.complete_files(M, first) == first
    assert store.folder_with(M, first) == dirs.models / "org--tiny"
    assert store.folder_with(M, shard_files(card, 2, 4)) is None


# --- file ----------------------------------------------------------------------------


def test_file_gives_complete_files_inside_the_folder(tiny: Path, dirs: Dirs) -> None:
    folder = put(tiny, dirs.models)
    (folder / "sub").mkdir()
    (folder / "sub" / "a.txt").write_text("a")
    (folder / f"{WEIGHTS[0]}.partial").write_bytes(b"x")
    (dirs.models / "secret.txt").write_text("secret")
    (folder / "escape").symlink_to(dirs.models / "secret.txt")
    store = dirs.store()
    resolved = folder.resolve()
    assert store.file(M, "config.json") == resolved / "config.json"
    assert store.file(M, "sub/a.txt") == resolved / "sub" / "a.txt"
    assert store.file(M, "sub/../config.json") == resolved / "config.json"
    for refused in [
        "../secret.txt",
        "sub/../../secret.txt",
        str(dirs.models / "secret.txt"),
        "escape",  # a link out of the folder
        f"{WEIGHTS[0]}.partial",
        "config.json.partial",
        "missing.json",
        "sub",  # a folder
        "",
    ]:
        assert store.file(M, refused) is None, refused
    assert store.file(ModelId("org/other"), "config.json") is None


@pytest.mark.parametrize(
    "path", ["w.safetensors.partial/", "w.safetensors.partial/.", "./w.safetensors.partial/"]
)
def test_file_refuses_a_partial_file_however_it_is_spelled(
    tiny: Path, dirs: Dirs, path: str
) -> None:
    folder = put(tiny, dirs.models)
    (folder / "w.safetensors.partial").write_bytes(b"half a file")
    assert dirs.store().file(M, path) is None


def test_file_from_a_read_only_copy(tiny: Path, dirs: Dirs) -> None:
    folder = put(tiny, dirs.ro1)
    assert dirs.store().file(M, WEIGHTS[1]) == (folder / WEIGHTS[1]).resolve()
    assert dirs.store().file(M, "../org--tiny/config.json") == (folder / "config.json").resolve()


# --- list_files ----------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_list_files_gives_sizes_and_hashes(tiny: Path, dirs: Dirs) -> None:
    folder = put(tiny, dirs.ro1)
    (folder / "extra.json.partial").write_text("{")
    store = dirs.store()
    listed = store.list_files(M)
    assert [f.path for f in listed] == sorted(FILES)
    assert listed == [
        LocalFile(path=name, size=(folder / name).stat().st_size, sha256=sha256(folder / name))
        for name in sorted(FILES)
    ]
    assert all(f.size > 0 for f in listed)
    assert store.list_files(ModelId("org/other")) == []


def test_list_files_rehashes_a_changed_file(tiny: Path, dirs: Dirs) -> None:
    folder = put(tiny, dirs.models, only={"config.json", "tokenizer.json"})
    store = dirs.store()
    before = {f.path: f for f in store.list_files(M)}
    path = folder / "tokenizer.json"
    path.write_text('{"changed": true}')
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = {f.path: f for f in store.list_files(M)}
    assert after["config.json"] == before["config.json"]
    assert after["tokenizer.json"] == LocalFile(
        path="tokenizer.json", size=len('{"changed": true}'), sha256=sha256(path)
    )
    assert after["tokenizer.json"].sha256 != before["tokenizer.json"].sha256


# --- local_models --------------------------------------------------------------------


def test_local_models_describe_valid_folders_and_skip_broken_ones(tiny: Path, dirs: Dirs) -> None:
    put(tiny, dirs.models)  # org/tiny
    put(tiny, dirs.models, "plain")  # a model id without an org
    put(tiny, dirs.models, "org--two--dashes")
    broken_config = put(tiny, dirs.models, "org--broken")
    (broken_config / "config.json").write_text("{not json")
    no_weights = put(tiny, dirs.models, "org--no-weights", only={"config.json"})
    assert not any(no_weights.glob("*.safetensors"))
    put(tiny, dirs.models, "org--no-config", only=set(WEIGHTS))
    put(tiny, dirs.models, "bad name")  # not a valid model id
    (dirs.models / "stray.txt").write_text("not a folder")
    put(tiny, dirs.ro1, "org--ro-only")
    put(tiny, dirs.ro2, "org--tiny", only={"config.json", INDEX, *WEIGHTS})  # models dir wins
    local = dirs.store().local_models()
    found = {card.model_id: (card, files) for card, files in local.found}
    assert set(found) == {"org/tiny", "plain", "org/two--dashes", "org/ro-only"}
    unreadable = {Path(folder.path).name: folder.reason for folder in local.unreadable}
    assert set(unreadable) == {"org--broken", "org--no-weights", "bad name"}
    assert "cannot read config.json" in unreadable["org--broken"]
    assert "no safetensors weights" in unreadable["org--no-weights"]
    for model_id, folder in [
        ("org/tiny", dirs.models / "org--tiny"),
        ("plain", dirs.models / "plain"),
        ("org/ro-only", dirs.ro1 / "org--ro-only"),
    ]:
        card, files = found[ModelId(model_id)]
        assert card == card_from_folder(ModelId(model_id), folder)
        assert files == FILES
    card, _ = found[M]
    assert card.n_layers == 4
    assert [f.name for f in card.weight_files] == list(WEIGHTS)


def set_config(folder: Path, **fields: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"num_hidden_layers": 0}, "0 layers"),  # was a ZeroDivisionError
        ({"num_hidden_layers": 2**62}, f"{2**62} layers"),  # was a MemoryError
        ({"num_attention_heads": 0}, "0 attention heads"),
        ({"vocab_size": -1}, "-1 vocabulary size"),
        ({"max_position_embeddings": 2**40}, "context length"),
    ],
)
def test_a_folder_no_model_could_have_is_skipped_in_every_dir(
    tiny: Path, dirs: Dirs, fields: dict[str, object], reason: str
) -> None:
    put(tiny, dirs.models, "org--good")
    for root in (dirs.models, dirs.ro1):
        set_config(put(tiny, root, "org--bad"), **fields)
    local = dirs.store().local_models()
    assert [card.model_id for card, _ in local.found] == ["org/good"]
    [first, second] = local.unreadable
    assert (first.path, second.path) == (str(dirs.models / "org--bad"), str(dirs.ro1 / "org--bad"))
    assert first.reason.startswith("ModelCardError: ") and reason in first.reason


def test_any_failure_to_describe_a_folder_skips_it(
    tiny: Path, dirs: Dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(tiny, dirs.models)

    def fails(model_id: ModelId, folder: Path) -> None:
        raise MemoryError("out of memory")

    monkeypatch.setattr(local_store, "card_from_folder", fails)
    [folder] = dirs.store().local_models().unreadable
    assert folder.reason == "MemoryError: out of memory"


def test_a_config_too_large_or_not_an_object_is_unreadable(tiny: Path, dirs: Dirs) -> None:
    (put(tiny, dirs.models, "org--list") / "config.json").write_text("[1, 2]")
    (put(tiny, dirs.models, "org--deep") / "config.json").write_text("[" * 100_000)
    huge = put(tiny, dirs.models, "org--huge") / "config.json"
    with huge.open("ab") as config:
        config.truncate(MAX_METADATA_BYTES + 1)
    reasons = {Path(f.path).name: f.reason for f in dirs.store().local_models().unreadable}
    assert "not a JSON object" in reasons["org--list"]
    assert "cannot read config.json" in reasons["org--deep"]
    assert f"over {MAX_METADATA_BYTES} bytes" in reasons["org--huge"]


def test_local_models_of_missing_dirs(tmp_path: Path) -> None:
    local = ModelStore(tmp_path / "none", (tmp_path / "nothing",)).local_models()
    assert (local.found, local.unreadable) == ([], ())


# --- delete --------------------------------------------------------------------------


def test_delete_removes_only_the_writable_copy(tiny: Path, dirs: Dirs) -> None:
    writable = put(tiny, dirs.models)
    read_only = put(tiny, dirs.ro1, only=SHARD0)
    store = dirs.store()
    assert store.delete(M) is True
    assert not writable.exists()
    assert {p.name for p in read_only.iterdir()} == SHARD0
    assert store.find(M) == read_only
    assert store.complete_files(M) == SHARD0
    assert store.delete(M) is False
    assert {p.name for p in read_only.iterdir()} == SHARD0


def test_delete_of_an_unknown_model(dirs: Dirs) -> None:
    assert dirs.store().delete(M) is False


def test_delete_of_a_linked_folder_removes_the_link_not_the_files(tiny: Path, dirs: Dirs) -> None:
    target = put(tiny, dirs.ro1)
    (dirs.models / "org--tiny").symlink_to(target, target_is_directory=True)
    assert dirs.store().delete(M) is True
    assert not (dirs.models / "org--tiny").exists()
    assert {p.name for p in target.iterdir()} == FILES


def test_writable_dir(dirs: Dirs) -> None:
    assert dirs.store().writable_dir(M) == dirs.models / "org--tiny"
