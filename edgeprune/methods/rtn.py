"""Round-to-nearest (RTN) group-wise quantization: the data-free quantization baseline.

Each group of ``group_size`` consecutive input weights of a row gets its own scale ``s``
and zero point ``z`` (min/max grid, see :mod:`edgeprune.quantize`) and every weight is
rounded to the nearest grid point independently::

    q_ij = clamp(round(W_ij / s) + z, 0, 2^bits - 1),    W_hat_ij = (q_ij - z) * s
"""

from __future__ import annotations

from dataclasses import dataclass

from ..quantize import rtn_quantize
from .base import LayerResult, LayerTask, Method
from .config import QuantOptions
from .registry import register_method


@dataclass
class RTNConfig(QuantOptions):
    """Round-to-nearest group-wise quantization (baseline)."""

    method = "rtn"


@register_method(RTNConfig)
class RTN(Method):
    """RTN quantization (:class:`RTNConfig`)."""

    data_free = True

    def compress_layer(self, task: LayerTask) -> LayerResult:
        c = self.config
        q = rtn_quantize(task.weight.cpu(), c.bits, c.group_size, c.sym, name=task.name)
        q.meta["method"] = "rtn"
        w = q.dequantize().to(task.weight.device)
        if task.mask is not None:  # zero is on every grid, so pruned weights stay zero
            w = w * task.mask
        return LayerResult(weight=w, quantized=q)
