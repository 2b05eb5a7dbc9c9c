"""Data-free compression (RTN, magnitude: no calibration windows, no forward pass unless
asked) and the ``--threads`` option every computing verb shares."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch

from _cli import one_line_error, run_cli

from edgeprune import calibration
from edgeprune.engine import compress, needs_calibration
from edgeprune.errors import CalibrationError
from edgeprune import GPTQConfig, MagnitudeConfig, RTNConfig
from edgeprune.methods.base import LayerResult, LayerTask, Method
from edgeprune.methods.config import QuantOptions
from edgeprune.methods.registry import register_method, unregister_method
from edgeprune.quantize import rtn_quantize
from test_cli_inputs import model_dir  # noqa: F401 - the tiny saved llama, a fixture


def _ids(n=4, s=16):
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(0))


def _no_forward(monkeypatch, model):
    """Make any forward pass of ``model``'s decoder fail the test."""
    def boom(*a, **k):
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(type(model.model), "forward", boom)


# ------------------------------------------------------------------ the engine

def test_needs_calibration_reads_the_registry_not_the_name():
    assert not needs_calibration(RTNConfig(bits=4, group_size=32))
    assert not needs_calibration([MagnitudeConfig(prune_n=2, prune_m=4), RTNConfig(group_size=32)])
    assert needs_calibration(GPTQConfig(bits=4))
    assert needs_calibration([MagnitudeConfig(sparsity=0.5), GPTQConfig(bits=4)])

    @dataclass
    class RoundConfig(QuantOptions):   # a data-free plugin, named like a data method
        method = "gptq_free"

    @register_method(RoundConfig)
    class Round(Method):
        data_free = True

        def compress_layer(self, task: LayerTask) -> LayerResult:
            q = rtn_quantize(task.weight, self.config.bits, self.config.group_size, self.config.sym)
            return LayerResult(weight=q.dequantize(), quantized=q)

    try:
        assert not needs_calibration(RoundConfig(group_size=32))
        Round.data_free = False
        assert needs_calibration(RoundConfig(group_size=32))
    finally:
        unregister_method("gptq_free")


def test_data_free_compress_without_ids_runs_no_forward(tiny_llama, monkeypatch):
    ref = copy.deepcopy(tiny_llama)
    _no_forward(monkeypatch, tiny_llama)
    recipe = [MagnitudeConfig(prune_n=2, prune_m=4), RTNConfig(group_size=32)]
    res = compress(tiny_llama, recipe, progress=False)
    assert len(res.quantized) == 14 and not res.layer_errors and res.calibration == {}
    monkeypatch.undo()
    compress(ref, recipe, _ids(), progress=False)           # with data: the same weights
    for (n, a), (_, b) in zip(tiny_llama.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n


def test_compress_without_ids_refuses_what_needs_data(tiny_llama):
    before = {n: p.clone() for n, p in tiny_llama.named_parameters()}
    with pytest.raises(CalibrationError, match="gptq needs calibration data"):
        compress(tiny_llama, [MagnitudeConfig(sparsity=0.5), GPTQConfig(bits=4, group_size=32)],
                 progress=False)
    with pytest.raises(CalibrationError, match="measure_errors=True"):
        compress(tiny_llama, RTNConfig(group_size=32), measure_errors=True, progress=False)
    assert all(torch.equal(p, before[n]) for n, p in tiny_llama.named_parameters())


# ------------------------------------------------------------------ the CLI

def test_cli_rtn_and_magnitude_build_no_calibration(model_dir, tmp_path, monkeypatch, capsys):
    from transformers.models.llama import modeling_llama

    def no_calibration(*a, **k):
        raise AssertionError("calibration windows were built")

    def no_forward(*a, **k):
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(calibration, "build_calibration", no_calibration)
    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", no_forward)
    for argv in (["--method", "rtn", "--bits", "4", "--group-size", "32"],
                 ["--method", "magnitude", "--pattern", "2:4"]):
        out = tmp_path / argv[1]
        code, stdout, err = run_cli(["compress", model_dir, *argv, "--out", out, "--threads", "2",
                                     "--json", tmp_path / f"{argv[1]}.json"], capsys)
        assert code == 0, err
        assert "data-free, no calibration data" in stdout
        assert "embedding stored in float16" in stdout and "{'name'" not in stdout   # no raw dict
        assert ("with rtn (bits 4, group_size 32, asym, ignore lm_head)" in stdout) == (argv[1] == "rtn")
        rec = json.loads((out / "edgeprune_checkpoint.json").read_text())
        assert rec["calibration"] == {"source": None, "data_free": True}
        summ = json.loads((tmp_path / f"{argv[1]}.json").read_text())
        assert summ["layer_errors"] == {} and summ["calibration"] == {"source": None, "data_free": True}
        assert torch.get_num_threads() == 2      # --threads reached torch
        torch.set_num_threads(1)


def test_cli_measure_error_builds_calibration(model_dir, tmp_path, capsys):
    for extra in (["--measure-error", "--calib", "default", "--nsamples", "2", "--seqlen", "32"],
                  ["--nsamples", "2", "--seqlen", "32"]):
        js = tmp_path / "s.json"
        code, stdout, err = run_cli(["compress", model_dir, "--method", "rtn", "--group-size", "32", *extra,
                                     "--out", tmp_path / "ck", "--overwrite", "--json", js], capsys)
        assert code == 0, err
        assert "calibration: 2 windows x 32 tokens" in stdout
        summ = json.loads(js.read_text())
        assert len(summ["layer_errors"]) == 14 and summ["calibration"]["nsamples"] == 2


def test_cli_help_names_the_flags_that_bring_data(capsys):
    code, out, _ = run_cli(["compress", "--help"], capsys)
    assert code == 0 and "--measure-error" in out and "--threads" in out
    flat = " ".join(out.split())
    assert "unless this flag, --calib or --nsamples is given" in flat


#: every verb that computes takes --threads
COMPUTING_VERBS = ("compress", "eval", "export", "run", "study", "leank", "countdown", "generate", "chat",
                   "serve", "profile")


def test_every_computing_verb_takes_threads(tmp_path, capsys):
    from edgeprune.cli import cli

    for verb in COMPUTING_VERBS:
        opts = {o for p in cli.commands[verb].params for o in getattr(p, "opts", [])}
        assert "--threads" in opts, verb
    for verb, args in (("compress", ["m", "--method", "rtn", "--out", tmp_path / "c"]),
                       ("export", ["m", tmp_path / "e"]),
                       ("leank", ["m", "--k-keep", "0.5", "--out", tmp_path / "l.json"]),
                       ("countdown", ["m", "--act-sparsity", "0.5", "--out", tmp_path / "c.safetensors"]),
                       ("generate", [tmp_path, "hi"])):
        code, _, err = run_cli([verb, *args, "--threads", "0"], capsys)
        one_line_error(code, err, "--threads 0 must be >= 1", "--threads 2")
    assert not any(tmp_path.iterdir())
