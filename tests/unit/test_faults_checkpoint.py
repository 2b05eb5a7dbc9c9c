"""Damaged model and checkpoint files (issue 27, items 2, 4 and 8): every one gives one
error naming the file and what to do (exit 2 on the command line), never "internal
error ... report it"; nothing is unpickled; a checkpoint never points at remote code it
does not hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _cli import one_line_error, run_cli
from edgeprune.errors import CheckpointError, ModelLoadError
from test_cli_inputs import model_dir  # noqa: F401 - the tiny saved llama, a fixture

CAL = ["--calib", "default", "--nsamples", "2", "--seqlen", "32"]


@pytest.fixture(scope="module")
def ck_dir(model_dir, tmp_path_factory) -> Path:
    from edgeprune.cli import main

    out = tmp_path_factory.mktemp("faults") / "ck"
    assert main(["compress", str(model_dir), "--method", "rtn", "--bits", "4", "--group-size", "32",
                 *CAL, "--out", str(out)]) == 0
    return out


def _retensor(path: Path, name: str, shape: tuple) -> None:
    """Rewrite ``path`` (safetensors) with tensor ``name`` of another ``shape``."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(path))
    t[name] = torch.zeros(shape, dtype=t[name].dtype)
    save_file(t, str(path), metadata={"format": "pt"})


def _pickled(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2)}, folder / "pytorch_model.bin")


def _damaged(kind: str, folder: Path) -> tuple[str, str]:
    """Damage ``folder`` one way; returns ``(file named, words the error must hold)``."""
    if kind == "truncated":
        p = folder / "model.safetensors"
        p.write_bytes(p.read_bytes()[:5000])
        return "model.safetensors", "is truncated or damaged"
    if kind == "garbage-record":
        (folder / "edgeprune_checkpoint.json").write_text("garbage{")
        return "edgeprune_checkpoint.json", "is not readable JSON"
    if kind == "wrong-shape":
        _retensor(folder / "model.safetensors", "model.layers.1.input_layernorm.weight", (32,))
        return "model.safetensors", "has shape (32,), but config.json makes it (64,)"
    if kind == "wrong-shape-codes":
        _retensor(folder / "model.safetensors", "model.layers.0.self_attn.q_proj.weight", (64, 32))
        return "model.safetensors", "has codes of shape (64, 32), but config.json makes it (64, 64)"
    if kind == "typed-config":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["hidden_size"] = "big"
        (folder / "config.json").write_text(json.dumps(cfg))
        return "config.json", "field 'hidden_size' = 'big' is not a positive integer"
    if kind == "pickle":
        _pickled(folder)
        return "pytorch_model.bin", "holds pickled weights, which edgeprune does not load"
    raise AssertionError(kind)


KINDS = ["truncated", "garbage-record", "wrong-shape", "wrong-shape-codes", "typed-config", "pickle"]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_is_named_with_its_fix(ck_dir, tmp_path, capsys, kind):
    """``load_checkpoint``, ``edgeprune export`` and ``edgeprune compress`` of a damaged
    checkpoint: one CheckpointError line naming the file, exit 2, nothing written."""
    from edgeprune.checkpoint import load_checkpoint

    bad = tmp_path / "bad"
    shutil.copytree(ck_dir, bad)
    name, words = _damaged(kind, bad)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    assert name in str(e.value) and words in str(e.value), str(e.value)
    assert e.value.hint
    for argv in (["export", bad, tmp_path / "onnx", "--max-length", "64"],
                 ["compress", bad, "--method", "rtn", "--bits", "4", "--group-size", "32", *CAL,
                  "--out", tmp_path / "ck2"]):
        code, _, err = run_cli(argv, capsys)
        assert code == 2, err
        one_line_error(code, err, name, words)
        assert "internal error" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


@pytest.mark.parametrize("kind", ["truncated", "typed-config", "pickle"])
def test_model_folder_check_names_the_file(model_dir, tmp_path, kind):
    """:func:`edgeprune.checkpoint.validate.check_model_folder`: the check a plain model
    folder (and the GGUF conversion cache) gets before transformers reads it."""
    from edgeprune.checkpoint.validate import check_model_folder

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    name, words = _damaged(kind, bad)
    cache_fix = f"delete {bad} (a damaged cache entry); the next load converts the GGUF file again"
    with pytest.raises(ModelLoadError) as e:
        check_model_folder(bad, error=ModelLoadError, fix=cache_fix)
    assert name in str(e.value) and words in str(e.value)
    if kind != "pickle":
        assert e.value.hint == cache_fix
    assert check_model_folder(model_dir)["model.embed_tokens.weight"] == ("F32", (256, 64))


def test_safetensors_header_checks(tmp_path):
    from edgeprune.checkpoint.validate import safetensors_header
    from safetensors.torch import save_file

    p = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.int8)}, str(p))
    assert safetensors_header(p) == {"a": ("F32", (3, 4)), "b": ("I8", (5,))}
    raw = p.read_bytes()
    for bad, why in ((raw[:4], "shorter than a safetensors header"),
                     (raw[:-1], "the file has"),
                     (raw + b"\0", "the file has"),
                     (b"\xff" * 8 + raw[8:], "its header claims"),
                     (raw[:8] + b"[" + raw[9:], "unreadable header")):
        p.write_bytes(bad)
        with pytest.raises(CheckpointError, match="w.safetensors is truncated or damaged") as e:
            safetensors_header(p)
        assert why in str(e.value)


def test_checkpoint_of_a_remote_code_folder_holds_no_auto_map(model_dir, tmp_path, capsys):
    """``auto_map`` points transformers at code the checkpoint does not hold."""
    src = tmp_path / "rc"
    shutil.copytree(model_dir, src)
    for name, amap in (("config.json", {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}),
                       ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_x.XTok", None]})):
        cfg = json.loads((src / name).read_text())
        cfg["auto_map"] = amap
        (src / name).write_text(json.dumps(cfg))
    code, _, err = run_cli(["compress", src, "--method", "rtn", "--bits", "4", "--group-size", "32",
                            *CAL, "--out", tmp_path / "ck"], capsys)
    assert code == 0, err
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((tmp_path / "ck" / name).read_text()), name
    from edgeprune.checkpoint import load_checkpoint
    load_checkpoint(tmp_path / "ck")


def test_export_into_a_read_only_location_fails_before_loading(model_dir, ck_dir, monkeypatch, capsys):
    """``export`` checks OUT up front, as run / compress / leank / profile do: not after
    loading the model as "internal error: OSError: [Errno 30] Read-only file system"."""
    import edgeprune.checkpoint as ckpt
    from edgeprune import models

    def boom(*a, **k):
        raise AssertionError("loaded the model before checking OUT")

    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(ckpt, "load_checkpoint", boom)
    for src in (model_dir, ck_dir):
        code, _, err = run_cli(["export", src, "/proc/nope/onnx", "--max-length", "64"], capsys)
        one_line_error(code, err, "/proc/nope/onnx", "cannot be written")
        assert code == 2
