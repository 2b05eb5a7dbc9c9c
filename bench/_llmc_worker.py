"""Run one llm-compressor method on an HF folder and save the result as a plain dense folder.

Runs inside ``.venv-llmcompressor`` (created by ``bench/compare_methods.py``); it never
imports edgeprune. The calibration windows come from edgeprune (``--calib`` .npy of
``int64 [nsamples, seqlen]``) so both tools see exactly the same tokens. The saved model
holds the dense-equivalent weights (fake-quantized for quantization methods, masked for
pruning), so edgeprune's own evaluation code scores it.

Writes ``--result`` JSON: ``{"ok", "seconds" (oneshot wall time), "version", "error"}``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback


def build_recipe(method: str, group_size: int, sym: bool):
    from llmcompressor.modifiers.pruning import WandaPruningModifier
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    groups = {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group",
        "group_size": group_size}}}
    ign = ["lm_head"]
    # pruning modifiers name a target layer "<name>." (trailing dot), so a plain "lm_head"
    # does not match and the (tied!) head gets pruned; their own warning advises this regex.
    ign_prune = ["re:.*lm_head"]
    if method == "rtn":
        return [QuantizationModifier(config_groups=groups, ignore=ign)]
    if method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=ign, dampening_frac=0.01, block_size=128)]
    if method == "awq":
        from llmcompressor.modifiers.awq import AWQModifier
        return [AWQModifier(ignore=ign, n_grid=20, duo_scaling=True),
                QuantizationModifier(config_groups=groups, ignore=ign)]
    if method in ("sparsegpt", "sparsegpt24"):
        return [SparseGPTModifier(sparsity=0.5, mask_structure="2:4" if method.endswith("24") else "0:0",
                                  targets=["Linear"], ignore=ign_prune, dampening_frac=0.01, block_size=128)]
    if method in ("wanda", "wanda24"):
        return [WandaPruningModifier(sparsity=0.5, mask_structure="2:4" if method.endswith("24") else "0:0",
                                     targets=["Linear"], ignore=ign_prune)]
    raise SystemExit(f"unknown method {method}")


def dense_state_dict(model):
    """State dict with every quantized weight replaced by its fake-quantized value."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    sd = {}
    for name, mod in model.named_modules():
        scheme = getattr(mod, "quantization_scheme", None)
        if scheme is not None and getattr(scheme, "weights", None) is not None and hasattr(mod, "weight_scale"):
            zp = getattr(mod, "weight_zero_point", None)
            w = fake_quantize(mod.weight.data.float(), mod.weight_scale.data.float(),
                              None if zp is None else zp.data, scheme.weights)
            sd[f"{name}.weight"] = w.to(torch.float32)
    for k, v in model.state_dict().items():
        if k.rsplit(".", 1)[-1].startswith(("weight_", "input_", "output_")):
            continue  # quantization parameters (weight_scale, weight_zero_point, observers)
        sd.setdefault(k, v.float() if v.is_floating_point() else v)
    return sd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    a = ap.parse_args()
    res = {"ok": False, "seconds": None, "version": None, "error": None}
    try:
        import numpy as np
        import torch
        import llmcompressor
        from datasets import Dataset
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(torch.get_num_threads())
        if not torch.cuda.is_available():
            # llm-compressor 0.14's AWQ pins its activation cache (Tensor.pin_memory), which
            # raises on a CPU-only torch; pinning is a transfer optimisation, a no-op here.
            torch.Tensor.pin_memory = lambda self, *a, **k: self
        res["version"] = llmcompressor.__version__
        ids = np.load(a.calib)
        ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(a.model)
        recipe = build_recipe(a.method, a.group_size, not a.asym)
        t0 = time.perf_counter()
        oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe,
                num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1],
                shuffle_calibration_samples=False, pipeline="sequential")
        res["seconds"] = time.perf_counter() - t0
        sd = dense_state_dict(model)
        fresh = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        missing, unexpected = fresh.load_state_dict(sd, strict=False)
        missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"state dict mismatch: missing {missing[:4]} unexpected {unexpected[:4]}")
        fresh.save_pretrained(a.out)
        tok.save_pretrained(a.out)
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the failure is the result
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    with open(a.result, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
