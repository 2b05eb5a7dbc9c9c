"""How much the calibration text matters: the default recipe calibrated on different texts.

SmolLM2-135M-Instruct, the pipeline's default recipe (GPTQ int4 g64 asym, static
act-order; ``edgeprune.pipeline.DEFAULT_METHOD``), ``--nsamples`` x 512 calibration windows
drawn with the same seed from each source, scored on WikiText-2 test (no BOS, 512-token
windows, ``edgeprune.evaluate.perplexity``):

* ``default``: the embedded documentation text (``pydoc_data.topics``, calibration part);
* ``c4``: C4 validation (``../shared/data/c4``);
* ``self``: text sampled from the model itself (``edgeprune.calibration.self_generated``;
  slow: plain PyTorch sampling on CPU).

No peer runs here (``peer``/``theirs`` null). Records: case = source, metrics ``ppl`` and
``calib_compress_s`` (calibration + compression), plus ``dense``/``ppl``. ``--quick`` (16
windows from ``default`` and ``c4``, 10 evaluation windows, no ``self``): two best-w4 GPTQ
compressions, 5-10 minutes on 2 cores depending on the machine's load.

Usage::

    .venv/bin/python bench/calibration_domain.py --json bench/results/calibration_domain.json
    .venv/bin/python bench/calibration_domain.py --quick --json /tmp/cal.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import benchlib
from benchlib import C4, WIKI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_common_args(ap, "16 windows, 10 eval windows, no 'self'")
    ap.add_argument("--sources", default=None, help="comma list of default,c4,self")
    ap.add_argument("--nsamples", type=int, default=None)
    ap.add_argument("--nwindows", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    from edgeprune.calibration import build_calibration
    from edgeprune.engine import compress
    from edgeprune.evaluate import perplexity
    from edgeprune.models import load_model
    from edgeprune.pipeline import RunConfig, build_recipe

    torch.set_num_threads(a.threads)
    nsamples = a.nsamples or (16 if a.quick else 64)
    nwin = a.nwindows or (10 if a.quick else 40)
    sources = (a.sources or ("default,c4" if a.quick else "default,c4,self")).split(",")
    base, tok = load_model("smollm2-135m")
    recs = [benchlib.record("dense", "ppl", perplexity(base, tok, WIKI, nwindows=nwin,
                                                       progress=False).ppl)]
    print(f"dense: ppl {recs[0]['ours']:.3f}", flush=True)
    for name in sources:
        src = {"default": None, "c4": C4, "self": "self"}[name]
        t0 = time.perf_counter()
        cal = build_calibration(tok, src, nsamples=nsamples, seqlen=512, seed=0, model=base)
        m = copy.deepcopy(base)
        compress(m, build_recipe(RunConfig()), cal.input_ids, progress=False, measure_errors=False)
        secs = time.perf_counter() - t0
        p = perplexity(m, tok, WIKI, nwindows=nwin, progress=False).ppl
        print(f"{name}: WikiText-2 ppl {p:.3f} ({nsamples}x512 from {cal.info['source']}, "
              f"{secs:.0f} s)", flush=True)
        recs += [benchlib.record(name, "ppl", p), benchlib.record(name, "calib_compress_s", secs)]
        del m
    if a.json:
        benchlib.write_records(a.json, recs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
