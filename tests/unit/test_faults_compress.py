"""Nothing silent in ``compress`` (issue 27, items 5, 6 and 8): AWQ scales a half-precision
model as it scales a float32 one; a fallback that changes a layer's method is printed; a
compressed model whose values stop being finite fails the run naming the layer; the
group-size hint names a value that works for every targeted layer; calibration says how
many tokens it used and what it left out."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

from _cli import one_line_error, run_cli
from edgeprune.engine import FallbackWarning, compress
from edgeprune.errors import CompressionError, ConfigError
from edgeprune.methods.awq import AWQConfig
from edgeprune.methods.rtn import RTNConfig

CAL = ["--calib", "default", "--nsamples", "2", "--seqlen", "32"]


def _ids(n=4, seqlen=32):
    return torch.randint(0, 255, (n, seqlen), generator=torch.Generator().manual_seed(0))


def _save(model, folder: Path) -> Path:
    from tiny import byte_tokenizer

    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_scales_a_half_precision_model_as_a_float32_one(tiny_llama, dtype):
    """The norm-fold check ran in the model's dtype with rtol=1e-4 and refused every norm
    in fp16/bf16 (AWQ then skipped its scaling on 150 of SmolLM2's 210 linears, saying so
    only in result.fallbacks): it now runs on a float32 copy."""
    half = copy.deepcopy(tiny_llama).to(dtype)
    norms = {n: m.weight.detach().float().clone() for n, m in tiny_llama.named_modules()
             if n.endswith("layernorm")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)     # no fallback at all
        r32 = compress(tiny_llama, AWQConfig(bits=4, group_size=32), _ids(), progress=False)
        r16 = compress(half, AWQConfig(bits=4, group_size=32), _ids(), progress=False)
    assert r32.fallbacks == r16.fallbacks == [] and len(r16.quantized) == 14
    for n, w in norms.items():                               # every norm absorbed a scale
        a, b = tiny_llama.get_submodule(n).weight.float(), half.get_submodule(n).weight.float()
        assert not torch.equal(a, w) and not torch.equal(b, w.to(dtype).float()), n
    assert r16.summary()["method_fallbacks"] == []


def test_method_fallbacks_are_warned_and_printed(tiny_llama, model_dir, tmp_path, capsys):
    """A fallback that changes the method applied to a layer is one warning line (the
    CLI prints warnings as ``warning: ...``) and a ``fallbacks:`` line of ``compress``;
    notes that change nothing (excluded tokens, extra damping) are not counted."""
    with pytest.warns(FallbackWarning, match=r"4 of 12 compressed layers fell back to another "
                                             r"method: 4 x AWQ scaling skipped .* -> clip \+ RTN only "
                                             r"\(e\.g\. model\.layers\.0\.self_attn\.q_proj\)"):
        res = compress(tiny_llama, AWQConfig(bits=4, group_size=32, ignore=["lm_head", "k_proj"]),
                       _ids(), progress=False)
    assert len(res.method_fallbacks()) == 4 and res.summary()["method_fallbacks"] == res.method_fallbacks()
    from edgeprune.engine import CompressionResult
    info = CompressionResult(fallbacks=["a.q_proj, a.k_proj: Hessian not positive definite -> damp x10",
                                        "a.v_proj: 3 calibration tokens with NaN/inf activations "
                                        "excluded from the statistics"])
    assert info.method_fallbacks() == [] and info.fallback_summary() is None
    recipe = tmp_path / "awq.yaml"
    recipe.write_text("stages:\n  - method: awq\n    bits: 4\n    group_size: 32\n"
                      "    ignore: [lm_head, k_proj]\n")
    code, out, err = run_cli(["compress", model_dir, "--recipe", recipe, *CAL, "--out", tmp_path / "ck"],
                             capsys)
    assert code == 0, err
    assert "fallbacks: 4 of 12 compressed layers fell back to another method: 4 x AWQ scaling " \
           "skipped" in out.replace("\n", "")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    from tiny import tiny_model

    return _save(tiny_model(LlamaConfig), tmp_path_factory.mktemp("faults") / "tiny")


def test_values_that_stop_being_finite_fail_the_run_naming_the_layer(tiny_llama, tmp_path, capsys):
    """An fp16 model whose activations overflow compressed "successfully" to NaN logits."""
    half = copy.deepcopy(tiny_llama).half()
    with torch.no_grad():
        half.model.layers[1].mlp.down_proj.weight.mul_(1e5)          # 65504 is fp16's max
    for recipe, errors in ((RTNConfig(bits=4, group_size=32), True),
                           (AWQConfig(bits=4, group_size=32), True)):
        m = copy.deepcopy(half)
        with pytest.raises(CompressionError, match=r"after compression the model's activations stop "
                                                   r"being finite at model\.layers\.1\.mlp\.down_proj "
                                                   r"\(4 of 4 calibration windows\); float16 overflows") as e:
            compress(m, recipe, _ids(), progress=False, measure_errors=errors)
        assert "float32" in e.value.hint and "ignore = ['down_proj']" in e.value.hint
    m = copy.deepcopy(half)
    compress(m, RTNConfig(bits=4, group_size=32), _ids(), progress=False, check_finite=False)
    # a window already non-finite at the input (a NaN embedding) is not held against a block
    nan = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        nan.model.embed_tokens.weight[7] = float("nan")
    ids = _ids()
    ids[1, 5] = 7
    compress(nan, RTNConfig(bits=4, group_size=32), ids, progress=False)
    # the CLI (float32): one line, exit 2, nothing written
    huge = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        huge.model.layers[0].post_attention_layernorm.weight.fill_(1e30)   # gate x up: 1e61
    folder = _save(huge, tmp_path / "huge")
    code, _, err = run_cli(["compress", folder, "--method", "rtn", "--bits", "8", "--group-size", "32",
                            *CAL, "--out", tmp_path / "ck"], capsys)
    assert code == 2
    one_line_error(code, err, "stop being finite at model.layers.0.mlp")
    assert not (tmp_path / "ck").exists()


def test_group_size_hint_names_a_value_every_targeted_layer_takes(tmp_path, capsys):
    """On a model with 172-wide down_proj inputs, ``--group-size 128`` suggested 32 or 64,
    which then failed on that layer too."""
    from transformers import LlamaConfig

    from edgeprune.engine import check_recipe
    from tiny import tiny_model

    m = tiny_model(LlamaConfig, hidden_size=128, intermediate_size=172)
    with pytest.raises(ConfigError) as e:
        check_recipe(m, RTNConfig(group_size=128))
    assert "group_size=128 does not divide the input size 172 of model.layers.0.mlp.down_proj " \
           "(and of 1 other targeted layer)" in str(e.value)
    assert "leave it out (ignore = ['down_proj'] in a recipe file) and use group_size 32 or 64 " \
           "or 128 for the other layers" in e.value.hint
    check_recipe(m, RTNConfig(group_size=128, ignore=["lm_head", "down_proj"]))   # the hint works
    small = tiny_model(LlamaConfig)                                             # inputs 64 and 160
    with pytest.raises(ConfigError) as e:
        check_recipe(small, RTNConfig(group_size=64))
    assert e.value.hint.startswith("use group_size 32 or -1 (-1 = one group per row)")
    for gs in (32, -1):
        check_recipe(small, RTNConfig(group_size=gs))
    folder = _save(m, tmp_path / "m172")
    code, _, err = run_cli(["compress", folder, "--method", "rtn", "--group-size", "128", *CAL,
                            "--out", tmp_path / "ck"], capsys)
    one_line_error(code, err, "172", "ignore = ['down_proj']")


def test_calibration_says_what_it_used(model_dir, tmp_path, capsys):
    """Two short documents: the stream's tail, shorter than one window, is left out, and
    now the CLI says so and prints the token count."""
    from edgeprune.calibration import build_calibration, describe
    from tiny import CharTokenizer

    docs = tmp_path / "two.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in ("a" * 200, "b" * 246)))
    cal = build_calibration(CharTokenizer(), docs, nsamples=3, seqlen=128)
    total = 200 + 2 + 246                                # the blank line joins the documents
    assert cal.info["tokens_read"] == total and cal.info["tokens_used"] == 384
    assert cal.info["tail_tokens_unused"] == total - 3 * 128
    assert describe(cal.info) == (f"calibration: 3 windows x 128 tokens = 384 tokens from {docs} "
                                  f"(the last {total - 384} tokens read, less than one window, unused)")
    code, out, err = run_cli(["compress", model_dir, "--method", "rtn", "--group-size", "32",
                              "--calib", docs, "--nsamples", "2", "--seqlen", "128",
                              "--out", tmp_path / "ck"], capsys)
    assert code == 0, err
    assert "calibration: 2 windows x 128 tokens = 256 tokens from" in out
    assert "1 of 3 windows not drawn" in out and f"the last {total - 384} tokens read" in out
