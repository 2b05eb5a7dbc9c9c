"""The method registry: a method registered from this file alone (nothing else edited) is
found by name, parsed from a recipe, run by ``edgeprune.compress``, refused when
mis-configured, and offered by the CLI; the engine's ordering rule reads the methods'
attributes, not their names."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import edgeprune
from edgeprune.errors import ConfigError
from edgeprune.methods import (LayerResult, LayerTask, Method, PruneOptions, QuantOptions, config_class,
                               get_method, method_names, register_method, unregister_method)
from edgeprune.recipe import (AWQConfig, GPTQConfig, Recipe, RTNConfig, SparseGPTConfig, WandaConfig,
                              method_config_from_name)

ROOT = Path(__file__).resolve().parents[2]
BUILTIN = ["magnitude", "wanda", "sparsegpt", "fista", "rtn", "gptq", "awq", "signround", "e2e-qp"]
#: the CLI's --method choices: the methods that run alone (e2e-qp follows a quantizer)
CLI_BUILTIN = [n for n in BUILTIN if n != "e2e-qp"]


def _ids(n=4, s=24, seed=3):
    return torch.randint(0, 256, (n, s), generator=torch.Generator().manual_seed(seed))


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}


@pytest.fixture
def row_prune():
    """A trivial pruner, registered for one test: zero the ``round(sparsity * in)``
    smallest ``|W|`` of output row ``row`` of every target layer."""

    @dataclass
    class RowPruneConfig(PruneOptions):
        """Zero the smallest ``|W_row,j|`` of one output row."""

        row: int = 0
        method = "row_prune"

        def validate(self) -> None:
            super().validate()
            if self.row < 0:
                raise ConfigError(f"row={self.row} must be >= 0", "use a row index, e.g. row: 0")

    @register_method(RowPruneConfig)
    class RowPrune(Method):
        data_free = True

        def check_layer(self, name, out_features, in_features):
            super().check_layer(name, out_features, in_features)
            if self.config.row >= out_features:
                raise ConfigError(f"{name}: row={self.config.row} but the layer has {out_features} rows",
                                  "use a smaller row")

        def compress_layer(self, task: LayerTask) -> LayerResult:
            w = task.weight
            keep = torch.ones_like(w, dtype=torch.bool)
            k = int(round(self.config.sparsity * w.shape[1]))
            keep[self.config.row, torch.argsort(w[self.config.row].abs(), stable=True)[:k]] = False
            return LayerResult(weight=w * keep, mask=keep, pattern="unstructured")

    yield RowPruneConfig
    unregister_method("row_prune")


@pytest.fixture
def noop_quant():
    """A quantizer that leaves the weights as they are (for the ordering rule), and asks
    for the block's calibration inputs (as a block-reconstruction method would)."""

    @dataclass
    class NoopQuantConfig(QuantOptions):
        method = "noop_quant"

    @register_method(NoopQuantConfig)
    class NoopQuant(Method):
        needs_block_inputs = True
        seen: list = []

        def compress_block(self, block, tasks, inputs):
            with torch.no_grad():   # what a reconstruction loss would compare against
                out = [block(b[0], **b[1]) for b in inputs]
            out = [o[0] if isinstance(o, (tuple, list)) else o for o in out]
            self.seen.append(([b[0].shape for b in inputs], [o.shape for o in out]))
            return {t.name: LayerResult(weight=t.weight.clone()) for t in tasks}

    yield NoopQuantConfig
    unregister_method("noop_quant")


def test_registered_method_is_found_by_name(row_prune):
    assert method_names() == BUILTIN + ["row_prune"]
    assert config_class("row_prune") is row_prune and config_class("Row-Prune") is row_prune
    assert type(get_method(row_prune(row=1))).__name__ == "RowPrune"
    assert get_method(row_prune()).name == "row_prune" and get_method(row_prune()).is_pruner
    assert edgeprune.RowPruneConfig is row_prune                 # edgeprune.<Name>Config
    from edgeprune import recipe
    assert recipe.RowPruneConfig is row_prune and "RowPruneConfig" in edgeprune.__all__


def test_registered_method_parses_from_a_recipe(row_prune, tmp_path):
    r = Recipe.from_dict({"stages": [{"method": "row_prune", "row": 2, "sparsity": 0.25},
                                     {"method": "rtn", "group_size": 32}]})
    assert isinstance(r.stages[0], row_prune) and r.stages[0].row == 2 and r.stages[0].sparsity == 0.25
    f = tmp_path / "r.yaml"
    f.write_text("stages:\n  - method: row_prune\n    row: 1\n    targets: [q_proj]\n")
    r2 = Recipe.from_file(f)
    assert r2.stages[0] == row_prune(row=1, targets=["q_proj"]) and r2.name == "r"
    assert Recipe.from_dict(r.to_dict()).to_dict() == r.to_dict()
    assert method_config_from_name("row_prune", row=3, sparsity=None).row == 3


def test_registered_method_runs_through_compress(row_prune, tiny_llama):
    dense = {n: m.weight.detach().clone() for n, m in _linears(tiny_llama).items()}
    res = edgeprune.compress(tiny_llama, row_prune(row=1, sparsity=0.25), _ids(), progress=False)
    assert set(res.masks) == set(dense) and set(res.sparsity_pattern.values()) == {"unstructured"}
    for n, m in _linears(tiny_llama).items():
        w, w0 = m.weight.detach(), dense[n]
        k = round(0.25 * w0.shape[1])
        assert torch.equal(w[0], w0[0]) and torch.equal(w[2:], w0[2:]), n   # other rows untouched
        smallest = torch.argsort(w0[1].abs(), stable=True)[:k]
        assert int((w[1] == 0).sum()) == k and bool((w[1, smallest] == 0).all()), n
    assert res.recipe["stages"][0]["method"] == "row_prune" and res.recipe["stages"][0]["row"] == 1
    json.dumps(res.summary())


@pytest.mark.parametrize("stage,msg", [
    ({"row": -1}, r"row=-1 must be >= 0 \(fix: use a row index"),
    ({"rows": 1}, r"method 'row_prune' has no setting rows \(fix: its settings are .*row, sparsity"),
    ({"row": "1"}, r"row_prune setting row='1' must be an integer"),
    ({"sparsity": 1.5}, r"sparsity=1.5 is outside \[0, 1\)"),
])
def test_misconfigured_registered_method_is_refused(row_prune, stage, msg):
    with pytest.raises(ConfigError, match=msg):
        Recipe.from_dict({"stages": [{"method": "row_prune", **stage}]})


def test_registered_method_layer_check_runs_before_any_change(row_prune, tiny_llama):
    before = {n: m.weight.clone() for n, m in _linears(tiny_llama).items()}
    with pytest.raises(ConfigError, match=r"k_proj: row=40 but the layer has 32 rows"):
        edgeprune.compress(tiny_llama, row_prune(row=40), _ids(), progress=False)
    assert all(torch.equal(m.weight, before[n]) for n, m in _linears(tiny_llama).items())


def test_unknown_name_lists_the_registered_methods(row_prune):
    with pytest.raises(ConfigError, match=r"unknown compression method 'row_prun' \(fix: use one of "
                                          r"awq, e2e-qp, fista, gptq, magnitude, row_prune, rtn, signround, sparsegpt, wanda\)"):
        Recipe.from_dict({"stages": [{"method": "row_prun"}]})
    with pytest.raises(ConfigError, match="is taken by RowPruneConfig"):
        register_method(row_prune)


def test_registry_names_are_the_cli_method_choices(row_prune):
    from edgeprune.cli import METHODS
    from edgeprune.cli._app import cli

    for verb in ("compress", "run"):
        opt = next(p for p in cli.commands[verb].params if p.name == "method")
        assert list(opt.type.choices) == list(METHODS) == CLI_BUILTIN + ["row_prune"]
    unregister_method("row_prune")
    assert list(opt.type.choices) == CLI_BUILTIN and method_names() == BUILTIN


def test_cli_compresses_with_a_registered_method(row_prune, tmp_path, capsys):
    from transformers import LlamaConfig

    from _cli import run_cli
    from tiny import byte_tokenizer, tiny_model

    tiny_model(LlamaConfig).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    code, _, err = run_cli(["compress", tmp_path / "m", "--method", "row_prune", "--sparsity", "0.5",
                            "--calib", "default", "--nsamples", "2", "--seqlen", "32",
                            "--out", tmp_path / "ck"], capsys)
    assert code == 0, err
    rec = json.loads((tmp_path / "ck" / "edgeprune_checkpoint.json").read_text())
    assert rec["method"] == "row_prune" and rec["recipe"]["stages"][0]["sparsity"] == 0.5


def test_cli_start_does_not_import_torch():
    """The --method choices come from the registry only when click needs them."""
    code = ("import sys, edgeprune.cli, edgeprune\n"
            "assert 'torch' not in sys.modules, 'torch imported at CLI start'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr


# ----------------------------------------------------------------------------- ordering rule

QUANTIZED_TWICE = (r"model.layers.0.self_attn.q_proj: stage 2 \({}\) quantizes a layer an earlier stage "
                   r"already quantized \(fix: quantize each layer once \(only awq may precede another "
                   r"quantizer\), or narrow the stages' targets\)")
PRUNED_AFTER = (r"model.layers.0.self_attn.q_proj: stage 2 \(wanda\) prunes a layer an earlier stage already "
                r"quantized \(fix: put pruning stages before quantization stages in the recipe\)")


def test_ordering_rule_reads_method_attributes(tiny_llama):
    from edgeprune.engine import check_recipe

    g = dict(group_size=32)
    with pytest.raises(ConfigError, match=QUANTIZED_TWICE.format("gptq")):
        check_recipe(tiny_llama, [RTNConfig(**g), GPTQConfig(**g)])
    with pytest.raises(ConfigError, match=QUANTIZED_TWICE.format("awq")):
        check_recipe(tiny_llama, [GPTQConfig(**g), AWQConfig(**g)])
    with pytest.raises(ConfigError, match=QUANTIZED_TWICE.format("gptq")):   # SparseGPT + bits quantizes
        check_recipe(tiny_llama, [SparseGPTConfig(bits=4, **g), GPTQConfig(**g)])
    with pytest.raises(ConfigError, match=PRUNED_AFTER):
        check_recipe(tiny_llama, [RTNConfig(**g), WandaConfig()])
    # AWQ's scaling may precede another quantizer (itself included); SparseGPT without bits prunes only
    for ok in ([AWQConfig(**g), GPTQConfig(**g)], [AWQConfig(**g), AWQConfig(**g)],
               [SparseGPTConfig(), GPTQConfig(**g)], [WandaConfig(), RTNConfig(**g)]):
        check_recipe(tiny_llama, ok)


def test_ordering_rule_for_a_registered_quantizer(noop_quant, tiny_llama, monkeypatch):
    from edgeprune.engine import check_recipe

    with pytest.raises(ConfigError, match=QUANTIZED_TWICE.format("gptq")):
        check_recipe(tiny_llama, [noop_quant(group_size=32), GPTQConfig(group_size=32)])
    monkeypatch.setattr(noop_quant, "may_precede_quantizer", True)
    check_recipe(tiny_llama, [noop_quant(group_size=32), GPTQConfig(group_size=32)])
    with pytest.raises(ConfigError, match=r"only awq or noop_quant may precede another quantizer"):
        check_recipe(tiny_llama, [RTNConfig(group_size=32), GPTQConfig(group_size=32)])


def test_block_inputs_reach_a_method_that_asks_for_them(noop_quant, tiny_llama):
    before = {n: m.weight.clone() for n, m in _linears(tiny_llama).items()}
    edgeprune.compress(tiny_llama, noop_quant(group_size=32), _ids(n=5, s=24), progress=False, batch_size=2)
    seen = noop_quant.method_class.seen
    assert len(seen) == 2                                          # one call per block
    for shapes_in, shapes_out in seen:
        assert shapes_in == shapes_out == [torch.Size([2, 24, 64]), torch.Size([2, 24, 64]), torch.Size([1, 24, 64])]
    assert all(torch.equal(m.weight, before[n]) for n, m in _linears(tiny_llama).items())
