"""The decode path of an export (token by token through the KV cache) beside its one pass,
and the run report's quality rows (issue 29)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeprune.evaluation.decode_path import (DecodePathModel, compare_paths, decode_path_logits,
                                              export_fidelity, path_agreement)
from edgeprune.evaluation.fidelity import fidelity
from tiny import CORPUS as _CORPUS, export_tiny_llama

CORPUS = " ".join(_CORPUS)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    import edgeprune_runtime as runtime

    folder, model, tok = export_tiny_llama(tmp_path_factory.mktemp("dp") / "fp32", max_length=128)
    with runtime.load(folder, threads=1) as sess:
        yield sess, model, tok


def test_decode_path_matches_the_torch_model_and_the_one_pass(tiny_export):
    """fp32: every decode step equals the one-pass logits and the torch model's (~1e-5)."""
    sess, model, tok = tiny_export
    ids = tok(CORPUS, add_special_tokens=False)["input_ids"][:40]
    dec = decode_path_logits(sess, ids)
    assert dec.shape == (40, sess.vocab_size)
    ref = model(torch.tensor([ids])).logits[0].detach().numpy()
    np.testing.assert_allclose(dec, ref, atol=1e-4)
    np.testing.assert_allclose(dec, sess.logits(np.array([ids]))[0], atol=1e-4)
    # the session still generates afterwards (no KV rows left behind)
    assert len(sess.generate(ids[:5], max_new_tokens=3).token_ids[0]) == 3
    r = path_agreement(sess, np.array([ids[:20], ids[20:]]))
    assert r.argmax_agree == 1.0 and r.max_abs_dlogit < 1e-4 and r.ntokens == 40 and r.kl < 1e-6


def test_decode_path_refuses_more_tokens_than_the_context(tiny_export):
    from edgeprune_runtime.errors import GenerationError

    sess = tiny_export[0]
    with pytest.raises(GenerationError, match="do not fit"):
        decode_path_logits(sess, np.zeros(sess.max_length + 1, np.int64))


def test_compare_paths_measures_what_it_says():
    a = np.zeros((3, 4), np.float32)
    b = a.copy()
    b[1, 2] = 2.0                  # one position changes its argmax, by a 2-logit step
    r = compare_paths(a, b)
    assert r.argmax_agree == pytest.approx(2 / 3) and r.max_abs_dlogit == 2.0
    assert r.mean_abs_dlogit == pytest.approx(2 / 12) and r.kl > 0 and r.ntokens == 3


def test_export_fidelity_scores_both_paths_against_the_dense_model(tiny_export):
    sess, model, tok = tiny_export
    text = CORPUS * 4
    xf = export_fidelity(model, sess, tok, text, seqlen=32, nwindows=3, decode_windows=2, progress=False)
    ref = fidelity(model, model, tok, text, seqlen=32, nwindows=3, progress=False, snr=False)
    assert xf.one_pass.protocol.nwindows == 3 and xf.decode.protocol.nwindows == 2
    assert xf.decode.protocol.ntokens_scored == 2 * 31 and xf.paths.ntokens == 2 * 32
    assert xf.one_pass.ppl == pytest.approx(ref.ppl, rel=1e-4)
    assert xf.one_pass.ppl_dense == pytest.approx(ref.ppl_dense, rel=1e-6)
    assert xf.one_pass.top1_agree == 1.0 and xf.decode.top1_agree == 1.0
    assert xf.one_pass.kl < 1e-6 and xf.decode.kl < 1e-6 and xf.paths.argmax_agree == 1.0
    # the decode path as a logits function: the existing fidelity code scores it unchanged
    dm = DecodePathModel(sess)
    r = fidelity(model, dm, tok, text, seqlen=32, nwindows=2, progress=False, snr=False)
    assert r.ppl == pytest.approx(xf.decode.ppl, rel=1e-5)
    assert set(xf.to_dict()) == {"one_pass", "decode", "paths"}


def test_export_fidelity_refuses_no_decode_window(tiny_export):
    from edgeprune.errors import ConfigError

    sess, model, tok = tiny_export
    with pytest.raises(ConfigError, match="decode_windows"):
        export_fidelity(model, sess, tok, CORPUS * 4, seqlen=32, nwindows=1, decode_windows=0)


def test_report_rows_label_the_export_and_the_pytorch_figures(tiny_export):
    from edgeprune.pipeline import (COMPRESSED_COLUMN, PYTORCH_COLUMN, RunReport, next_commands,
                                    quality_rows)

    sess, model, tok = tiny_export
    text = CORPUS * 4
    xf = export_fidelity(model, sess, tok, text, seqlen=32, nwindows=2, decode_windows=1, progress=False)
    tf = fidelity(model, model, tok, text, seqlen=32, nwindows=2, progress=False, snr=False)
    rows = quality_rows(xf, tf)
    assert rows["perplexity (one pass)"]["compressed"] == xf.one_pass.ppl
    assert rows["perplexity (one pass)"]["pytorch"] == tf.ppl
    assert rows["perplexity (decode path)"]["compressed"] == xf.decode.ppl
    assert rows["perplexity (decode path)"]["dense"] == xf.decode.ppl_dense
    assert rows["perplexity (decode path)"]["pytorch"] is None
    assert rows["one pass vs decode path: argmax agreement"]["compressed"] == 1.0
    rep = RunReport(out_dir="x", config={"model": "m", "prompt_len": 1, "gen_len": 2, "threads": 1,
                                         "repeat": 1, "decode_windows": 1},
                    fingerprint="f", rows=rows, protocol=tf.protocol.to_dict())
    md = rep.to_markdown()
    assert COMPRESSED_COLUMN in md and PYTORCH_COLUMN in md and "decode path" in md
    assert "the first 1 window(s) fed token by token" in md
    assert next_commands("runs/demo/onnx-compressed") == [
        "edgeprune chat runs/demo/onnx-compressed", "edgeprune serve runs/demo/onnx-compressed",
        "edgeprune profile runs/demo/onnx-compressed"]


def test_run_cli_labels_the_export_and_prints_the_next_commands(tmp_path, capsys):
    """`edgeprune run` end to end on a tiny model: the table's columns say where each figure
    comes from, the decode-path rows are there, and the next three commands are printed."""
    import json

    from _cli import run_cli
    from tiny import tiny_model, byte_tokenizer
    from transformers import LlamaConfig

    d = tmp_path / "tiny"
    tiny_model(LlamaConfig).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    out = tmp_path / "run"
    code, so, err = run_cli(["run", "--model", d, "--method", "rtn", "--group-size", "32", "--calib", "default",
                             "--nsamples", "2",
                             "--seqlen", "32", "--eval-seqlen", "32", "--eval-nwindows", "2",
                             "--decode-windows", "1", "--accuracy-level-for", "down_proj=0",
                             "--threads", "1", "--prompt-len", "8", "--gen-len", "4", "--repeat", "1",
                             "--out", out], capsys)
    assert code == 0, err
    flat = " ".join(so.split())
    assert "ONNX export" in flat and "PyTorch fake-quant" in flat and "decode path" in flat
    for verb in ("chat", "serve", "profile"):
        assert f"edgeprune {verb} {out / 'onnx-compressed'}" in so
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert rows["perplexity (one pass)"]["pytorch"] > 0 and rows["perplexity (decode path)"]["compressed"] > 0
    meta = json.loads((out / "onnx-compressed" / "edgeprune.json").read_text())
    assert meta["quantization"]["accuracy_levels"] == {"down_proj": 0}
