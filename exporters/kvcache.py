"""A smaller KV cache for CPU decode: float16 or int8 keys and values inside
``GroupQueryAttention``'s shared buffer (the graph variant ``"kvcache"``).

A decode step reads the whole KV cache: at 2,048 tokens of SmolLM2-135M an fp32 cache is
2,048 x 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 bytes = 94 MiB per token, more than its
int4 weights (~70 MiB). This variant stores the cache in fewer bytes and leaves the rest of
the graph unchanged (queries, new keys/values and the attention output stay in the model's
float type):

* ``dtype="fp16"``: ``past_key_values.*`` / ``present.*`` are float16 (2 bytes per value,
  llama.cpp's default ``f16`` cache). onnxruntime 1.32's CPU ``GroupQueryAttention``
  takes a float16 cache (``T_CACHE``) beside float32 queries.
* ``dtype="int8"``: int8 codes with one static scale per layer, KV head and channel
  (``k_quant_type = v_quant_type = "PER_CHANNEL"``, ``kv_cache_bit_width = 8``; the
  operator's ``k_scale`` / ``v_scale`` inputs ``float32 [1, KV, 1, D]``): the operator
  writes ``clip(round(x / scale), -127, 127)`` and reads ``code * scale``. The scales come
  from calibration (``edgeprune.kvcache.KVCacheSpec.calibrate``): keys are stored after
  rotary, which turns channel ``d`` and ``d + D/2`` into each other, so a key channel's
  scale is the largest calibration norm of its rotary pair over 127 (no position can
  saturate it); a value channel's is its largest absolute value over 127.

The spec dict (``edgeprune.kvcache.KVCacheSpec.to_dict()`` + ``arrays``): ``dtype``
(``"fp16"`` | ``"int8"``) and, for int8, ``arrays = {"k_scale", "v_scale": float32
[layers, KV, D]}``. Only fused graphs (the shared buffer of ``GroupQueryAttention``)
without ring layers or LeanK; the runtime needs nothing of its own (``KVSpec`` reads the
cache's element type from the graph's inputs).

The recorded variant (``edgeprune.json`` ``variants.kvcache``) says the dtype, the bytes
per cached token and, for int8, the scale statistics; ``kv_layout.dtype`` names the
cache's element type.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from edgeprune_runtime.errors import ExportError

from .variants import VariantMixin, register_export_variant

#: cache dtypes: ONNX element type, numpy dtype, bytes per value
KV_DTYPES = {"fp16": (TensorProto.FLOAT16, np.float16, 2), "int8": (TensorProto.INT8, np.int8, 1)}


def check_kv_spec(d: dict, spec) -> dict:
    """Validate a ``kvcache`` spec dict against a :class:`~exporters.spec.DecoderSpec`.

    Returns:
        ``{"dtype": str, "k_scale", "v_scale": float32 [layers, KV, D] or None}``.

    Raises:
        ExportError: unknown dtype, missing / misshapen / non-positive int8 scales.
    """
    dtype = d.get("dtype")
    if dtype not in KV_DTYPES:
        raise ExportError(f"kvcache dtype {dtype!r} is unknown", "use 'fp16' or 'int8'")
    out = {"dtype": dtype, "k_scale": None, "v_scale": None}
    if dtype == "int8":
        arrays = d.get("arrays") or {}
        want = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        for n in ("k_scale", "v_scale"):
            a = arrays.get(n)
            if a is None:
                raise ExportError(f"an int8 KV cache needs per-channel scales ({n} missing)",
                                  "calibrate them with edgeprune.kvcache.KVCacheSpec.calibrate"
                                  "(model, calib_ids) or `edgeprune kvcache MODEL --dtype int8`")
            a = np.asarray(a, np.float32)
            if a.shape != want:
                raise ExportError(f"kvcache {n} has shape {a.shape}, the model needs {want} "
                                  "(layers, KV heads, head_dim)", "calibrate the scales on this model")
            if not (np.isfinite(a).all() and (a > 0).all()):
                raise ExportError(f"kvcache {n} holds non-positive or non-finite scales",
                                  "calibrate the scales again (every channel needs a scale > 0)")
            out[n] = a
    return out


@register_export_variant("kvcache")
class KVCacheMixin(VariantMixin):
    """Builder mixin: a float16 or int8 ``GroupQueryAttention`` cache (module docstring).

    Raises:
        ExportError: a bad spec (:func:`check_kv_spec`); a plain graph, a graph with
            sliding-window ring layers or a LeanK graph (no shared ``GroupQueryAttention``
            buffer); ``fp16`` on an fp16 export (its cache is float16 already).
    """

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        self.kv_cfg = check_kv_spec(opts.variants["kvcache"], spec)
        if opts.graph != "fused" or "leank" in opts.variants:
            raise ExportError("a kvcache variant needs the fused graph's GroupQueryAttention "
                              "buffer (not a plain graph, not LeanK)",
                              "export with --graph fused and without LeanK")
        if opts.local_kv == "ring" and spec.sliding_layers:
            raise ExportError("a kvcache variant cannot store the sliding-window ring layers",
                              "export with local_kv='full'")
        if self.kv_cfg["dtype"] == "fp16" and opts.precision == "fp16":
            raise ExportError("an fp16 export's KV cache is float16 already",
                              "drop the kvcache variant, or export int4 / fp32")
        self.approximate_logits = True       # the cache rounds keys and values

    # --------------------------------------------------------------- hooks
    @property
    def genai_loadable(self) -> bool:
        """No ``genai_model.onnx``: onnxruntime-genai running a float16 / int8 cache beside
        float32 queries is not checked here (``model.onnx`` is the same either way)."""
        return False

    def cache_type(self, i: int) -> int:
        return KV_DTYPES[self.kv_cfg["dtype"]][0]

    def gqa_cache_options(self, i: int) -> tuple[list, dict]:
        """int8: ``k_scale`` / ``v_scale`` ``float32 [1, KV, 1, D]`` (inputs 12, 13 of the
        operator; positions, attention bias and head sink left empty) and the per-channel
        8-bit quantization attributes; fp16: nothing."""
        if self.kv_cfg["dtype"] != "int8":
            return [], {}
        g = self.g
        ks, vs = (g.initializer(f"layers.{i}.attn.{n}",
                                self.kv_cfg[n][i][None, :, None, :].astype(np.float32))
                  for n in ("k_scale", "v_scale"))
        return ["", "", "", ks, vs], {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL",
                                      "kv_cache_bit_width": 8}

    def io_metadata(self) -> dict:
        return {**super().io_metadata(),
                "dtype": {"fp16": "float16", "int8": "int8"}[self.kv_cfg["dtype"]]}

    def variant_record(self) -> dict:
        s, c = self.spec, self.kv_cfg
        per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * KV_DTYPES[c["dtype"]][2]
        rec = {"dtype": c["dtype"], "attention": "GroupQueryAttention (shared buffer)",
               "bytes_per_token": int(per_token),
               "fp32_bytes_per_token": int(2 * s.num_layers * s.num_kv_heads * s.head_dim * 4)}
        if c["dtype"] == "int8":
            rec["quantization"] = {
                "k": "per channel (layer, KV head, channel), static; rotary-pair norm max / 127",
                "v": "per channel (layer, KV head, channel), static; abs max / 127",
                "k_scale_range": [float(c["k_scale"].min()), float(c["k_scale"].max())],
                "v_scale_range": [float(c["v_scale"].min()), float(c["v_scale"].max())]}
        return rec


__all__ = ["KVCacheMixin", "check_kv_spec", "KV_DTYPES"]
