"""LeanK settings and their checks: defaults, argument validation, model geometry."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..errors import ConfigError

DEFAULT_SINK = 64
DEFAULT_WINDOW = 448
DEFAULT_ALIGNMENT = 8
DEFAULT_CALIB_NSAMPLES = 4   # calibration windows for learned masks (CLI) ...
DEFAULT_CALIB_SEQLEN = 2048  # ... of this many tokens: longer than sink + window


def check_leank_args(k_keep: Optional[float] = None, alignment: Optional[int] = None,
                     head_dim: Optional[int] = None, sink: Optional[int] = None,
                     window: Optional[int] = None, context: Optional[int] = None) -> None:
    """Validate LeanK options; every argument is optional.

    Raises:
        ConfigError: ``k_keep`` outside (0, 1]; ``alignment`` < 1 or not dividing
            ``head_dim``; negative ``sink``/``window``; ``sink + window`` larger than the
            ``context`` (tokens) the model or evaluation uses.
    """
    if k_keep is not None:
        if not isinstance(k_keep, (int, float)) or not (0.0 < float(k_keep) <= 1.0) \
                or math.isnan(float(k_keep)):
            raise ConfigError(f"k_keep={k_keep!r} is outside (0, 1]",
                              "use e.g. --k-keep 0.3 to keep 30% of the key channels")
    if alignment is not None:
        if not isinstance(alignment, (int, np.integer)) or alignment < 1:
            raise ConfigError(f"alignment={alignment!r} must be a positive integer",
                              "use e.g. --alignment 8")
        if head_dim is not None and head_dim % alignment:
            raise ConfigError(f"alignment={alignment} does not divide head_dim={head_dim}",
                              f"use a divisor of {head_dim} (e.g. 1, 2, 4, 8, 16)")
    for name, v in (("sink", sink), ("window", window)):
        if v is not None and (not isinstance(v, (int, np.integer)) or v < 0):
            raise ConfigError(f"{name}={v!r} must be a non-negative integer",
                              f"use e.g. --{name} {DEFAULT_SINK if name == 'sink' else DEFAULT_WINDOW}")
    if context is not None and sink is not None and window is not None and sink + window > context:
        raise ConfigError(f"sink + window = {sink + window} tokens exceed the context of "
                          f"{context} tokens: nothing would be pruned",
                          f"use sink + window < {context} (defaults: sink {DEFAULT_SINK}, "
                          f"window {DEFAULT_WINDOW})")


def kv_geometry(model) -> tuple[int, int, int, int]:
    """``(num_layers, num_heads, num_kv_heads, head_dim)`` of an HF llama/qwen2 model."""
    cfg = model.config
    n = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n
    return cfg.num_hidden_layers, n, getattr(cfg, "num_key_value_heads", None) or n, d


__all__ = ["check_leank_args", "kv_geometry", "DEFAULT_SINK", "DEFAULT_WINDOW",
           "DEFAULT_ALIGNMENT", "DEFAULT_CALIB_NSAMPLES", "DEFAULT_CALIB_SEQLEN"]
