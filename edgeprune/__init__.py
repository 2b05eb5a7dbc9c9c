"""edgeprune: compress, export, run and profile small language models on device.

Python API (torchao-style: configuration objects and one verb)::

    import edgeprune as ep
    model, tok = ep.load_model("smollm2-135m")
    calib = ep.build_calibration(tok, nsamples=64, seqlen=512).input_ids
    result = ep.compress(model, ep.GPTQConfig(bits=4, group_size=64), calib)
    print(ep.perplexity(model, tok).ppl)
    ep.save_checkpoint(model, tok, result, "out/ckpt")
    ep.export_onnx(model, tok, "out/onnx", precision="int4", quantized=result.quantized)

Names are imported lazily so ``import edgeprune`` (and the CLI's start) stays fast. The
method configs (``GPTQConfig``, ``SparseGPTConfig``, ...) are looked up in the method
registry (:mod:`edgeprune.methods`) by class name: a newly registered method's config is
``edgeprune.<Name>Config`` with no edit here.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "edgeprune.models",
    "build_calibration": "edgeprune.calibration",
    "get_calibration": "edgeprune.calibration",
    "perplexity": "edgeprune.evaluate",
    "fidelity": "edgeprune.evaluate",
    "compress": "edgeprune.engine",
    "CompressionResult": "edgeprune.engine",
    "Recipe": "edgeprune.recipe",
    "MethodConfig": "edgeprune.methods",
    "register_method": "edgeprune.methods",
    "QuantizedWeight": "edgeprune.quantize",
    "save_checkpoint": "edgeprune.checkpoint",
    "load_checkpoint": "edgeprune.checkpoint",
    "run_pipeline": "edgeprune.pipeline",
    "RunConfig": "edgeprune.pipeline",
    "export_onnx": "exporters",
    "EdgePruneError": "edgeprune.errors",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "__all__":  # computed on demand: listing the configs imports the registry (torch)
        return sorted(_EXPORTS) + sorted(_config_classes()) + ["__version__"]
    if name.endswith("Config"):
        cls = _config_classes().get(name)
        if cls is not None:
            return cls
    raise AttributeError(f"module 'edgeprune' has no attribute {name!r}")


def _config_classes() -> dict:
    """``{class name: config class}`` of every registered compression method."""
    from .methods import config_classes

    return {c.__name__: c for c in config_classes().values()}
