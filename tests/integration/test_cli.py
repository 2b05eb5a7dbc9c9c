"""The CLI on the real model: the pinned dense perplexity and one-line errors on bad input."""

from __future__ import annotations

import json

import pytest

from _cli import one_line_error, run_cli

pytestmark = pytest.mark.integration


def test_dense_wikitext2_perplexity_pinned(capsys, tmp_path, wikitext_path):
    """SmolLM2-135M dense, WikiText-2 test, no BOS, 40 x 512: 28.74 (PEERS.md), within 1%."""
    out = tmp_path / "eval.json"
    code, stdout, _ = run_cli(["eval", "smollm2-135m", "--text", str(wikitext_path), "--json", str(out)], capsys)
    assert code == 0
    rec = json.loads(out.read_text())
    assert rec["ppl"] == pytest.approx(28.74, rel=0.01)
    assert rec["protocol"]["seqlen"] == 512 and rec["protocol"]["nwindows"] == 40
    assert rec["protocol"]["text_sha256"] == "bbf94c53a05abe9ee670d3b6343608095822c85e26de37c70b24fc571964574a"
    assert "perplexity" in stdout


def test_missing_and_corrupt_model_file(capsys, tmp_path):
    code, _, err = run_cli(["eval", str(tmp_path / "nope.gguf")], capsys)
    one_line_error(code, err, "does not exist")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    code, _, err = run_cli(["eval", str(bad)], capsys)
    one_line_error(code, err, "not a readable GGUF")


def test_unsupported_architecture(capsys, tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    code, _, err = run_cli(["compress", str(d), "--method", "rtn", "--out", str(tmp_path / "o")], capsys)
    one_line_error(code, err, "bert", "llama, qwen2")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("sparsity", ["1.0", "-0.1", "1.5"])
def test_sparsity_out_of_range(capsys, tmp_path, sparsity):
    code, _, err = run_cli(["compress", "smollm2-135m", "--method", "magnitude", "--sparsity", sparsity,
                         "--out", str(tmp_path / "o")], capsys)
    one_line_error(code, err, "sparsity")
    assert not (tmp_path / "o").exists()


def test_group_size_not_dividing(capsys, tmp_path):
    code, _, err = run_cli(["compress", "smollm2-135m", "--method", "rtn", "--bits", "4", "--group-size", "128",
                         "--nsamples", "2", "--seqlen", "64", "--out", str(tmp_path / "o")], capsys)
    one_line_error(code, err, "group_size", "576")
    assert not (tmp_path / "o").exists()


def test_calibration_text_too_short(capsys, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Only a few words of calibration text.")
    code, _, err = run_cli(["compress", "smollm2-135m", "--method", "gptq", "--calib", str(short),
                         "--nsamples", "4", "--seqlen", "128", "--out", str(tmp_path / "o")], capsys)
    one_line_error(code, err, "tokens", "need")
    assert not (tmp_path / "o").exists()


def test_output_folder_holding_another_run_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"fingerprint": "someone-else"}))
    code, _, err = run_cli(["run", "--out", str(out)], capsys)
    one_line_error(code, err, "different run", "--overwrite")
    # beside files no run wrote, even --overwrite is refused (they would be deleted)
    (out / "keep.txt").write_text("precious")
    code, _, err = run_cli(["run", "--out", str(out), "--overwrite"], capsys)
    one_line_error(code, err, "not part of an edgeprune run", "keep.txt")
    assert (out / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temp folder left behind
