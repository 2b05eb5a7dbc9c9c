"""Compression methods, one file each; :func:`get_method` maps a config to its method.

=========  =====  ===========================================================
method     kind   paper
=========  =====  ===========================================================
magnitude  prune  baseline (|W|)
wanda      prune  Sun et al., "A Simple and Effective Pruning Approach for LLMs", ICLR 2024
sparsegpt  prune  Frantar & Alistarh, "SparseGPT", ICML 2023
rtn        quant  baseline (round-to-nearest)
gptq       quant  Frantar et al., "GPTQ", ICLR 2023
awq        quant  Lin et al., "AWQ", MLSys 2024
=========  =====  ===========================================================
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import InputStats, LayerResult, LayerTask, Method
from .magnitude import Magnitude, magnitude_prune
from .rtn import RTN
from .wanda import Wanda, wanda_prune
from .gptq import GPTQ, gptq_quantize

METHODS: dict[str, type] = {"magnitude": Magnitude, "wanda": Wanda, "rtn": RTN, "gptq": GPTQ}

try:  # these two land in later commits; keep the package importable meanwhile
    from .sparsegpt import SparseGPT, sparsegpt_prune  # noqa: F401
    METHODS["sparsegpt"] = SparseGPT
except ImportError:  # pragma: no cover
    pass
try:
    from .awq import AWQ  # noqa: F401
    METHODS["awq"] = AWQ
except ImportError:  # pragma: no cover
    pass


def get_method(config) -> Method:
    """Instantiate the method for a config object (see :mod:`edgeprune.recipe`).

    Raises:
        ConfigError: no method is registered under ``config.method``.
    """
    name = getattr(config, "method", None)
    if name not in METHODS:
        raise ConfigError(f"no compression method named {name!r}",
                          f"use one of {', '.join(sorted(METHODS))}")
    return METHODS[name](config)


__all__ = ["METHODS", "get_method", "Method", "InputStats", "LayerTask", "LayerResult",
           "magnitude_prune", "wanda_prune", "gptq_quantize"]
