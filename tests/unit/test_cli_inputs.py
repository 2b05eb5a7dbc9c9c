"""Bad input to compress / export / eval / run on a tiny saved model: a one-line error
naming the fix, raised before any work, and nothing of the user's lost."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from _cli import one_line_error, run_cli

from tiny import byte_tokenizer

CAL = ["--calib", "default", "--nsamples", "2", "--seqlen", "32"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random llama + byte-level tokenizer saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    m = AutoModelForCausalLM.from_config(cfg).float().eval()
    d = tmp_path_factory.mktemp("cli") / "tiny"
    m.save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


def test_run_never_deletes_the_model_or_foreign_files(model_dir, tmp_path, capsys):
    import shutil

    victim = tmp_path / "victim"
    shutil.copytree(model_dir, victim / "m")
    (victim / "notes.txt").write_text("mine")
    before = sorted(p.name for p in victim.rglob("*"))
    # --out holds the model: refused even with --overwrite
    code, _, err = run_cli(["run", "--model", victim / "m", "--method", "rtn", *CAL, "--out", victim,
                         "--overwrite"], capsys)
    one_line_error(code, err, "input model folder")
    code, _, err = run_cli(["run", "--model", victim / "m", "--method", "rtn", *CAL, "--out", victim / "m",
                         "--overwrite"], capsys)
    one_line_error(code, err, "input model folder")
    # a folder of other files: --overwrite only ever replaces an earlier run's folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    code, _, err = run_cli(["run", "--model", model_dir, "--method", "rtn", *CAL, "--out", other,
                         "--overwrite"], capsys)
    one_line_error(code, err, "not part of an edgeprune run", "thesis.tex")
    # a report.json of someone else's (no run fingerprint) does not make it a run folder
    (other / "report.json").write_text('{"coverage": 91}')
    code, _, err = run_cli(["run", "--model", model_dir, "--method", "rtn", *CAL, "--out", other,
                         "--overwrite"], capsys)
    one_line_error(code, err, "not part of an edgeprune run", "thesis.tex")
    # nor does an edgeprune report beside other files, whatever the fingerprint
    (other / "report.json").write_text('{"fingerprint": "0123456789abcdef"}')
    code, _, err = run_cli(["run", "--model", model_dir, "--method", "rtn", *CAL, "--out", other], capsys)
    one_line_error(code, err, "not part of an edgeprune run", "thesis.tex")
    assert sorted(p.name for p in victim.rglob("*")) == before
    assert (other / "thesis.tex").read_text() == "years of work"


def test_compress_and_export_never_replace_inputs_or_foreign_folders(model_dir, tmp_path, capsys):
    import shutil

    sb = tmp_path / "sb"
    code, _, err = run_cli(["compress", model_dir, "--method", "rtn", "--bits", "4", "--group-size", "32",
                         *CAL, "--out", sb / "ck"], capsys)
    assert code == 0, err
    (sb / "notes.txt").write_text("mine")
    # export into the folder holding the checkpoint, or the checkpoint itself: refused
    for out in (sb, sb / "ck"):
        code, _, err = run_cli(["export", sb / "ck", out, "--overwrite", "--max-length", "64"], capsys)
        one_line_error(code, err, "input model folder")
    # --overwrite never replaces a folder that is not an earlier export / checkpoint
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "thesis.tex").write_text("years of work")
    code, _, err = run_cli(["export", sb / "ck", junk, "--overwrite", "--max-length", "64"], capsys)
    one_line_error(code, err, "not an edgeprune export", "thesis.tex")
    code, _, err = run_cli(["compress", model_dir, "--method", "rtn", *CAL, "--out", junk, "--overwrite"],
                        capsys)
    one_line_error(code, err, "not an edgeprune checkpoint", "thesis.tex")
    # without --overwrite an earlier checkpoint is kept; a file is no output folder
    for out, needle in ((sb / "ck", "--overwrite"), (junk / "thesis.tex", "not a folder")):
        code, _, err = run_cli(["compress", model_dir, "--method", "rtn", *CAL, "--out", out], capsys)
        one_line_error(code, err, needle)
    assert (junk / "thesis.tex").read_text() == "years of work"
    assert (sb / "notes.txt").exists() and (sb / "ck" / "edgeprune_checkpoint.json").exists()
    # an earlier export is replaced; a folder beside a single model file is fine
    code, _, err = run_cli(["export", sb / "ck", tmp_path / "ox", "--max-length", "64"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["export", sb / "ck", tmp_path / "ox", "--overwrite", "--max-length", "32"],
                        capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "ox" / "edgeprune.json").read_text())["max_length"] == 32
    from edgeprune_exporters.folder import source_conflict
    (tmp_path / "dl").mkdir()
    (tmp_path / "dl" / "x.gguf").write_bytes(b"GGUF")
    assert source_conflict(tmp_path / "dl" / "run1", [tmp_path / "dl" / "x.gguf"]) is None
    assert "holds the input model file" in source_conflict(tmp_path / "dl", [tmp_path / "dl" / "x.gguf"])
    shutil.rmtree(tmp_path / "dl")


def test_compress_refuses_its_source_folder_before_calibrating(model_dir, capsys, monkeypatch):
    import edgeprune.calibration as cal

    def boom(*a, **k):
        raise AssertionError("calibrated before checking --out")

    monkeypatch.setattr(cal, "build_calibration", boom)
    code, _, err = run_cli(["compress", model_dir, "--method", "rtn", *CAL, "--out", model_dir / "ck",
                         "--overwrite"], capsys)
    one_line_error(code, err, "input model folder")


def test_unwritable_out_and_bad_counts_fail_before_any_work(model_dir, tmp_path, capsys, monkeypatch):
    """compress / run: an --out that cannot be written, and run's counts for its later
    stages, are one-line errors before the model is even loaded (they were an internal
    error after compressing, or an error at stage 3 or 6 of 6)."""
    import edgeprune.models as models

    def boom(*a, **k):
        raise AssertionError("loaded the model before checking the options")

    monkeypatch.setattr(models, "load_model", boom)
    for cmd in (["compress", model_dir], ["run", "--model", model_dir]):
        code, _, err = run_cli([*cmd, "--method", "rtn", *CAL, "--out", "/proc/nope/ck"], capsys)
        one_line_error(code, err, "--out /proc/nope/ck cannot be written", "writable folder")
    for argv, needle in ((["--prompt-len", "0"], "prompt_len must be an integer >= 1"),
                         (["--gen-len", "1"], "gen_len must be an integer >= 2"),
                         (["--repeat", "0"], "repeat must be"), (["--threads", "0"], "--threads 2"),
                         (["--eval-seqlen", "1"], "--eval-seqlen 512"),
                         (["--eval-nwindows", "-1"], "--eval-nwindows 40")):
        code, _, err = run_cli(["run", "--model", model_dir, "--method", "rtn", *CAL, *argv,
                                "--out", tmp_path / "r"], capsys)
        one_line_error(code, err, needle)
    assert not (tmp_path / "r").exists()
    for bad in ("0", "-1"):
        code, _, err = run_cli(["eval", model_dir, "--threads", bad], capsys)
        one_line_error(code, err, f"--threads {bad} must be >= 1")


@pytest.mark.parametrize("argv, needle", [
    (["--recipe", "best-w4", "--bits", "8"], "--bits"),
    (["--recipe", "best-w4", "--method", "gptq"], "--method"),
    (["--method", "wanda", "--sparsity", "0.7", "--pattern", "2:4"], "1 - N/M"),
    (["--method", "rtn", "--device", "cuda:7" if torch.cuda.is_available() else "cuda"], "cuda"),
    (["--method", "rtn", "--device", "tpu"], "tpu"),
])
def test_compress_conflicting_or_impossible_options(model_dir, tmp_path, capsys, argv, needle):
    code, _, err = run_cli(["compress", model_dir, *argv, *CAL, "--out", tmp_path / "ck"], capsys)
    one_line_error(code, err, needle)
    assert not (tmp_path / "ck").exists()


def test_checkpoint_records_the_method_name(model_dir, tmp_path, capsys):
    code, _, err = run_cli(["compress", model_dir, "--method", "rtn", "--bits", "4", "--group-size", "32",
                         *CAL, "--out", tmp_path / "ck"], capsys)
    assert code == 0, err
    rec = json.loads((tmp_path / "ck" / "edgeprune_checkpoint.json").read_text())
    assert rec["method"] == "rtn"


@pytest.mark.parametrize("argv, needle", [
    (["--precision", "int4", "--group-size", "48"], "power of two"),
    (["--precision", "int4", "--accuracy-level", "7"], "accuracy_level=7"),
    (["--max-length", "0"], "--max-length 0"),
    (["--precision", "int4", "--accuracy-level-for", "dwn_proj=0"], "matches no MatMulNBits"),
    # the variants' compress flags moved to `edgeprune leank` / `edgeprune countdown`
    (["--leank-mask", "mask.json", "--act-sparsity", "0.5"], "--leank-mask, --act-sparsity: export no longer"),
    (["--leank-mask", "mask.json", "--k-keep", "0.25"], "edgeprune leank MODEL --k-keep R --out leank.json"),
    (["--countdown", "m"], "edgeprune countdown MODEL --act-sparsity S"),
    (["--variant", "nosuch"], "graph variant 'nosuch' is unknown"),
    (["--variant", "missing.json"], "missing.json does not exist"),
])
def test_export_bad_options_are_one_line_errors(model_dir, tmp_path, capsys, argv, needle):
    out = tmp_path / "onnx"
    code, _, err = run_cli(["export", model_dir, out, *argv], capsys)
    one_line_error(code, err, needle)
    assert list(tmp_path.iterdir()) == []            # no output, no temporary folder left


def test_float_export_of_a_quantized_checkpoint_is_really_float(model_dir, tmp_path, capsys):
    code, _, err = run_cli(["compress", model_dir, "--method", "rtn", "--bits", "4", "--group-size", "32",
                         *CAL, "--out", tmp_path / "ck"], capsys)
    assert code == 0, err
    for prec in ("fp16", "fp32", "int4"):
        out = tmp_path / prec
        code, stdout, err = run_cli(["export", tmp_path / "ck", out, "--precision", prec,
                                  "--max-length", "64"], capsys)
        assert code == 0, err
        g = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
        n = sum(nd.op_type == "MatMulNBits" and not nd.name.startswith("lm_head") for nd in g.node)
        meta = json.loads((out / "edgeprune.json").read_text())
        assert meta["precision"] == prec
        if prec == "int4":
            assert n >= 1 and meta["weights"] is None
        else:
            assert n == 0 and meta["quantization"] is None
            assert meta["weights"] == "dequantized from the checkpoint's int codes"
            assert "dequantized" in stdout


def test_eval_text_missing_file_and_formats(model_dir, tmp_path, capsys):
    code, _, err = run_cli(["eval", model_dir, "--text", tmp_path / "notes.md"], capsys)
    one_line_error(code, err, "does not exist")
    code, _, err = run_cli(["eval", model_dir, "--text", "wiki.test"], capsys)
    one_line_error(code, err, "does not exist")
    docs = ["The quick brown fox jumps over the lazy dog. " * 6, "Small models run on phones. " * 8]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "e.txt").write_text("\n\n".join(docs))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs}), tmp_path / "e.parquet")
    ppl = {}
    for ext in ("txt", "jsonl", "parquet"):
        js = tmp_path / f"{ext}.json"
        code, _, err = run_cli(["eval", model_dir, "--text", tmp_path / f"e.{ext}", "--seqlen", "64",
                             "--nwindows", "2", "--json", js], capsys)
        assert code == 0, err
        rec = json.loads(js.read_text())
        ppl[ext] = rec["ppl"]
        assert rec["protocol"]["text_source"].endswith(f"e.{ext}")
    # the same documents score the same whatever the file format
    assert ppl["jsonl"] == pytest.approx(ppl["txt"], rel=1e-6)
    assert ppl["parquet"] == pytest.approx(ppl["txt"], rel=1e-6)


def test_report_markdown_table_escapes_pipes():
    from edgeprune.pipeline import RunReport

    rep = RunReport(out_dir="x", config={"model": "m", "prompt_len": 1, "gen_len": 2, "threads": 1,
                                         "repeat": 1},
                    fingerprint="f", rows={"KL(dense||compressed) nats/token": {"dense": 0.0,
                                                                                "compressed": 0.1}},
                    samples={}, compression={}, protocol={}, export={}, seconds={})
    row = [ln for ln in rep.to_markdown().splitlines() if ln.startswith("| KL")][0]
    # 5 cells (metric, dense, export, PyTorch, ratio): the escaped pipes are not column separators
    assert len([c for c in row.replace("\\|", "").split("|") if c.strip()]) == 5
    assert "KL(dense\\|\\|compressed)" in row


def test_outputs_get_plain_permissions(model_dir, tmp_path, capsys):
    """mkdtemp/mkstemp (0700/0600) and safetensors (0600) must not leak into outputs that
    another user or an app's service account has to read: modes follow the umask."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        code, _, err = run_cli(["compress", model_dir, "--method", "rtn", "--bits", "4", "--group-size",
                             "32", *CAL, "--out", tmp_path / "ck"], capsys)
        assert code == 0, err
        code, _, err = run_cli(["export", tmp_path / "ck", tmp_path / "onnx", "--max-length", "64"], capsys)
        assert code == 0, err
    finally:
        os.umask(old)
    for folder in (tmp_path / "ck", tmp_path / "onnx"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        for f in folder.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_recipe_setting_of_the_wrong_type_is_one_line(model_dir, tmp_path, capsys):
    (tmp_path / "r.yaml").write_text("stages:\n  - method: gptq\n    bits: 4\n    blocksize: '128'\n")
    code, _, err = run_cli(["compress", model_dir, "--recipe", tmp_path / "r.yaml", *CAL,
                         "--out", tmp_path / "ck"], capsys)
    one_line_error(code, err, "blocksize='128' must be an integer", "blocksize: 128")


def test_eval_window_longer_than_the_context_is_refused(model_dir, capsys):
    code, _, err = run_cli(["eval", model_dir, "--seqlen", "1024"], capsys)   # context 512
    one_line_error(code, err, "max_position_embeddings=512", "--seqlen 512")


def test_eval_dtype_of_an_export_is_refused_before_loading(tmp_path, capsys):
    exp = tmp_path / "export"
    exp.mkdir()
    (exp / "model.onnx").write_bytes(b"not read")          # refused before anything loads
    (exp / "edgeprune.json").write_text("{}")
    code, _, err = run_cli(["eval", exp, "--dtype", "bfloat16"], capsys)
    one_line_error(code, err, "--dtype bfloat16 applies to PyTorch models", "drop --dtype")


def test_narrow_codes_are_labelled_and_long_contexts_warned(tiny_llama, tmp_path):
    import edgeprune_exporters as exporters
    from edgeprune.quantize import rtn_quantize

    q = {n: rtn_quantize(m.weight.detach(), 3, 32, False) for n, m in tiny_llama.named_modules()
         if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with pytest.warns(UserWarning, match="exceeds the model's trained context"):
        res = exporters.export_onnx(tiny_llama, byte_tokenizer(), tmp_path / "q3", precision="int4",
                                    quantized=q, max_length=600, validate=False)
    assert res.metadata["quantization"]["code_bits"] == [3]
    assert "3-bit codes stored exactly as 4-bit MatMulNBits" in res.summary()


def test_eval_text_paths_with_spaces_and_folders(model_dir, tmp_path, capsys):
    for text in (tmp_path / "no such dir" / "wiki.test.raw", "My Notes.txt"):
        code, _, err = run_cli(["eval", model_dir, "--text", text], capsys)
        one_line_error(code, err, "does not exist")
    code, _, err = run_cli(["eval", model_dir, "--text", tmp_path], capsys)
    one_line_error(code, err, "is a folder")
    (tmp_path / "E.JSONL").write_text(json.dumps({"text": "Small models run on phones. " * 20}) + "\n")
    js = tmp_path / "u.json"
    code, _, err = run_cli(["eval", model_dir, "--text", tmp_path / "E.JSONL", "--seqlen", "32",
                         "--nwindows", "1", "--json", js], capsys)
    assert code == 0, err
    from edgeprune.evaluate import resolve_text
    assert resolve_text(tmp_path / "E.JSONL")[0].startswith("Small models")   # the field, not raw JSON


def test_run_caps_evaluation_windows_at_a_short_context(tmp_path):
    """A model with a 256-token context: run's default 512-token evaluation windows are
    capped before compressing (it had failed after compression)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from edgeprune.pipeline import RunConfig, run_pipeline

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    d = tmp_path / "m256"
    AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    logs = []
    rep = run_pipeline(RunConfig(model=str(d), method="rtn", calib="default", nsamples=2, seqlen=32,
                                 eval_nwindows=1, threads=1, prompt_len=8, gen_len=4, repeat=1),
                       tmp_path / "run", log=logs.append, export_dense=False)
    assert rep.protocol["seqlen"] == 256
    assert any("capped at the model's context: 256" in m for m in logs)


def test_the_alias_file_is_protected_like_a_path():
    """`smollm2-135m` reads a GGUF inside an installed package: an output folder holding
    it is refused like one holding a model path (checked without writing anything)."""
    from edgeprune.checkpoint import check_out_dir
    from edgeprune.errors import CheckpointError
    from edgeprune.models import local_source, resolve_alias
    from edgeprune.pipeline import _check_out

    gguf = resolve_alias("smollm2-135m").resolve()
    assert local_source("smollm2-135m") == gguf
    assert local_source("owner/some-hub-model") is None
    with pytest.raises(CheckpointError, match="holds the input model file"):
        _check_out(gguf.parent, "fingerprint", True, "smollm2-135m")
    with pytest.raises(CheckpointError, match="holds the input model file"):
        check_out_dir(gguf.parent, [local_source("smollm2-135m")], True)


class _FakeSession:
    """Stands in for ``runtime.load(...)``: records the keyword arguments ``stream`` got
    (in ``seen``), runs ``check`` on them, and yields ``"ok"``."""

    def __init__(self, seen, check=None):
        self.seen, self.check = seen, check

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def stream(self, prompt, **kw):
        self.seen.update(kw)
        if self.check:
            self.check(kw)
        yield "ok"


def test_generate_stop_understands_typed_escapes(monkeypatch, capsys):
    """`--stop '\\n\\n'` (a shell passes backslash + n) stops at a blank line, as the README
    shows; other backslashes stay as typed."""
    import edgeprune_runtime as runtime

    seen = {}
    monkeypatch.setattr(runtime, "load", lambda *a, **kw: _FakeSession(seen))
    code, out, err = run_cli(["generate", "somewhere", "hi", "--stop", "\\n\\n", "--stop", "a\\tb",
                              "--stop", "C:\\x"], capsys)
    assert code == 0, err
    assert seen["stop"] == ["\n\n", "a\tb", "C:\\x"] and out.startswith("ok")


def test_profile_outputs_checked_before_measuring(tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    code, _, err = run_cli(["profile", tmp_path / "nowhere", "--out", f], capsys)
    one_line_error(code, err, "--out", "is a file")
    code, _, err = run_cli(["profile", tmp_path / "nowhere", "--json", tmp_path], capsys)
    one_line_error(code, err, "--json", "names a folder")
    code, _, err = run_cli(["profile", tmp_path / "nowhere", "--json", f"{tmp_path / 'newdir'}/"], capsys)
    one_line_error(code, err, "--json", "names a folder")      # was written as a file 'newdir'
    # paths that cannot take a file: under a file, in /proc (an internal error after the
    # whole measurement before)
    for flag, path in (("--json", f / "p.json"), ("--out", f / "sub"), ("--json", "/proc/p.json")):
        code, _, err = run_cli(["profile", tmp_path / "nowhere", flag, path], capsys)
        one_line_error(code, err, flag, "cannot be written")
    code, _, err = run_cli(["devices", "--json", f / "d.json"], capsys)
    one_line_error(code, err, "--json", "cannot be written")
    # an output inside the measured export folder would replace its files
    export = tmp_path / "export"
    export.mkdir()
    (export / "edgeprune.json").write_text("{}")
    for flag, path in (("--json", export / "edgeprune.json"), ("--out", export), ("--out", export / "p")):
        code, _, err = run_cli(["profile", export, flag, path], capsys)
        one_line_error(code, err, "refusing to write", flag)
    assert (export / "edgeprune.json").read_text() == "{}" and len(list(export.iterdir())) == 1
    # a folder that merely holds the export is fine for --out (profile only adds files)
    code, _, err = run_cli(["profile", export, "--out", tmp_path], capsys)
    one_line_error(code, err, "no model.onnx")
    assert list(tmp_path.glob("**/tmp*")) == []            # the write probe left nothing


def test_cli_errors_name_flags_not_python_arguments(tmp_path, capsys):
    """The runtime's fix 'pass e.g. threads=2' reads '--threads 2' on the command line."""
    code, _, err = run_cli(["generate", tmp_path, "hi", "--threads", "0"], capsys)
    one_line_error(code, err, "--threads 2")
    assert "threads=" not in err


def test_generate_prompt_lookup_flags(monkeypatch, capsys, tmp_path):
    """`--prompt-lookup-num-tokens` / `--max-matching-ngram-size` reach the runtime, and a
    bad value is a one-line error naming the flag."""
    import edgeprune_runtime as runtime
    from edgeprune_runtime.lookup import check_lookup_args

    seen = {}
    monkeypatch.setattr(runtime, "load", lambda *a, **kw: _FakeSession(seen))
    code, out, err = run_cli(["generate", "somewhere", "hi", "--prompt-lookup-num-tokens", "5",
                              "--max-matching-ngram-size", "3"], capsys)
    assert code == 0, err
    assert seen["prompt_lookup_num_tokens"] == 5 and seen["max_matching_ngram_size"] == 3
    code, out, err = run_cli(["generate", "somewhere", "hi"], capsys)
    assert seen["prompt_lookup_num_tokens"] == 0 and seen["max_matching_ngram_size"] == 2
    check = lambda kw: check_lookup_args(kw["prompt_lookup_num_tokens"], kw["max_matching_ngram_size"])  # noqa: E731
    monkeypatch.setattr(runtime, "load", lambda *a, **kw: _FakeSession(seen, check))
    code, _, err = run_cli(["generate", "somewhere", "hi", "--prompt-lookup-num-tokens", "-2"], capsys)
    one_line_error(code, err, "--prompt-lookup-num-tokens 4")
    assert "prompt_lookup_num_tokens=" not in err


def test_console_prints_brackets_as_they_are(model_dir, tmp_path, capsys):
    """Paths and protocol labels with square brackets print verbatim (rich read them as
    markup: '[v2]' and '[heldout]' vanished, and '[/x]' in a path crashed a finished
    compress with MarkupError, exit 1)."""
    import shutil
    odd = tmp_path / "m[v2]"
    shutil.copytree(model_dir, odd)
    code, out, err = run_cli(["eval", odd, "--seqlen", "32", "--nwindows", "1", "--threads", "1"], capsys)
    assert code == 0, err
    assert "m[v2]" in out and "[heldout]" in out
    (tmp_path / "a[").mkdir()
    code, out, err = run_cli(["compress", odd, "--method", "rtn", "--group-size", "32", *CAL,
                              "--out", tmp_path / "a[" / "x]"], capsys)
    assert code == 0, err
    assert "a[/x]" in out


def test_compress_into_an_earlier_checkpoint_names_it(model_dir, tmp_path, capsys):
    """A second compress into the same folder needs --overwrite; the message says the
    folder holds a checkpoint (it said 'a different run' even for the identical command)."""
    argv = ["compress", model_dir, "--method", "rtn", "--group-size", "32", *CAL, "--out", tmp_path / "ck"]
    assert run_cli(argv, capsys)[0] == 0
    code, _, err = run_cli(argv, capsys)
    one_line_error(code, err, "already holds a checkpoint", "--overwrite")
    assert run_cli(argv + ["--overwrite"], capsys)[0] == 0


def test_model_folder_without_tokenizer_is_named(model_dir, tmp_path, capsys):
    """An HF folder with weights but no tokenizer: the error names the missing tokenizer
    (it was transformers' multi-line text about installing sentencepiece or tiktoken)."""
    import shutil
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / f, bare / f)
    for argv in (["export", bare, tmp_path / "onnx"], ["eval", bare, "--seqlen", "32", "--nwindows", "1"]):
        code, _, err = run_cli(argv, capsys)
        one_line_error(code, err, f"{bare} has no tokenizer", "tokenizer.json", "save_pretrained")
    assert not (tmp_path / "onnx").exists()


def test_eval_of_an_export_keeps_the_models_context_and_tokenizer_identity(model_dir, tmp_path, capsys):
    """An export's trained context is checked like the torch model's (an export with a
    longer max_length scored untrained positions), and the protocol names the same
    tokenizer (content hash) for the model folder and its export."""
    import warnings
    code, _, err = run_cli(["eval", model_dir, "--seqlen", "600"], capsys)
    one_line_error(code, err, "max_position_embeddings=512")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code, _, err = run_cli(["export", model_dir, tmp_path / "onnx", "--max-length", "1024"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["eval", tmp_path / "onnx", "--seqlen", "600"], capsys)
    one_line_error(code, err, "max_position_embeddings=512", "--seqlen 512")
    protos = []
    for src in (model_dir, tmp_path / "onnx"):
        j = tmp_path / "e.json"
        code, out, err = run_cli(["eval", src, "--seqlen", "32", "--nwindows", "2", "--json", j], capsys)
        assert code == 0, err
        protos.append(json.loads(j.read_text())["protocol"]["tokenizer"])
    digests = [p.split("sha256 ")[1].rstrip(")") for p in protos]
    assert digests[0] == digests[1] and len(digests[0]) == 12


def test_table_cells_and_json_of_tiny_or_infinite_figures():
    """A KL of 2e-5 prints as such (it read 0.0000); inf / NaN are strict-JSON strings."""
    from edgeprune.cli import _finite
    from edgeprune.pipeline import format_value
    assert format_value(2.3e-5) == "2.3e-05" and format_value(0.0) == "0.0000"
    assert format_value(3.14159) == "3.1416" and format_value(31.94) == "31.9"
    assert json.loads(json.dumps(_finite({"ppl": float("inf"), "x": [float("nan"), 1.0]}))) == \
        {"ppl": "inf", "x": ["nan", 1.0]}
    # the CLI's --json and every other JSON output go through the one writer
    from edgeprune_runtime.files import json_ready
    assert _finite is json_ready
    assert _finite({"kl": np.float32(0.25), "n": np.int64(3)}) == {"kl": 0.25, "n": 3}


def test_devices_lists_the_sources_and_leank_takes_the_options_its_errors_name(model_dir, tmp_path, capsys):
    """`edgeprune devices` prints each profile's source (only --json had it); `edgeprune
    leank` has the --min-per-head / --alignment its errors suggest (they did not exist)."""
    code, out, err = run_cli(["devices"], capsys)
    assert code == 0, err
    assert "sources of the figures:" in out and "raspberry-pi-5: Raspberry Pi 5 product brief" in out
    argv = ["leank", model_dir, "--k-keep", "0.3", "--nsamples", "2", "--seqlen", "64", "--sink", "4",
            "--window", "8", "--out", tmp_path / "m.json"]
    code, _, err = run_cli(argv, capsys)
    one_line_error(code, err, "--min-per-head 0")
    code, out, err = run_cli(argv + ["--min-per-head", "0", "--alignment", "4"], capsys)
    assert code == 0, err
    mask = json.loads((tmp_path / "m.json").read_text())
    assert mask["alignment"] == 4 and all(len(h) % 4 == 0 for layer in mask["keep"] for h in layer)


def test_run_with_a_too_short_eval_text_fails_before_calibrating(model_dir, tmp_path, capsys, monkeypatch):
    """The evaluation text is checked right after the model loads, with run's own flags in
    the fix (it failed at stage 3 of 6, after compressing, naming eval's --nwindows)."""
    import edgeprune.calibration as cal

    def boom(*a, **k):
        raise AssertionError("calibrated before checking the evaluation text")

    monkeypatch.setattr(cal, "build_calibration", boom)
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    code, _, err = run_cli(["run", "--model", model_dir, "--method", "rtn", "--group-size", "32", *CAL,
                            "--eval-text", short, "--eval-seqlen", "32", "--out", tmp_path / "r"], capsys)
    one_line_error(code, err, "0 windows of 32", "--eval-nwindows / --eval-seqlen")
    assert not (tmp_path / "r").exists()


def test_compress_into_a_folder_another_compress_writes_is_refused_at_once(model_dir, tmp_path, capsys,
                                                                           monkeypatch):
    """`for b in 4 8; do edgeprune compress ... --out racek & done; wait`: both exited 0
    and one result was lost. The second is refused before loading the model, naming the
    first's pid; the first's folder is untouched."""
    from _claims import claim_held_elsewhere

    import edgeprune.models as models

    def boom(*a, **k):
        raise AssertionError("loaded the model while another process writes --out")

    monkeypatch.setattr(models, "load_model", boom)
    with claim_held_elsewhere(tmp_path / "racek") as pid:
        code, _, err = run_cli(["compress", model_dir, "--method", "rtn", "--bits", "8", *CAL,
                                "--out", tmp_path / "racek"], capsys)
        one_line_error(code, err, f"--out {tmp_path / 'racek'} is being written by another "
                                  f"edgeprune process (pid {pid})")
    assert os.listdir(tmp_path) == []
