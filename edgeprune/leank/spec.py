"""The LeanK mask: the compress-side spec of the ``"leank"`` graph variant, its checks and
(de)serialisation, and :func:`learn_mask`, which builds one from calibration windows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

import numpy as np

from ..errors import CheckpointError, ConfigError
from ..variants import VariantSpec, load_spec, register_variant, save_spec
from .config import DEFAULT_ALIGNMENT, DEFAULT_SINK, DEFAULT_WINDOW, check_leank_args, kv_geometry
from .reference import apply_reference
from .train import learn_channels

MASK_FORMAT = "edgeprune.leank.v1"


@register_variant
@dataclass
class LeanKMask(VariantSpec):
    """A static key-channel mask (+ per-channel scales) for every layer and KV head: the
    compress-side spec of the graph variant ``"leank"`` (exported by
    ``exporters.leank.LeanKMixin``, run by ``runtime.leank.LeanKSession``).

    Attributes:
        keep: ``[layer][kv_head] -> sorted list of kept channel indices`` (post-rotary
            channel numbering, ``0 <= c < head_dim``; rotate-half layout as in HF).
        scales: same nesting, one float per kept channel: the query channel multiplier
            used in the pruned region (learned in stage 2; 1.0 for magnitude masks).
        head_dim: channels per key head (``D``).
        k_keep: the requested keep ratio in (0, 1].
        alignment: every head keeps a multiple of this many channels.
        method: ``"learned"`` | ``"magnitude"`` | ``"full"``.
        meta: provenance (calibration, steps, losses, timings).
        sink, window: tokens kept with full keys at the start / before each query in the
            export (``None``: the regime the mask was trained for, recorded in ``meta``,
            else :data:`DEFAULT_SINK` / :data:`DEFAULT_WINDOW`; see :attr:`regime`).
    """

    name: ClassVar[str] = "leank"
    title: ClassVar[str] = "LeanK mask"

    keep: list
    scales: list
    head_dim: int
    k_keep: float
    alignment: int = DEFAULT_ALIGNMENT
    method: str = "learned"
    meta: dict = field(default_factory=dict)
    sink: Optional[int] = None
    window: Optional[int] = None

    @property
    def regime(self) -> tuple[int, int]:
        """``(sink, window)`` of the export and the reference: the fields when set, else
        the training regime in ``meta`` (``train_sink`` / ``train_window``), else the
        deployment defaults 64 / 448."""
        return (int(self.sink if self.sink is not None else self.meta.get("train_sink", DEFAULT_SINK)),
                int(self.window if self.window is not None
                    else self.meta.get("train_window", DEFAULT_WINDOW)))

    # -------------------------------------------------------------- geometry
    @property
    def num_layers(self) -> int:
        return len(self.keep)

    @property
    def num_kv_heads(self) -> int:
        return len(self.keep[0]) if self.keep else 0

    def counts(self) -> np.ndarray:
        """Kept channels per (layer, KV head): ``int [layers, kv_heads]``."""
        return np.array([[len(h) for h in layer] for layer in self.keep], dtype=np.int64)

    @property
    def fraction(self) -> float:
        """Kept key channels / all key channels (the pruned-middle K-cache fraction)."""
        c = self.counts()
        return float(c.sum() / (c.size * self.head_dim))

    def dead_heads(self, layer: int) -> list[int]:
        """KV heads of ``layer`` with no kept channel (their middle V cache is dropped)."""
        return [h for h, ch in enumerate(self.keep[layer]) if len(ch) == 0]

    def v_fraction(self) -> float:
        """Fraction of the middle V cache kept (1 - dead heads / all heads)."""
        c = self.counts()
        return float((c > 0).sum() / c.size)

    def dense_scales(self, layer: int) -> np.ndarray:
        """``float32 [kv_heads, head_dim]``: scale on kept channels, 0 on pruned ones."""
        out = np.zeros((self.num_kv_heads, self.head_dim), np.float32)
        for h, (ch, sc) in enumerate(zip(self.keep[layer], self.scales[layer])):
            out[h, list(ch)] = sc
        return out

    def summary(self) -> str:
        c = self.counts()
        return (f"LeanK {self.method} mask: keep {self.fraction:.1%} of key channels "
                f"(target {self.k_keep:g}, alignment {self.alignment}), per-head kept "
                f"min {c.min()} / max {c.max()} of {self.head_dim}, "
                f"{int((c == 0).sum())} dead heads (middle V dropped)")

    # ------------------------------------------------------------ validation
    def validate(self, num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None) -> "LeanKMask":
        """Check the structure (and, optionally, that it matches a model).

        Raises:
            ConfigError: ragged/duplicate/out-of-range channels, scales of the wrong length,
                a head count that is not a multiple of ``alignment``, or a mismatch with
                the given model geometry.
        """
        check_leank_args(self.k_keep, self.alignment, self.head_dim, *self.regime)
        if not self.keep or any(len(layer) != len(self.keep[0]) for layer in self.keep):
            raise ConfigError("LeanK mask has no layers or a varying number of KV heads",
                              "re-learn the mask with `edgeprune leank`")
        for i, (lk, ls) in enumerate(zip(self.keep, self.scales)):
            if len(lk) != len(ls):
                raise ConfigError(f"LeanK mask layer {i}: scales and keep differ in heads",
                                  "re-learn the mask")
            for h, (ch, sc) in enumerate(zip(lk, ls)):
                if len(ch) != len(sc) or len(set(ch)) != len(ch) or \
                        any(not (0 <= int(c) < self.head_dim) for c in ch):
                    raise ConfigError(f"LeanK mask layer {i} head {h}: bad channel list",
                                      "re-learn the mask")
                if len(ch) % self.alignment:
                    raise ConfigError(f"LeanK mask layer {i} head {h} keeps {len(ch)} channels, "
                                      f"not a multiple of alignment {self.alignment}",
                                      "re-learn the mask with the alignment you export with")
        for name, want, got in (("layers", num_layers, self.num_layers),
                                ("KV heads", num_kv_heads, self.num_kv_heads),
                                ("head_dim", head_dim, self.head_dim)):
            if want is not None and want != got:
                raise ConfigError(f"LeanK mask has {got} {name}, the model has {want}",
                                  "use a mask learned on this model")
        return self

    def check_model(self, model) -> "LeanKMask":
        """:meth:`validate` against ``model``'s geometry."""
        L, _, KV, D = kv_geometry(model)
        return self.validate(L, KV, D)

    # -------------------------------------------------------------- (de)serialize
    def to_dict(self) -> dict:
        """JSON-ready dict (the exporter's spec; with the cache settings, the ``leank``
        record of ``edgeprune.json``); ``sink`` / ``window`` are :attr:`regime`'s."""
        sink, window = self.regime
        return {"format": MASK_FORMAT, "method": self.method, "k_keep": float(self.k_keep),
                "alignment": int(self.alignment), "head_dim": int(self.head_dim),
                "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "kept_fraction": self.fraction, "v_fraction": self.v_fraction(),
                "keep": [[[int(c) for c in h] for h in layer] for layer in self.keep],
                "scales": [[[round(float(s), 6) for s in h] for h in layer]
                           for layer in self.scales],
                "sink": sink, "window": window, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict, arrays: Optional[dict] = None) -> "LeanKMask":
        """Inverse of :meth:`to_dict` (a mask JSON written before the ``sink`` / ``window``
        fields reads them from its training regime). Raises :class:`CheckpointError` on a
        foreign dict."""
        if not isinstance(d, dict) or d.get("format") != MASK_FORMAT:
            raise CheckpointError("not an edgeprune LeanK mask (missing format "
                                  f"'{MASK_FORMAT}')", "pass a file written by LeanKMask.save")
        try:
            m = cls(keep=[[sorted(int(c) for c in h) for h in layer] for layer in d["keep"]],
                    scales=[[[float(s) for s in h] for h in layer] for layer in d["scales"]],
                    head_dim=int(d["head_dim"]), k_keep=float(d["k_keep"]),
                    alignment=int(d.get("alignment", 1)), method=str(d.get("method", "?")),
                    meta=dict(d.get("meta") or {}),
                    sink=None if d.get("sink") is None else int(d["sink"]),
                    window=None if d.get("window") is None else int(d["window"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"corrupt LeanK mask: {e}", "re-learn the mask") from e
        # sorting the channels must keep each scale with its channel
        for i, layer in enumerate(d["keep"]):
            for h, ch in enumerate(layer):
                order = np.argsort(np.asarray(ch, dtype=np.int64), kind="stable")
                m.scales[i][h] = [float(d["scales"][i][h][j]) for j in order]
        return m.validate()

    def save(self, path) -> Path:
        """Write the mask JSON atomically (:func:`edgeprune.variants.save_spec`)."""
        return save_spec(self, path)

    @classmethod
    def load(cls, path) -> "LeanKMask":
        """Read a mask written by :meth:`save` (or by ``LeanKMask.save`` before the variant
        registry: JSON without the ``variant`` name).

        Raises:
            CheckpointError: missing/unreadable/foreign file.
        """
        return load_spec(path, kind=cls)

    @classmethod
    def read_legacy(cls, path: Path) -> Optional["LeanKMask"]:
        """A mask JSON written before the variant registry (``format`` edgeprune.leank.v1,
        no ``variant`` name), else ``None``."""
        if not path.is_file() or path.suffix == ".safetensors":
            return None
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return cls.from_dict(d) if isinstance(d, dict) and d.get("format") == MASK_FORMAT else None

    # -------------------------------------------------------------- variant stages
    @classmethod
    def calibrate(cls, model, calib_ids, *, k_keep: float, method: str = "learned",
                  sink: Optional[int] = None, window: Optional[int] = None,
                  **options) -> "LeanKMask":
        """:func:`learn_mask` with ``sink`` / ``window`` as the training regime and the
        export's (``options``: the rest of :func:`learn_mask`'s keywords)."""
        mask = learn_mask(model, calib_ids, k_keep, method, train_sink=sink,
                          train_window=window, **options)
        mask.sink, mask.window = sink, window
        return mask.validate()

    def reference(self, model):
        """:func:`apply_reference` with this mask and its :attr:`regime`."""
        return apply_reference(model, self, *self.regime)

    @classmethod
    def full(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> "LeanKMask":
        """The keep-everything mask (``k_keep=1``): LeanK reduces to dense attention."""
        keep = [[list(range(head_dim)) for _ in range(num_kv_heads)] for _ in range(num_layers)]
        return cls(keep=keep, scales=[[[1.0] * head_dim for _ in range(num_kv_heads)]
                                      for _ in range(num_layers)],
                   head_dim=head_dim, k_keep=1.0, alignment=1, method="full")


def learn_mask(model, calib_ids, k_keep: float, method: str = "learned",
               alignment: int = DEFAULT_ALIGNMENT, **options) -> LeanKMask:
    """Learn a static LeanK key-channel mask meeting the ``k_keep`` budget.

    Args and errors: :func:`edgeprune.leank.train.learn_channels` (``method="learned"``:
    LeanK's two-stage training; ``"magnitude"``: the ``||q||*||k||`` baseline).

    Returns:
        :class:`LeanKMask` (its ``meta`` records the settings and timings).
    """
    return LeanKMask(**learn_channels(model, calib_ids, k_keep, method, alignment, **options))


__all__ = ["LeanKMask", "learn_mask", "MASK_FORMAT"]
