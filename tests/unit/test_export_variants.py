"""Graph variants: spec files (save_spec / load_spec, files written before the registry),
the exporter's registry (names, composition, refusals) and the CLI path
``edgeprune leank|countdown ... --out FILE`` -> ``edgeprune export ... --variant FILE``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _cli import one_line_error, run_cli
from edgeprune import countdown as cd
from edgeprune.errors import CheckpointError, ConfigError, ExportError
from edgeprune.leank import LeanKMask, learn_mask
from edgeprune.variants import VARIANTS, load_spec, save_spec
from tiny import byte_tokenizer


def _calib(n=2, s=32):
    return torch.randint(0, 255, (n, s), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random llama + byte-level tokenizer saved as a Hugging Face folder."""
    from tiny import tiny_model
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("variants") / "tiny"
    tiny_model(LlamaConfig).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


# ------------------------------------------------------------------------ spec files
def test_spec_files_json_safetensors_and_the_files_written_before(tiny_llama, tmp_path):
    mk = learn_mask(tiny_llama, _calib(), 0.5, method="magnitude", alignment=4)
    mk.meta.update(train_sink=3, train_window=9)
    p = save_spec(mk, tmp_path / "m.json")
    d = json.loads(p.read_text())
    assert d["edgeprune_variant"] == "leank" and (d["sink"], d["window"]) == (3, 9)
    assert load_spec(p) == LeanKMask.from_dict(d)
    # a mask JSON written by LeanKMask.save before the registry: no name, no sink/window
    old = {k: v for k, v in d.items() if k not in ("edgeprune_variant", "sink", "window")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    back = load_spec(tmp_path / "old.json")
    assert back.keep == mk.keep and back.regime == (3, 9) and back.sink is None

    spec = cd.calibrate(tiny_llama, _calib(), 0.5, "d")
    ps = save_spec(spec, tmp_path / "cd.safetensors")
    assert ps.read_bytes()[8:9] == b"{" and b"pickle" not in ps.read_bytes()
    got = load_spec(ps)
    assert isinstance(got, cd.CountdownSpec) and got.to_dict() == spec.to_dict()
    assert all(torch.equal(got.predictors[1][k], v) for k, v in spec.predictors[1].items())
    with pytest.raises(ConfigError, match="holds arrays"):
        save_spec(spec, tmp_path / "cd.json")
    # a COUNTDOWN folder written by CountdownSpec.save before the registry
    from safetensors.torch import save_file
    folder = tmp_path / "old_cd"
    folder.mkdir()
    save_file({f"layers.{i}.{k}": v.contiguous() for i, p_ in enumerate(spec.predictors)
               for k, v in p_.items()}, str(folder / "countdown.safetensors"))
    (folder / "countdown.json").write_text(json.dumps(
        {k: v for k, v in spec.to_dict().items() if k != "graph_mode"}))
    for path in (folder, folder / "countdown.json", folder / "countdown.safetensors"):
        legacy = load_spec(path)
        assert legacy.thresholds == spec.thresholds and legacy.graph_mode == "if"
        assert torch.equal(legacy.predictors[0]["gate_codes"], spec.predictors[0]["gate_codes"])


def test_spec_file_errors(tmp_path):
    (tmp_path / "nosuch.json").write_text(json.dumps({"edgeprune_variant": "nosuch", "x": 1}))
    with pytest.raises(ConfigError, match="variant 'nosuch' is unknown.*countdown, igprune, kvcache, leank"):
        load_spec(tmp_path / "nosuch.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="not an edgeprune variant spec"):
        load_spec(tmp_path / "foreign.json")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_spec(tmp_path / "missing.safetensors")
    save_spec(cd.CountdownSpec("m", 0.0, [-1.0, -1.0]), tmp_path / "s0.json")
    with pytest.raises(CheckpointError, match="holds a COUNTDOWN spec, not a LeanK mask"):
        LeanKMask.load(tmp_path / "s0.json")
    assert {"leank", "countdown"} <= set(VARIANTS)


# ----------------------------------------------------------------- export registry
def test_export_registry_composes_in_order_and_refuses_bad_requests(tiny_llama, tmp_path):
    import edgeprune_exporters as exporters
    from edgeprune_exporters.families import LlamaBuilder
    from edgeprune_exporters.leank import LeanKMixin
    from edgeprune_exporters.sparse24 import Compact24Mixin
    from edgeprune_exporters.variants import compose_builder, variant_entries

    cls = compose_builder(LlamaBuilder, ["compact24", "leank"])
    mro = cls.__mro__           # the first variant listed sits next to the base class
    assert mro.index(LeanKMixin) < mro.index(Compact24Mixin) < mro.index(LlamaBuilder)
    assert compose_builder(LlamaBuilder, []) is LlamaBuilder
    mk = learn_mask(tiny_llama, _calib(), 0.5, method="magnitude", alignment=4)
    spec = cd.calibrate(tiny_llama, _calib(), 0.5, "m")
    assert variant_entries([("leank", {"keep": []})]) == [("leank", {"keep": []})]
    for bad, match in ((["nosuch"], "'nosuch' is unknown"), (["compact24", "compact24"], "twice"),
                       ([mk, spec], "each of which needs its own session"),
                       ([mk.to_dict()], "does not name its variant"), ([(spec, 1)], "options dict"),
                       ([3], "neither a name")):
        with pytest.raises(ExportError, match=match):
            exporters.export_onnx(tiny_llama, byte_tokenizer(), tmp_path / "x", variants=bad)
    with pytest.raises(ExportError, match="leank spec is not a LeanKMask dict"):
        exporters.export_onnx(tiny_llama, byte_tokenizer(), tmp_path / "x", variants=["leank"])
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- CLI
def test_cli_writes_specs_and_export_takes_them(model_dir, tmp_path, capsys):
    cal = ["--calib", "default", "--nsamples", "2", "--seqlen", "32"]
    code, _, err = run_cli(["countdown", model_dir, "--act-sparsity", "0.5", "--mode", "m",
                            "--graph-mode", "sparse", *cal, "--out", tmp_path / "cd.json"], capsys)
    one_line_error(code, err, "write it to a .safetensors file")
    code, out, err = run_cli(["countdown", model_dir, "--act-sparsity", "0.5", "--mode", "m",
                              "--graph-mode", "sparse", *cal, "--out", tmp_path / "cd.safetensors"],
                             capsys)
    assert code == 0, err
    assert load_spec(tmp_path / "cd.safetensors").graph_mode == "sparse"
    code, _, err = run_cli(["export", model_dir, tmp_path / "cd", "--variant", tmp_path / "cd.safetensors",
                            "--max-length", "64"], capsys)
    assert code == 0, err
    rec = json.loads((tmp_path / "cd" / "edgeprune.json").read_text())["variants"]["countdown"]
    assert rec["graph_mode"] == "sparse" and rec["mode"] == "m"

    code, _, err = run_cli(["leank", model_dir, "--k-keep", "0.5", "--method", "magnitude",
                            "--nsamples", "1", "--seqlen", "64", "--sink", "4", "--window", "8",
                            "--alignment", "4", "--out", tmp_path / "lk.json"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["export", model_dir, tmp_path / "lk", "--variant", tmp_path / "lk.json",
                            "--max-length", "64", "--graph", "plain"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "lk" / "edgeprune.json").read_text())
    assert (meta["variants"]["leank"]["sink"], meta["variants"]["leank"]["window"]) == (4, 8)
    code, _, err = run_cli(["export", model_dir, tmp_path / "both", "--variant", tmp_path / "lk.json",
                            "--variant", tmp_path / "cd.safetensors"], capsys)
    one_line_error(code, err, "leank, countdown", "export them separately")
    assert not (tmp_path / "both").exists()
