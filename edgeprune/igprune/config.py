"""IG-Pruning settings and the checks of what a user passes (skip ratio, masks).

Sub-block numbering (used everywhere in this package, the exporter and the runtime):
a model with ``L`` decoder layers has ``2L`` sub-blocks; sub-block ``2i`` is layer ``i``'s
attention, ``2i + 1`` its MLP. A mask is ``2L`` ints, ``1`` = run the sub-block,
``0`` = bypass it (the residual stream passes unchanged).
"""

from __future__ import annotations

from ..errors import ConfigError

#: decoder layers run by the router (prompt embedding = mean residual stream after them)
DEFAULT_EMBED_LAYER = 2
#: prompt tokens the router embeds
DEFAULT_ROUTE_TOKENS = 32
#: K values of the cluster-count sweep
DEFAULT_KS = (2, 3, 4)
#: Hard-Concrete training defaults (per mask)
DEFAULT_STEPS = 60
DEFAULT_LR = 0.1
DEFAULT_BATCH = 4
#: weight of the squared gap between the expected kept fraction and the target
DEFAULT_SPARSITY_WEIGHT = 20.0
#: smallest cluster (calibration windows) that gets its own mask in the K sweep
MIN_CLUSTER = 2
METHODS = ("ig", "l0", "angular")


def check_skip_ratio(skip_ratio, num_sub_blocks: int | None = None) -> float:
    """``skip_ratio`` as a float in ``(0, 1)``; with ``num_sub_blocks`` (``2L``), also that it
    skips at least one and keeps at least one sub-block.

    Raises:
        ConfigError: a ratio outside ``(0, 1)`` or one that rounds to no / every sub-block.
    """
    try:
        r = float(skip_ratio)
    except (TypeError, ValueError):
        raise ConfigError(f"skip_ratio={skip_ratio!r} is not a number",
                          "pass a fraction of sub-blocks to skip, e.g. 0.25") from None
    if not 0.0 < r < 1.0:
        raise ConfigError(f"skip_ratio={skip_ratio!r} is outside (0, 1)",
                          "pass the fraction of the 2L attention/MLP sub-blocks to skip, e.g. 0.25")
    if num_sub_blocks is not None:
        k = skip_count(r, num_sub_blocks)
        if k < 1 or k >= num_sub_blocks:
            raise ConfigError(f"skip_ratio={r:g} of {num_sub_blocks} sub-blocks skips {k}",
                              f"pass a ratio between {1 / num_sub_blocks:.3f} and "
                              f"{1 - 1 / num_sub_blocks:.3f}")
    return r


def skip_count(skip_ratio: float, num_sub_blocks: int) -> int:
    """Sub-blocks a mask at ``skip_ratio`` skips: ``round(skip_ratio * 2L)``."""
    return int(round(float(skip_ratio) * num_sub_blocks))


def check_mask(mask, num_sub_blocks: int, what: str = "mask") -> list:
    """``mask`` as a list of ``2L`` ints in ``{0, 1}``.

    Raises:
        ConfigError: wrong length, values other than 0/1, or a mask that skips every
            sub-block (the model would be its embedding and head only).
    """
    try:
        m = [int(v) for v in mask]
    except (TypeError, ValueError):
        raise ConfigError(f"{what} {mask!r} is not a list of 0/1", "pass 2L ints, 1 = keep") from None
    if len(m) != num_sub_blocks or any(v not in (0, 1) for v in m):
        raise ConfigError(f"{what} has {len(m)} entries {sorted(set(m))}, the model "
                          f"{num_sub_blocks} sub-blocks",
                          f"pass {num_sub_blocks} values in {{0, 1}} (2 per layer: attention, MLP)")
    if not any(m):
        raise ConfigError(f"{what} skips every sub-block",
                          "keep at least one attention or MLP sub-block (lower skip_ratio)")
    return m


def check_method(method: str) -> str:
    """Raises ConfigError for a method other than ``ig`` / ``l0`` / ``angular``."""
    if method not in METHODS:
        raise ConfigError(f"IG-Pruning method {method!r} is unknown",
                          f"use one of {', '.join(METHODS)}")
    return method


def embed_layer_for(num_layers: int, embed_layer: int | None) -> int:
    """The router's layer count: ``embed_layer`` (default :data:`DEFAULT_EMBED_LAYER`),
    at most ``L - 1``, at least 1.

    Raises:
        ConfigError: ``embed_layer`` outside ``[1, L)``.
    """
    if embed_layer is None:
        return max(1, min(DEFAULT_EMBED_LAYER, num_layers - 1))
    e = int(embed_layer)
    if not 1 <= e < max(2, num_layers):
        raise ConfigError(f"embed_layer={embed_layer} is outside [1, {num_layers})",
                          "the router runs the first embed_layer layers; pass e.g. 2")
    return e
