"""The `exo` command line: real argv through the real parser. `exo` alone runs a
node; `download` and `import-gguf` are subcommands; every flag's default comes
from its EXO_* variable when set, and the flag beats the variable."""

import subprocess
import sys
from pathlib import Path

import pytest
from loguru import logger

from exo.main import (
    DEFAULT_API_PORT,
    DEFAULT_GRPC_PORT,
    FLAGS,
    Flag,
    main,
    models_dir,
    node_config,
    parse_args,
)
from exo.models.builtin import DEFAULT_MODEL_ID, builtin_gguf_path
from exo.models.store import default_data_dir

SHARED = [flag for flag in FLAGS if flag.scope == "shared"]
# argv of each command, before its flags.
COMMANDS = {
    "node": [],
    "download": ["download", "org/model"],
    "import-gguf": ["import-gguf", "model.gguf", "--model-id", "org/model"],
}


@pytest.fixture(autouse=True)
def no_exo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for flag in FLAGS:
        monkeypatch.delenv(flag.env, raising=False)


def dest(flag: Flag) -> str:
    return flag.name.removeprefix("--").replace("-", "_")


def samples(flag: Flag) -> tuple[tuple[str, object], tuple[str, object]]:
    """Two values of `flag` other than its default, as typed and as parsed."""
    if flag.name == "--log-level":
        return ("debug", "DEBUG"), ("error", "ERROR")
    if flag.name == "--speculation":
        return ("none", "none"), ("Prompt-Lookup", "prompt-lookup")
    if flag.name == "--routing":
        return ("round-robin", "round-robin"), ("Least-Loaded", "least-loaded")
    if flag.name == "--retry-seconds":
        return ("2.5", 2.5), ("0", 0.0)
    by_type: dict[object, tuple[tuple[str, object], tuple[str, object]]] = {
        int: (("7", 7), ("8", 8)),
        float: (("2.5", 2.5), ("3.5", 3.5)),
        Path: (("/srv/exo-a", Path("/srv/exo-a")), ("/srv/exo-b", Path("/srv/exo-b"))),
    }
    return by_type.get(flag.type, (("one", "one"), ("two", "two")))


def test_every_flag_is_declared_once_with_its_env_var() -> None:
    assert len({flag.name for flag in FLAGS}) == len(FLAGS)
    for flag in FLAGS:
        assert flag.env == "EXO_" + dest(flag).upper()


def test_no_command_runs_a_node_with_the_defaults() -> None:
    args = parse_args([])
    assert args.command is None
    assert (args.host, args.api_port, args.grpc_host, args.grpc_port) == (
        "0.0.0.0",
        DEFAULT_API_PORT,
        "0.0.0.0",
        DEFAULT_GRPC_PORT,
    )
    assert args.model == DEFAULT_MODEL_ID
    assert args.log_level == "INFO"
    assert args.data_dir == default_data_dir()
    assert models_dir(args) == default_data_dir() / "models"
    assert not (args.force_master or args.no_worker or args.no_api or args.no_discovery)


def test_node_flags_parse_without_a_command() -> None:
    args = parse_args(
        ["--api-port", "1234", "--no-worker", "--peers", "a:1,b:2", "--model", "none"]
    )
    assert (args.command, args.api_port, args.no_worker) == (None, 1234, True)
    assert (args.peers, args.model) == ("a:1,b:2", "none")


@pytest.mark.parametrize("command", ["download", "import-gguf"])
def test_subcommands_find_models_where_the_node_does(command: str, tmp_path: Path) -> None:
    args = parse_args(COMMANDS[command])
    assert args.command == command
    assert models_dir(args) == default_data_dir() / "models"
    given = parse_args([*COMMANDS[command], "--models-dir", str(tmp_path)])
    assert models_dir(given) == tmp_path
    in_data_dir = parse_args([*COMMANDS[command], "--data-dir", str(tmp_path)])
    assert models_dir(in_data_dir) == tmp_path / "models"


def test_subcommand_arguments() -> None:
    download = parse_args(COMMANDS["download"])
    assert download.model_id == "org/model"
    imported = parse_args(COMMANDS["import-gguf"])
    assert (imported.path, imported.model_id) == (Path("model.gguf"), "org/model")


def test_exo_data_dir_is_one_models_dir_for_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_DATA_DIR", str(tmp_path))
    node = node_config(parse_args([]))
    assert (node.data_dir, node.models_dir) == (tmp_path, tmp_path / "models")
    for argv in COMMANDS.values():
        assert models_dir(parse_args(argv)) == tmp_path / "models"


@pytest.mark.parametrize(
    ("argv", "env", "on"),
    [
        ([], {}, True),
        (["--speculation", "none"], {}, False),
        ([], {"EXO_SPECULATION": "none"}, False),
    ],
)
def test_speculation_is_on_unless_turned_off(
    argv: list[str], env: dict[str, str], on: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_DATA_DIR", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert node_config(parse_args(argv)).speculation is on


def test_images_are_fetched_unless_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_DATA_DIR", str(tmp_path))
    assert node_config(parse_args([])).fetch_images is True
    assert node_config(parse_args(["--no-fetch-images"])).fetch_images is False
    monkeypatch.setenv("EXO_NO_FETCH_IMAGES", "1")
    assert node_config(parse_args([])).fetch_images is False


def test_the_ollama_port_is_off_unless_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_DATA_DIR", str(tmp_path))
    assert node_config(parse_args([])).ollama_port is None
    assert node_config(parse_args(["--ollama-port", "11434"])).ollama_port == 11434
    monkeypatch.setenv("EXO_OLLAMA_PORT", "11435")
    assert node_config(parse_args([])).ollama_port == 11435


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ollama-port", str(DEFAULT_API_PORT)], "--ollama-port must differ from --api-port"),
        (["--ollama-port", "70000"], "--ollama-port must be a port number"),
        (["--ollama-port", "11434", "--no-api"], "which --no-api turns off"),
    ],
)
def test_a_bad_ollama_port_exits_2_with_a_sentence(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _exits_2_saying(argv, message, tmp_path, monkeypatch)


def _exits_2_saying(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node given `argv` exits with code 2, logging `message`."""
    monkeypatch.setenv("EXO_DATA_DIR", str(tmp_path))
    logged: list[str] = []
    sink = logger.add(logged.append, level="ERROR")
    try:
        with pytest.raises(SystemExit) as exit_info:
            node_config(parse_args(argv))
    finally:
        logger.remove(sink)
    assert exit_info.value.code == 2
    assert message in "".join(logged)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--draft-model", "no-such-model"], "--draft-model no-such-model: no such model in"),
        (["--draft-model", "../up"], "--draft-model:"),
        (
            ["--draft-model", "SmolLM2-135M-Instruct", "--speculation", "none"],
            "which --speculation none turns off",
        ),
    ],
)
def test_a_bad_draft_model_exits_2_with_a_sentence(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _exits_2_saying(argv, message, tmp_path, monkeypatch)


def test_a_draft_model_is_one_in_the_models_dir_or_the_built_in_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_DATA_DIR", str(tmp_path))
    assert node_config(parse_args([])).draft_model is None
    # The built-in model is imported at start: it may be named before it is there.
    built_in = node_config(parse_args(["--draft-model", "SmolLM2-135M-Instruct"]))
    assert built_in.draft_model == "SmolLM2-135M-Instruct"
    (node_config(parse_args([])).models_dir / "tiny-draft").mkdir(parents=True)
    (node_config(parse_args([])).models_dir / "tiny-draft" / "config.json").write_text("{}")
    assert node_config(parse_args(["--draft-model", "tiny-draft"])).draft_model == "tiny-draft"


def test_import_gguf_lands_where_the_node_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EXO_DATA_DIR", str(tmp_path))
    main(["import-gguf", str(builtin_gguf_path()), "--model-id", "me/smol"])
    folder = node_config(parse_args([])).models_dir / "me--smol"
    assert capsys.readouterr().out.strip() == str(folder)
    assert (folder / "config.json").is_file()


@pytest.mark.parametrize("flag", FLAGS, ids=lambda flag: flag.env)
def test_each_env_var_replaces_its_default(flag: Flag, monkeypatch: pytest.MonkeyPatch) -> None:
    text, value = ("1", True) if flag.switch else samples(flag)[0]
    assert getattr(parse_args([]), dest(flag)) != value
    monkeypatch.setenv(flag.env, text)
    commands = COMMANDS.values() if flag.scope == "shared" else [[]]
    for argv in commands:
        assert getattr(parse_args(argv), dest(flag)) == value


@pytest.mark.parametrize("flag", FLAGS, ids=lambda flag: flag.name)
def test_a_flag_beats_its_env_var(flag: Flag, monkeypatch: pytest.MonkeyPatch) -> None:
    if flag.switch:
        monkeypatch.setenv(flag.env, "0")
        assert getattr(parse_args([flag.name]), dest(flag)) is True
        return
    (env_text, _), (flag_text, value) = samples(flag)
    monkeypatch.setenv(flag.env, env_text)
    assert getattr(parse_args([flag.name, flag_text]), dest(flag)) == value


@pytest.mark.parametrize("flag", SHARED, ids=lambda flag: flag.name)
@pytest.mark.parametrize("command", ["download", "import-gguf"])
def test_a_shared_flag_works_before_and_after_the_subcommand(
    flag: Flag, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (env_text, _), (flag_text, value) = samples(flag)
    monkeypatch.setenv(flag.env, env_text)
    after = parse_args([*COMMANDS[command], flag.name, flag_text])
    before = parse_args([flag.name, flag_text, *COMMANDS[command]])
    assert getattr(after, dest(flag)) == getattr(before, dest(flag)) == value


def test_an_empty_env_var_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("EXO_API_PORT", "EXO_MODELS_DIR", "EXO_NO_API"):
        monkeypatch.setenv(env, "")
    args = parse_args([])
    assert (args.api_port, models_dir(args), args.no_api) == (
        DEFAULT_API_PORT,
        default_data_dir() / "models",
        False,
    )


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--api-port", "x"], {}, "argument --api-port: invalid int value: 'x'"),
        (["--log-level", "loud"], {}, "'loud' is not one of TRACE"),
        ([], {"EXO_API_PORT": "x"}, "EXO_API_PORT='x': not a valid --api-port value"),
        ([], {"EXO_LOG_LEVEL": "loud"}, "EXO_LOG_LEVEL='loud': 'loud' is not one of TRACE"),
        ([], {"EXO_NO_API": "maybe"}, "EXO_NO_API='maybe': use 1, true, yes or on"),
        (["--speculation", "eagle"], {}, "'eagle' is not one of prompt-lookup, none"),
        (
            [],
            {"EXO_SPECULATION": "eagle"},
            "EXO_SPECULATION='eagle': 'eagle' is not one of prompt-lookup, none",
        ),
        (["--routing", "random"], {}, "'random' is not one of cache-aware, least-loaded"),
        (["--retry-seconds", "-1"], {}, "'-1' is not a finite number of seconds >= 0"),
        (["--retry-seconds", "soon"], {}, "'soon' is not a number of seconds"),
        (["bogus"], {}, "invalid choice: 'bogus'"),
        (["--bogus"], {}, "unrecognized arguments: --bogus"),
        ([*COMMANDS["download"], "--api-port", "1"], {}, "unrecognized arguments: --api-port"),
        (["download"], {}, "the following arguments are required: model_id"),
        (["import-gguf", "model.gguf"], {}, "the following arguments are required: --model-id"),
    ],
)
def test_bad_input_exits_2_with_a_sentence(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_subcommands_and_env_vars() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "exo.main", "--help"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert "download" in shown.stdout and "import-gguf" in shown.stdout
    for flag in FLAGS:
        assert flag.name in shown.stdout and flag.env in shown.stdout


def test_a_node_flag_before_a_subcommand_is_refused_not_dropped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--api-port", "5", "download", "org/model"])
    assert exit_info.value.code == 2
    assert "--api-port: not an option of 'exo download'" in capsys.readouterr().err
