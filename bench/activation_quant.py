"""Which projections' int8 activations cost perplexity: level 4 emulated in PyTorch, lifted per type.

An int4 export's ``MatMulNBits`` nodes run at ``accuracy_level=4``: onnxruntime quantizes
each input row to symmetric int8 per block of the weight's group size (``scale = max|x| /
127`` over the block) before the integer dot products. This bench applies the same
quantization to the inputs of a compressed checkpoint's decoder projections in PyTorch
(fake-quantized weights, as ``edgeprune eval CHECKPOINT`` scores them) and lifts it from
one projection type at a time, so the perplexity cost of level 4 is attributed without
exporting anything. Records, ``wikitext2_ppl`` (WikiText-2 test, ``--nwindows`` x 512, no
BOS) per case:

* ``exact``: no activation quantization (the checkpoint as PyTorch scores it);
* ``level4``: every decoder projection's input quantized;
* ``level4 except <type>``: every one but ``q_proj``, ``k_proj``, ... ``down_proj``.

The lm_head is left exact in every case. No peer runs here (``peer``/``theirs`` null).
Quality only: valid on a loaded machine. The measured export figure to set beside it:
``bench/accuracy_levels.py --ppl-windows 40``.

Usage::

    .venv/bin/python bench/activation_quant.py --checkpoint runs/demo/checkpoint \\
        --json bench/results/activation_quant.json
    .venv/bin/python bench/activation_quant.py --checkpoint runs/demo/checkpoint --quick --json /tmp/aq.json
"""

from __future__ import annotations

import argparse
import sys

import benchlib

TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_blocks(x, block: int):
    """``x`` ``[..., K]`` through symmetric int8 per ``block`` consecutive inputs (the
    quantization of onnxruntime's ``MatMulNBits`` at ``accuracy_level=4``); ``K`` must be a
    multiple of ``block``."""
    import torch

    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block)
    scale = xb.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny) / 127.0
    return (torch.round(xb / scale).clamp(-127, 127) * scale).reshape(shape)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "cases exact, level4 and level4 except v_proj; 8 windows")
    ap.add_argument("--checkpoint", required=True, help="compressed checkpoint (e.g. runs/demo/checkpoint)")
    ap.add_argument("--block", type=int, default=64,
                    help="activation block: the checkpoint's group size, which onnxruntime blocks by (default 64)")
    ap.add_argument("--nwindows", type=int, default=None, help="WikiText-2 windows (default 40)")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)

    import torch

    from edgeprune.evaluate import perplexity
    from edgeprune.models import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.checkpoint)
    model.eval()
    block = a.block
    nwin = a.nwindows or (8 if a.quick else 40)
    lin = {n: m for n, m in model.named_modules()
           if isinstance(m, torch.nn.Linear) and ".layers." in n and n.rsplit(".", 1)[-1] in TYPES}
    state = {"on": False, "skip": ""}

    def pre(name):
        def hook(mod, args):
            lifted = bool(state["skip"]) and name.endswith(state["skip"])
            if state["on"] and not lifted:
                return (int8_blocks(args[0], block),)
        return hook

    for n, m in lin.items():
        m.register_forward_pre_hook(pre(n))
    cases = [("exact", False, "")]
    cases += [("level4", True, "")]
    cases += [(f"level4 except {t}", True, t) for t in (("v_proj",) if a.quick else TYPES)]
    recs = []
    for case, on, skip in cases:
        state.update(on=on, skip=skip)
        with torch.no_grad():
            r = perplexity(model, tok, benchlib.WIKI, seqlen=512, nwindows=nwin, progress=False)
        recs.append(benchlib.record(case, "wikitext2_ppl", r.ppl))
        print(f"{case:24s} WikiText-2 perplexity {r.ppl:.3f} ({nwin} x 512, activation block {block})",
              flush=True)
    if a.json:
        benchlib.write_records(a.json, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
