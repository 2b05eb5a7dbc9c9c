"""Compression methods, one file each, found through the method registry.

=========  =====  ===========================================================
method     kind   paper
=========  =====  ===========================================================
magnitude  prune  baseline (|W|)
wanda      prune  Sun et al., "A Simple and Effective Pruning Approach for LLMs", ICLR 2024
sparsegpt  prune  Frantar & Alistarh, "SparseGPT", ICML 2023
fista      prune  Zhao et al., "FISTAPruner: Layer-wise Post-training Pruning for LLMs", 2024
rtn        quant  baseline (round-to-nearest)
gptq       quant  Frantar et al., "GPTQ", ICLR 2023
awq        quant  Lin et al., "AWQ", MLSys 2024
signround  quant  Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent" (AutoRound), 2023
e2e-qp     tune   Chen et al., "EfficientQAT" (E2E-QP), ACL 2025: scales trained end to end
=========  =====  ===========================================================

Adding a method: one file ``methods/<name>.py`` holding its config (a dataclass deriving
:class:`MethodConfig`, or :class:`PruneOptions` / :class:`QuantOptions`, with
``method = "<name>"``) and its :class:`Method`, joined by ``@register_method(<Name>Config)``;
and one import line below. The CLI's ``--method`` choices, recipe parsing
(``method: <name>``), ``edgeprune.<Name>Config`` and the engine then find it.
"""

from __future__ import annotations

from .base import InputStats, LayerResult, LayerTask, Method
from .config import MethodConfig, PruneOptions, QuantOptions
from .registry import (CONFIGS, METHODS, config_class, config_classes, get_method, is_registered,
                       method_names, register_method, unregister_method)

# one line per method; the order is the CLI's order of --method choices
from . import magnitude  # noqa: E402,F401
from . import wanda  # noqa: E402,F401
from . import sparsegpt  # noqa: E402,F401
from . import fista  # noqa: E402,F401
from . import rtn  # noqa: E402,F401
from . import gptq  # noqa: E402,F401
from . import awq  # noqa: E402,F401
from . import signround  # noqa: E402,F401
from . import e2eqp  # noqa: E402,F401

from .gptq import gptq_quantize  # noqa: E402
from .magnitude import magnitude_prune  # noqa: E402
from .wanda import wanda_prune  # noqa: E402

__all__ = ["METHODS", "CONFIGS", "get_method", "method_names", "config_class", "config_classes",
           "is_registered", "register_method", "unregister_method", "Method", "MethodConfig",
           "PruneOptions", "QuantOptions", "InputStats", "LayerTask", "LayerResult",
           "magnitude_prune", "wanda_prune", "gptq_quantize"]
