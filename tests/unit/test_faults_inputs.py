"""Inputs that are not what they claim (issue 27, items 3, 4 and 8): text that is not
valid, an export folder missing its weights or holding damaged tokenizer settings, and
CLI hints that must not turn a file's field into a flag. Each gives one clear error
naming the problem, the file and the fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _cli import one_line_error, run_cli
from edgeprune_runtime.errors import GenerationError, RuntimeLoadError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    from test_fuzz_folders import tiny_export

    return tiny_export(tmp_path_factory.mktemp("faults") / "export")


@pytest.fixture(scope="module")
def sess(export_dir):
    import edgeprune_runtime as runtime

    with runtime.load(export_dir, threads=1) as s:
        yield s


@pytest.mark.parametrize("prompt, needle", [
    ("Hi \ud800", "the prompt is not valid text: it holds the lone surrogate U+D800 (character 3)"),
    ("Hi \udcff", "the prompt is not UTF-8 text: it holds the byte 0xff (character 3)"),
    (["fine", "bad \udc80"], "prompt row 1 is not UTF-8 text: it holds the byte 0x80"),
    ([{"role": "user", "content": "x\udfff"}], "message 0's content is not valid text"),
])
def test_text_that_is_not_valid_is_refused_at_the_boundary(sess, prompt, needle):
    """A lone surrogate (or a byte smuggled in by surrogateescape) used to end in
    tokenizers' bare ``TypeError: TextInputSequence must be str``."""
    with pytest.raises(GenerationError) as e:
        sess.generate(prompt, max_new_tokens=2)
    assert needle in str(e.value) and e.value.hint
    if isinstance(prompt, str):
        with pytest.raises(GenerationError, match="not (valid|UTF-8) text"):
            sess.stream(prompt, max_new_tokens=2)
    with pytest.raises(GenerationError, match="text to encode is not"):
        sess.tokenizer.encode("a\ud800b")
    with pytest.raises(GenerationError, match="text 1 to encode is not"):
        sess.tokenizer.encode_batch(["ok", "a\udcffb"])
    assert sess.generate("Hi \u00ff \U0001F600", max_new_tokens=2).token_ids   # real characters pass


def test_cli_generate_with_bytes_that_are_not_utf8(export_dir):
    """``edgeprune generate EXPORT $'Hi \\xff'``: one line, exit 2 (a real process: the
    argument reaches Python through the locale's surrogateescape)."""
    import os

    env = dict(os.environ, PYTHONPATH=str(ROOT), LC_ALL="C.UTF-8", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "edgeprune.cli", "generate", str(export_dir).encode(),
                           b"Hi \xff", "--max-new-tokens", "2"], env=env, capture_output=True)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    one_line_error(proc.returncode, err, "the prompt is not UTF-8 text", "byte 0xff", "fix:")


def test_missing_weights_file_is_named_by_us(export_dir, tmp_path):
    """A missing ``model.onnx.data`` was reported only through onnxruntime's message."""
    bad = tmp_path / "nodata"
    shutil.copytree(export_dir, bad)
    (bad / "model.onnx.data").unlink()
    import edgeprune_runtime as runtime

    with pytest.raises(RuntimeLoadError, match=r"model\.onnx\.data is missing \(the export wrote "
                                                r"[\d,]+ bytes of weights there\)") as e:
        runtime.load(bad)
    assert "copy the whole folder again" in e.value.hint
    meta = json.loads((bad / "edgeprune.json").read_text())
    del meta["data_bytes"]                    # an export written before the record
    (bad / "edgeprune.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeLoadError, match=r"model\.onnx\.data is missing \(model\.onnx keeps "
                                                "its weights there\\)"):
        runtime.load(bad)


@pytest.mark.parametrize("name, field, value, needle", [
    ("tokenizer_config.json", "eos_token", 5, "field 'eos_token' = '5' is not a token string"),
    ("tokenizer_config.json", "chat_template", [1, 2], "field 'chat_template'"),
    ("generation_config.json", "eos_token_id", "x", "field 'eos_token_id' = 'x' is not a token id"),
    ("tokenizer_config.json", None, [1, 2], "a JSON object expected, found list"),
])
def test_damaged_tokenizer_settings_name_their_file(export_dir, tmp_path, name, field, value, needle):
    import edgeprune_runtime as runtime

    bad = tmp_path / "tok"
    shutil.copytree(export_dir, bad)
    p = bad / name
    data = json.loads(p.read_text()) if p.exists() else {}
    if field is None:
        data = value
    else:
        data[field] = value
    p.write_text(json.dumps(data))
    with pytest.raises(RuntimeLoadError) as e:
        runtime.load(bad)
    assert name in str(e.value) and needle in str(e.value), str(e.value)
    (bad / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    p.write_text(json.dumps({}))
    with pytest.raises(RuntimeLoadError, match="chat_template.jinja"):
        runtime.load(bad)


def test_hint_rewriter_leaves_a_files_field_alone(export_dir, tmp_path, capsys):
    """``edgeprune.json says max_length=...`` is what the file holds, not ``--max-length``;
    the flags the Python API's words stand for are still rewritten."""
    from edgeprune.cli._app import _as_cli_hint

    msg = ("edgeprune.json says max_length=1000000000000 but the graph's rotary tables hold 64 "
           "positions (fix: restore the folder's edgeprune.json (max_length 64), or re-export "
           "with `--max-length`)")
    assert _as_cli_hint(msg) == msg
    assert _as_cli_hint("field threads=2 of cfg.toml; pass e.g. threads=2") == \
        "field threads=2 of cfg.toml; pass e.g. --threads 2"
    assert _as_cli_hint("max_length=0 must be >= 1 (fix: pass e.g. max_length=512)") == \
        "--max-length 0 must be >= 1 (fix: pass e.g. --max-length 512)"
    bad = tmp_path / "long"
    shutil.copytree(export_dir, bad)
    meta = json.loads((bad / "edgeprune.json").read_text())
    meta["max_length"] = 10 ** 12
    (bad / "edgeprune.json").write_text(json.dumps(meta))
    code, _, err = run_cli(["generate", bad, "hi", "--max-new-tokens", "2"], capsys)
    one_line_error(code, err, "edgeprune.json says max_length=1000000000000")
    assert "--max-length 1000000000000" not in err and code == 2
