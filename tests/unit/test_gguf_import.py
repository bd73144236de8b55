import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from exo.engine.mlx.generate import LocalModel, TextDelta, TextGenerator
from exo.engine.mlx.load import load_for_inference
from exo.main import main
from exo.models.builtin import builtin_gguf_path, ensure_default_model
from exo.models.gguf_import import (
    IMPORT_MARKER,
    GGUFImportError,
    build_tokenizer_files,
    import_gguf,
)
from exo.models.sampling_defaults import read_sampling_defaults
from exo.shared.types.tasks import GenerationParams


def test_config_values(smollm_dir: Path) -> None:
    config = json.loads((smollm_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    quantization = config["quantization"]
    assert (quantization["group_size"], quantization["bits"]) == (32, 4)
    assert quantization["model.embed_tokens"] == {"group_size": 32, "bits": 8}


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "In 2024, 1234567 people paid $89.99 each.",
        "Emoji: 🦄🚀 and accents: café naïve",
        "<|im_start|>user\nHi<|im_end|>\n",
        "  leading spaces\tand\ttabs\n\nnew lines  ",
        "def f(x):\n    return x ** 2  # 3.14159",
    ],
)
def test_tokenizer_round_trip(smollm_dir: Path, text: str) -> None:
    tokenizer = load_tokenizer(smollm_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_digits_are_split_one_by_one(smollm_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm_dir)
    ids = tokenizer.encode("2024", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_control_tokens_are_special(smollm_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm_dir)
    assert tokenizer.encode("<|im_start|><|im_end|><|endoftext|>", add_special_tokens=False) == [
        1,
        2,
        0,
    ]
    assert tokenizer.decode([1, 2, 0], skip_special_tokens=True) == ""
    assert tokenizer.eos_token_id == 2
    config = json.loads((smollm_dir / "tokenizer_config.json").read_text())
    assert len(config["additional_special_tokens"]) == 17
    assert "<|im_start|>" in config["chat_template"]


def test_imported_model_answers_correctly(smollm_dir: Path) -> None:
    """Only right q/k un-permutation and quantized weights give a sensible answer."""
    model, tokenizer = load_for_inference(smollm_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert isinstance(prompt, str)
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    outputs = TextGenerator(LocalModel(model, tokenizer), tokenizer, None).generate(
        tokens, GenerationParams(max_tokens=12, temperature=0)
    )
    text = "".join(o.text for o in outputs if isinstance(o, TextDelta))
    assert "Paris" in text


def test_import_is_idempotent(models_dir: Path, smollm_dir: Path) -> None:
    weights = smollm_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_default_model(models_dir) == smollm_dir
    assert weights.stat().st_mtime_ns == before


def test_builtin_model_has_sampling_defaults(smollm_dir: Path) -> None:
    defaults = read_sampling_defaults(smollm_dir)
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)


def test_failed_import_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)  # the importer loads MLX lazily
    target = tmp_path / "models" / "broken"
    with pytest.raises(OSError, match="No space left"):
        import_gguf(builtin_gguf_path(), target)
    assert not target.exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_a_folder_exo_did_not_import_is_never_overwritten(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(GGUFImportError, match="was not imported by exo"):
        import_gguf(builtin_gguf_path(), target)
    assert (target / "config.json").read_text() == "{}"
    assert not (target / IMPORT_MARKER).exists()


def test_an_older_import_is_redone(tmp_path: Path) -> None:
    target = tmp_path / "model"
    import_gguf(builtin_gguf_path(), target)
    (target / IMPORT_MARKER).write_text(json.dumps({"source_digest": "from an older exo"}))
    import_gguf(builtin_gguf_path(), target, {"temperature": 0.5})
    assert json.loads((target / "generation_config.json").read_text()) == {"temperature": 0.5}


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file" * 100)
    with pytest.raises(GGUFImportError, match="cannot read"):
        import_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_pre_tokenizer_is_refused() -> None:
    _, meta = mx.load(str(builtin_gguf_path()), return_metadata=True)  # pyright: ignore[reportGeneralTypeIssues]
    assert isinstance(meta, dict)
    with pytest.raises(GGUFImportError, match="llama-bpe"):
        build_tokenizer_files({**meta, "tokenizer.ggml.pre": "llama-bpe"})


def test_cli_import_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "import-gguf",
            str(builtin_gguf_path()),
            "--model-id",
            "me/smol",
            "--models-dir",
            str(tmp_path),
        ]
    )
    folder = tmp_path / "me--smol"
    assert capsys.readouterr().out.strip() == str(folder)
    weights = mx.load(str(folder / "model.safetensors"))
    assert isinstance(weights, dict)
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32


@pytest.mark.parametrize("model_id", ["../escape", "/abs/path", "a/b/c", "bad id"])
def test_cli_rejects_bad_model_ids(tmp_path: Path, model_id: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "import-gguf",
                str(builtin_gguf_path()),
                "--model-id",
                model_id,
                "--models-dir",
                str(tmp_path),
            ]
        )
    assert exit_info.value.code == 2
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "import-gguf",
                str(tmp_path / "nope.gguf"),
                "--model-id",
                "x",
                "--models-dir",
                str(tmp_path),
            ]
        )
    assert exit_info.value.code == 2
