"""Run Intel's AutoRound (``auto-round`` from PyPI) on an HF folder and save the result as
a plain dense folder (fake-quantized weights), for ``bench/compare_methods.py``.

Runs inside ``.venv-autoround`` (created by ``compare_methods.py``); it never imports
edgeprune. The calibration windows come from edgeprune (``--calib`` .npy of ``int64
[nsamples, seqlen]``), so both tools tune on exactly the same tokens, with the same grid
(bits, group size, sym), steps (``--iters``), step size (``--lr``) and windows per step
(``--batch-size``). After ``AutoRound.quantize()`` every tuned linear holds its
quantize-dequantize weight; the worker checks that each group holds at most ``2**bits``
distinct values, then saves the original fp32 model with those tuned linears' weights
(AutoRound returns a bfloat16 model; its tuned weights are what it computed, the embedding
and norms stay the dense fp32 ones, as on our side).

Writes ``--result`` JSON: ``{"ok", "seconds" (quantize() wall time), "version", "error"}``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback


def _quantize(a, res: dict) -> None:
    """Tune with AutoRound, check the grid, save the fp32 model with the tuned linears;
    fills ``res`` (``ok`` last)."""
    import numpy as np
    import torch
    import auto_round
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res["version"] = getattr(auto_round, "__version__", None)
    ids = torch.from_numpy(np.load(a.calib)).long()
    rows = [{"input_ids": ids[i:i + 1], "attention_mask": torch.ones_like(ids[i:i + 1])}
            for i in range(ids.shape[0])]
    loader = torch.utils.data.DataLoader(rows, batch_size=None, shuffle=False)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    ar = AutoRound(model, tok, bits=a.bits, group_size=a.group_size, sym=not a.asym, iters=a.iters, lr=a.lr,
                   minmax_lr=a.lr, batch_size=a.batch_size, nsamples=ids.shape[0], seqlen=ids.shape[1],
                   dataset=loader, seed=0)
    t0 = time.perf_counter()
    ar.quantize()
    res["seconds"] = time.perf_counter() - t0
    qm = getattr(ar, "model", model)
    worst = 0
    for name, mod in qm.named_modules():
        if isinstance(mod, torch.nn.Linear) and "layers" in name:
            w = mod.weight.detach().float()
            g = w.reshape(w.shape[0], -1, a.group_size)[:, 0]
            worst = max(worst, max(torch.unique(g[r]).numel() for r in range(min(g.shape[0], 64))))
    res["max_values_per_group"] = worst
    if worst > 2 ** a.bits:
        raise RuntimeError(f"the tuned weights are not on a {a.bits}-bit grid ({worst} values in a group)")
    # AutoRound hands back a bfloat16 model: keep the original fp32 weights everywhere
    # but in the tuned linears, so only the quantization differs from the dense model
    out_model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tuned = dict(qm.named_modules())
    with torch.no_grad():
        for name, mod in out_model.named_modules():
            if isinstance(mod, torch.nn.Linear) and "layers" in name:
                mod.weight.copy_(tuned[name].weight.detach().float())
    out_model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    res["ok"] = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--batch-size", type=int, default=4)
    a = ap.parse_args()
    res = {"ok": False, "seconds": None, "version": None, "error": None}
    try:
        _quantize(a, res)
    except BaseException as e:  # noqa: BLE001 - the failure is the result
        res.update(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    with open(a.result, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
