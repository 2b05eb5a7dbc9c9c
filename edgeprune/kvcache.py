"""A float16 or int8 KV cache: the compress-side spec of the graph variant ``"kvcache"``.

The graph (``exporters.kvcache``) stores ``GroupQueryAttention``'s keys and values as
float16 or as int8 codes with one static scale per layer, KV head and channel (what
onnxruntime's ``PER_CHANNEL`` KV quantization takes); queries, new keys/values and the
attention output keep the model's float type. A decode step reads half (fp16) or a
quarter (int8) of the fp32 cache's bytes; llama.cpp's defaults are the f16 cache and
``-ctk q8_0 -ctv q8_0`` (per 32 values, dynamic) for a quantized one.

Scales (:meth:`KVCacheSpec.calibrate`): the model is run on calibration windows and its
cache read back (transformers' ``DynamicCache``: keys after rotary, values). Rotary turns
channel ``d`` and ``d + D/2`` of a key into each other by the position's angle, so a
static key scale must hold for any angle: channel ``d``'s scale (and its partner's) is the
largest rotary-pair norm ``sqrt(k_d^2 + k_{d+D/2}^2)`` seen, over 127, times ``margin``.
Values: the largest ``|v_d|`` over 127, times ``margin``. Codes saturate at +-127 (a token
beyond the calibration range is clipped, not wrapped).

Usage::

    spec = KVCacheSpec.calibrate(model, calib_ids)          # int8, scales from calibration
    export_onnx(model, tok, "onnx-kv8", precision="int4", quantized=q, variants=[spec])
    export_onnx(model, tok, "onnx-kv16", precision="int4", variants=[KVCacheSpec("fp16")])
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import numpy as np

from .errors import CheckpointError, ConfigError
from .variants import VariantSpec, register_variant

#: the cache dtypes the graph variant stores
DTYPES = ("fp16", "int8")
#: largest int8 code used (symmetric, -127..127)
QMAX = 127


@register_variant
@dataclass
class KVCacheSpec(VariantSpec):
    """A KV-cache storage choice for one model.

    Attributes:
        dtype: ``"fp16"`` or ``"int8"``.
        k_scale: int8 only: ``float32 [layers, kv_heads, head_dim]`` key scales (a code
            times its scale is the stored post-rotary key).
        v_scale: int8 only: ``float32 [layers, kv_heads, head_dim]`` value scales.
        stats: JSON-able calibration figures (tokens, windows, margin).

    Raises:
        ConfigError: an unknown dtype, or int8 without both scales of one shape.
    """

    name: ClassVar[str] = "kvcache"
    title: ClassVar[str] = "KV-cache spec"

    dtype: str
    k_scale: Optional[np.ndarray] = None
    v_scale: Optional[np.ndarray] = None
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"KV-cache dtype {self.dtype!r} is unknown", f"use one of {', '.join(DTYPES)}")
        if self.dtype == "int8":
            if self.k_scale is None or self.v_scale is None:
                raise ConfigError("an int8 KV cache needs k_scale and v_scale",
                                  "build it with KVCacheSpec.calibrate(model, calib_ids)")
            self.k_scale = np.asarray(self.k_scale, np.float32)
            self.v_scale = np.asarray(self.v_scale, np.float32)
            if self.k_scale.ndim != 3 or self.k_scale.shape != self.v_scale.shape:
                raise ConfigError(f"k_scale {self.k_scale.shape} and v_scale {self.v_scale.shape} "
                                  "must both be [layers, kv_heads, head_dim]",
                                  "build the spec with KVCacheSpec.calibrate")

    # ------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "stats": self.stats}

    def arrays(self) -> dict:
        if self.dtype != "int8":
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    @classmethod
    def from_dict(cls, d: dict, arrays: Optional[dict] = None) -> "KVCacheSpec":
        if not isinstance(d, dict) or d.get("dtype") not in DTYPES:
            raise CheckpointError(f"not a KV-cache spec (dtype {d.get('dtype') if isinstance(d, dict) else d!r})",
                                  "write it with edgeprune.variants.save_spec(KVCacheSpec(...))")
        arrays = arrays or {}
        try:
            return cls(d["dtype"], arrays.get("k_scale"), arrays.get("v_scale"), dict(d.get("stats") or {}))
        except ConfigError as e:
            raise CheckpointError(f"KV-cache spec: {e.message}", e.hint) from None

    # ------------------------------------------------------------ calibration
    @classmethod
    def calibrate(cls, model, calib_ids, dtype: str = "int8", margin: float = 1.0,
                  **options) -> "KVCacheSpec":
        """Per-channel int8 scales from the model's own cache on ``calib_ids``
        (module docstring); ``dtype="fp16"`` needs no calibration and ignores the ids.

        Args:
            model: HF causal LM (fp32, eval), the model the export is built from.
            calib_ids: ``int64 [nsamples, seqlen]`` token windows (torch or numpy), run one
                window at a time.
            margin: scale multiplier (> 0; above 1 leaves headroom for tokens larger than
                any calibration token, at the cost of resolution).

        Raises:
            ConfigError: unknown dtype or option, non-positive margin, no windows.
        """
        if options:
            raise ConfigError(f"unknown KV-cache calibration option(s) {sorted(options)}",
                              "pass dtype and margin only")
        if dtype == "fp16":
            return cls("fp16")
        if dtype != "int8":
            raise ConfigError(f"KV-cache dtype {dtype!r} is unknown", f"use one of {', '.join(DTYPES)}")
        if not (margin > 0 and np.isfinite(margin)):
            raise ConfigError(f"margin={margin!r} must be a positive number", "use e.g. 1.0")
        import torch

        ids = torch.as_tensor(np.asarray(calib_ids), dtype=torch.long)
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ConfigError(f"calibration ids of shape {tuple(ids.shape)}; need [nsamples >= 1, seqlen >= 1]",
                              "pass e.g. edgeprune.build_calibration(tok, 4, 2048).input_ids")
        kmax = vmax = None
        with torch.no_grad():
            for row in ids:
                out = model(row[None], use_cache=True)
                cache = getattr(out, "cache", None) or out.past_key_values
                k = torch.stack([layer.keys[0] for layer in cache.layers]).float()    # [L,KV,T,D]
                v = torch.stack([layer.values[0] for layer in cache.layers]).float()
                half = k.shape[-1] // 2
                pair = torch.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2)            # [L,KV,T,D/2]
                kk = torch.cat([pair, pair], -1).amax(2)
                vv = v.abs().amax(2)
                kmax = kk if kmax is None else torch.maximum(kmax, kk)
                vmax = vv if vmax is None else torch.maximum(vmax, vv)
        tiny = np.float32(1e-8)      # a channel that is always 0 still gets a valid scale
        ks = np.maximum(kmax.numpy() * margin / QMAX, tiny).astype(np.float32)
        vs = np.maximum(vmax.numpy() * margin / QMAX, tiny).astype(np.float32)
        stats = {"windows": int(ids.shape[0]), "tokens": int(ids.numel()), "margin": float(margin),
                 "k": "rotary-pair norm max / 127", "v": "abs max / 127"}
        return cls("int8", ks, vs, stats)


    # ------------------------------------------------------------ reference
    def rounding_cache(self):
        """A transformers ``DynamicCache`` that stores what the exported cache stores:
        keys (after rotary) and values rounded to float16, or to ``clip(round(x / scale),
        -127, 127) * scale`` for int8; attention then reads the rounded tensors, the new
        token's own key and value included (what a decode step of the graph reads)."""
        import torch
        from transformers import DynamicCache

        spec = self

        class RoundingCache(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                if spec.dtype == "fp16":
                    k, v = key_states.half().to(key_states.dtype), value_states.half().to(value_states.dtype)
                else:
                    ks, vs = (torch.from_numpy(a[layer_idx])[None, :, None, :].to(key_states.dtype)
                              for a in (spec.k_scale, spec.v_scale))
                    k = torch.clamp(torch.round(key_states / ks), -QMAX, QMAX) * ks
                    v = torch.clamp(torch.round(value_states / vs), -QMAX, QMAX) * vs
                return super().update(k, v, layer_idx, *args, **kwargs)

        return RoundingCache()

    @contextmanager
    def reference(self, model):
        """Inside it, a call of ``model`` without a cache runs with :meth:`rounding_cache`:
        its logits are the exported graph's decode-path logits (``Session.logits(chunk=1)``)."""
        forward, own = model.forward, "forward" in vars(model)

        def rounded(*args, **kwargs):
            if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
                kwargs.update(cache=self.rounding_cache(), use_cache=True)
            return forward(*args, **kwargs)

        model.forward = rounded
        try:
            yield model
        finally:
            if own:
                model.forward = forward
            else:
                del model.forward


__all__ = ["KVCacheSpec", "DTYPES", "QMAX"]
