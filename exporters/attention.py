"""Self-attention of the decoder graph: rotary tables, ``GroupQueryAttention``, standard ops,
sliding windows and the ring cache of local layers.

:class:`AttentionMixin` is the part of :class:`~exporters.decoder.DecoderBuilder` that
builds each layer's attention from the normed hidden states to the ``o_proj`` output.

* Full-attention layers: ``GroupQueryAttention`` with rotary inside and the shared KV
  buffer (fused graphs), or rotary + causal mask + softmax in standard ops over a
  concatenated cache (plain graphs).
* Sliding-window layers (``spec.layer_types[i] == "sliding_attention"``, Gemma 3's local
  layers): a query at position ``q`` sees the keys at ``q - window < p <= q`` (transformers'
  sliding-window mask), rotary with the local base (``spec.local_inv_freq``). Their cache
  is ``opts.local_kv``:

  - ``"full"``: the cache of every layer spans the context; fused graphs pass
    ``local_window_size = window`` to ``GroupQueryAttention`` (onnxruntime 1.32's CPU
    kernel then attends to ``window`` keys, the query's own included: tested against
    transformers on a tiny Gemma 3; onnxruntime-genai's Gemma builder passes the same);
  - ``"ring"``: the layer keeps only its window. Plain graphs: ``present`` is the last
    ``window`` positions of ``past ++ new`` (``[B, KV, min(past + S, window), D]``), the
    attention mask's last columns say which are real. Fused graphs: ``past_key_values.i.*``
    is a ring ``[B, KV, window, D]`` whose slot ``p mod window`` holds position ``p``
    (keys after rotary), ``present.i.*`` are the step's new rows ``[B, KV, S, D]`` only:
    the runtime writes them into the ring (``runtime.kv_cache.RingKVCache``). Positions
    come from ``seqlens_k`` / ``total_sequence_length`` exactly as ``GroupQueryAttention``
    reads them (a pass whose ``total_sequence_length`` equals its length is a first
    prompt: past 0, rows right-padded; otherwise row ``b``'s past is
    ``seqlens_k[b] + 1 - S``).

A family with QK-norm (``has_qk_norm``; Gemma 3) overrides :meth:`AttentionMixin.apply_qk_norm`,
which sees ``q [B,S,N*D]`` and ``k [B,S,KV*D]`` before rotary.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
from onnx import TensorProto

from .graph import MS_DOMAIN

#: the largest slice end (``Slice`` clamps it to the axis length)
END = 2 ** 62


def rope_limit(rp: dict, cfg, mpe: int) -> Optional[tuple]:
    """``(positions, why)`` past which static rotary tables stop matching the model: rope
    types whose frequencies change with the sequence length (``dynamic``, ``longrope``);
    ``None`` for the others. ``rp`` is one rope-parameters dict of the config."""
    rtype = rp.get("rope_type", rp.get("type"))
    if rtype in ("dynamic", "longrope"):
        orig = rp.get("original_max_position_embeddings") or \
            getattr(cfg, "original_max_position_embeddings", None) or mpe
        return int(orig), f"rope_type '{rtype}' changes its frequencies past {int(orig)} positions"
    return None


class AttentionMixin:
    """Attention of :class:`~exporters.decoder.DecoderBuilder` (reads ``self.g``,
    ``self.spec``, ``self.opts``, ``self.fused``; keeps its shared tables in ``self._rope``
    (full-attention layers), ``self._local`` and ``self._ring``)."""

    #: the family normalizes q and k per head before rotary (:meth:`apply_qk_norm`)
    has_qk_norm = False

    # ------------------------------------------------------------- settings
    def attention_scale(self) -> float:
        """Softmax scale of the scores: ``spec.attn_scale``, else ``1 / sqrt(head_dim)``."""
        s = self.spec
        return s.attn_scale if s.attn_scale is not None else 1.0 / math.sqrt(s.head_dim)

    def ring_layer(self, i: int) -> bool:
        """Whether layer ``i`` keeps only its window in the cache (``local_kv="ring"``)."""
        return self.opts.local_kv == "ring" and self.spec.is_sliding(i)

    def rope_tables(self, length: int, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``cos, sin float [length, head_dim/2]`` with the model's inv_freq (+ scaling);
        ``local``: the sliding-window layers' frequencies."""
        s = self.spec
        inv, a = (s.local_inv_freq, s.local_attention_scaling) if local else \
            (s.inv_freq, s.attention_scaling)
        t = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
        return (np.cos(t) * a).astype(self.fdtype), (np.sin(t) * a).astype(self.fdtype)

    def apply_qk_norm(self, i: int, q: str, k: str, name: str) -> tuple[str, str]:
        """``(q, k)`` of layer ``i`` before rotary (identity here; QK-norm families
        override it)."""
        return q, k

    # ------------------------------------------------------------ attention
    def build_attention(self, i: int, layer, h: str) -> str:
        """Self-attention of layer ``i`` on normed hidden ``h [B,S,H]`` -> ``[B,S,H]``."""
        g, s = self.g, self.spec
        pre = f"model.layers.{i}.self_attn"
        name = f"layers.{i}.attn"
        qkv = [f"{pre}.q_proj", f"{pre}.k_proj", f"{pre}.v_proj"]
        if self.fused:
            packed = self.linear(h, qkv, name + ".qkv_proj")
            if not (self.has_qk_norm or self.ring_layer(i)):
                attn = self.gqa(i, packed, "", "", name)
            else:
                N, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
                q, k, v = g.split(packed, [N * D, KV * D, KV * D], axis=-1, name=name + "/qkv")
                q, k = self.apply_qk_norm(i, q, k, name)
                attn = self.ring_attention(i, q, k, v, name) if self.ring_layer(i) else \
                    self.gqa(i, q, k, v, name)
        else:
            q = self.linear(h, qkv[:1], name + ".q_proj", )
            k = self.linear(h, qkv[1:2], name + ".k_proj", )
            v = self.linear(h, qkv[2:], name + ".v_proj", )
            q, k = self.apply_qk_norm(i, q, k, name)
            attn = self.plain_attention(i, q, k, v, name)
        return self.linear(attn, [f"{pre}.o_proj"], name + ".o_proj")

    def gqa(self, i: int, q: str, k: str, v: str, name: str) -> str:
        """``GroupQueryAttention`` with rotary and the shared KV buffer of layer ``i``
        (a sliding-window layer: its window and local rotary tables)."""
        g, s = self.g, self.spec
        local = s.is_sliding(i)
        if local:
            if self._local is None:
                cos, sin = self.rope_tables(self.opts.max_length, local=True)
                self._local = (g.initializer("cos_cache_local", cos),
                               g.initializer("sin_cache_local", sin))
            tables = self._local
        else:
            if self._rope is None:
                cos, sin = self.rope_tables(self.opts.max_length)
                self._rope = (g.initializer("cos_cache", cos), g.initializer("sin_cache", sin))
            tables = self._rope
        pk, pv, ok, ov = self.kv_names(i)
        extra, attrs = self.gqa_cache_options(i)
        out = g.node("GroupQueryAttention",
                     [q, k, v, pk, pv, "seqlens_k", "total_sequence_length", *tables, *extra],
                     n_out=3, name=name, domain=MS_DOMAIN,
                     outputs=[g.unique(name + "/out"), ok, ov],
                     num_heads=s.num_heads, kv_num_heads=s.num_kv_heads, do_rotary=1,
                     rotary_interleaved=0, scale=self.attention_scale(),
                     local_window_size=s.sliding_window if local else None,
                     softcap=s.attn_softcap or None, **attrs)
        ct = self.cache_type(i)
        g.output(ok, ct, ["batch_size", s.num_kv_heads, "max_length", self.key_head_dim(i)])
        g.output(ov, ct, ["batch_size", s.num_kv_heads, "max_length", s.head_dim])
        return out[0]

    def cache_type(self, i: int) -> int:
        """ONNX element type of layer ``i``'s KV cache (the model's float type here; a
        KV-cache variant, ``exporters.kvcache``, stores float16 or int8)."""
        return self.ftype

    def gqa_cache_options(self, i: int) -> tuple[list, dict]:
        """``(extra inputs, extra attributes)`` of layer ``i``'s ``GroupQueryAttention``
        after the rotary tables (none here; ``exporters.kvcache`` adds the int8 cache's
        ``k_scale`` / ``v_scale`` inputs and quantization attributes)."""
        return [], {}

    # ------------------------------------------------------- plain attention
    def _plain_tables(self, positions: str, local: bool) -> tuple[str, str]:
        """Rotary ``cos, sin [B,1,S,D]`` (rotate-half layout) gathered at ``positions``."""
        g = self.g
        cos, sin = self.rope_tables(self.opts.max_length, local=local)
        cos = np.concatenate([cos, cos], -1)
        sin = np.concatenate([sin, sin], -1)
        sfx = "_local" if local else ""
        c = g.gather(g.initializer("cos_cache" + sfx, cos), positions, name="rope" + sfx + "/cos")
        sn = g.gather(g.initializer("sin_cache" + sfx, sin), positions, name="rope" + sfx + "/sin")
        return g.unsqueeze(c, [1]), g.unsqueeze(sn, [1])                   # [B,1,S,D]

    def _additive(self, allowed: str, name: str) -> str:
        """``0`` where ``allowed``, a large negative number elsewhere (the model's dtype)."""
        g = self.g
        neg = -1e4 if self.fdtype == np.float16 else -1e9
        return g.node("Where", [allowed, g.const(0.0, self.fdtype), g.const(neg, self.fdtype)],
                      name=name)

    def _plain_rope_and_mask(self):
        g = self.g
        c, sn = self._plain_tables("position_ids", local=False)
        # additive mask [B,1,S,T]: key valid and key index <= past + query index
        T = g.shape("attention_mask", 1, 2, name="mask/T")
        S = g.shape("input_ids", 1, 2, name="mask/S")
        P = g.sub(T, S, name="mask/P")
        sq = lambda t: g.squeeze(t, [0])  # noqa: E731
        qpos = g.node("Range", [sq(P), sq(T), g.const(1)], name="mask/qpos")
        kpos = g.node("Range", [g.const(0), sq(T), g.const(1)], name="mask/kpos")
        causal = g.node("LessOrEqual", [g.unsqueeze(kpos, [0]), g.unsqueeze(qpos, [1])],
                        name="mask/causal")                                 # [S,T]
        valid = g.cast(g.unsqueeze("attention_mask", [1, 2]), TensorProto.BOOL)  # [B,1,1,T]
        allowed = g.node("And", [causal, valid], name="mask/allowed")        # [B,1,S,T]
        self._rope = (c, sn, self._additive(allowed, "mask/additive"))

    def _plain_local_tables(self, i: int):
        """Rotary tables and the sliding-window mask ``[B,1,S,Lb+S]`` of the local layers
        (``Lb``: cached positions of layer ``i``'s past, the whole past or its last window):
        key column ``c`` (of the attention mask) is seen by query column ``t`` when it is
        real, ``c <= t`` and ``t - c < window``."""
        if self._local is not None:
            return self._local
        g, W = self.g, self.spec.sliding_window
        c, sn = self._plain_tables("position_ids", local=True)
        T = g.shape("attention_mask", 1, 2, name="local_mask/T")
        S = g.shape("input_ids", 1, 2, name="local_mask/S")
        P = g.sub(T, S, name="local_mask/P")
        Lb = g.shape(self.kv_names(i)[0], 2, 3, name="local_mask/Lb")
        k0 = g.sub(P, Lb, name="local_mask/first_key")
        sq = lambda t: g.squeeze(t, [0])  # noqa: E731
        qpos = g.unsqueeze(g.node("Range", [sq(P), sq(T), g.const(1)], name="local_mask/qpos"), [1])
        kpos = g.unsqueeze(g.node("Range", [sq(k0), sq(T), g.const(1)], name="local_mask/kpos"), [0])
        causal = g.node("LessOrEqual", [kpos, qpos], name="local_mask/causal")      # [S,Lb+S]
        near = g.node("Less", [g.sub(qpos, kpos), g.const(W)], name="local_mask/window")
        cols = g.slice("attention_mask", k0, [END], [1], name="local_mask/columns")  # [B,Lb+S]
        valid = g.cast(g.unsqueeze(cols, [1, 2]), TensorProto.BOOL)
        allowed = g.node("And", [g.node("And", [causal, near]), valid], name="local_mask/allowed")
        self._local = (c, sn, self._additive(allowed, "local_mask/additive"))
        return self._local

    def _apply_rope(self, x: str, name: str, tables=None) -> str:
        g, d = self.g, self.spec.head_dim
        c, sn = (tables or self._rope)[:2]
        x1 = g.slice(x, [0], [d // 2], [3])
        x2 = g.slice(x, [d // 2], [d], [3])
        rot = g.concat([g.node("Neg", [x2]), x1], axis=3, name=name + "/rotate_half")
        return g.add(g.mul(x, c), g.mul(rot, sn), name=name)

    def _scores(self, q: str, k_t: str, name: str) -> str:
        """``q @ k_t * scale`` (+ the family's soft-cap ``cap * tanh(x / cap)``)."""
        g = self.g
        scores = g.mul(g.matmul(q, k_t, name=name + "/qk"),
                       g.const(self.attention_scale(), self.fdtype))
        cap = self.spec.attn_softcap
        if cap:
            t = g.node("Tanh", [g.mul(scores, g.const(1.0 / cap, self.fdtype))], name=name + "/softcap")
            scores = g.mul(t, g.const(cap, self.fdtype))
        return scores

    def plain_attention(self, i: int, q: str, k: str, v: str, name: str) -> str:
        """Standard-op attention with a concatenated cache (``present = past ++ new``; a
        ring local layer keeps the last ``window`` positions of it)."""
        g, s = self.g, self.spec
        local = s.is_sliding(i)
        if local:
            tables = self._plain_local_tables(i)
        else:
            if self._rope is None:
                self._plain_rope_and_mask()
            tables = self._rope
        N, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        bhsd = lambda x, n: g.transpose(g.reshape(x, [0, 0, n, D]), [0, 2, 1, 3])  # noqa: E731
        q = self._apply_rope(bhsd(q, N), name + "/q_rope", tables)
        k = self._apply_rope(bhsd(k, KV), name + "/k_rope", tables)
        v = bhsd(v, KV)
        pk, pv, ok, ov = self.kv_names(i)
        if self.ring_layer(i):
            k_all = g.concat([pk, k], axis=2, name=name + "/all_k")
            v_all = g.concat([pv, v], axis=2, name=name + "/all_v")
            for src, out in ((k_all, ok), (v_all, ov)):
                g.node("Slice", [src, g.const([-s.sliding_window]), g.const([END]), g.const([2])],
                       outputs=[out], name=out + "/window")
            length = "present_window_length"
        else:
            k_all = g.node("Concat", [pk, k], outputs=[ok], name=name + "/present_k", axis=2)
            v_all = g.node("Concat", [pv, v], outputs=[ov], name=name + "/present_v", axis=2)
            length = "total_sequence_length"
        g.output(ok, self.ftype, ["batch_size", KV, length, self.key_head_dim(i)])
        g.output(ov, self.ftype, ["batch_size", KV, length, D])
        rep = N // KV
        if rep > 1:
            exp = g.const([1, 1, rep, 1, 1])
            k_all = g.reshape(g.node("Expand", [g.unsqueeze(k_all, [2]), exp]), [0, N, -1, D])
            v_all = g.reshape(g.node("Expand", [g.unsqueeze(v_all, [2]), exp]), [0, N, -1, D])
        scores = g.add(self._scores(q, g.transpose(k_all, [0, 1, 3, 2]), name), tables[2])
        probs = g.node("Softmax", [scores], name=name + "/softmax", axis=-1)
        ctx = g.matmul(probs, v_all, name=name + "/pv")
        return g.reshape(g.transpose(ctx, [0, 2, 1, 3]), [0, 0, N * D], name=name + "/merge")

    # ------------------------------------------------------ ring attention
    def _ring_tables(self):
        """Positions, local rotary tables and the mask ``[B,1,S,W+S]`` shared by the
        fused graph's ring layers (see the module docstring for the slot convention)."""
        if self._ring is not None:
            return self._ring
        g, W = self.g, self.spec.sliding_window
        i64 = lambda x: g.cast(x, TensorProto.INT64)  # noqa: E731
        S = g.shape("input_ids", 1, 2, name="ring/S")                              # [1]
        total = i64(g.unsqueeze("total_sequence_length", [0]))                   # [1]
        first = g.node("Equal", [total, S], name="ring/first_prompt")
        seen = g.add(i64("seqlens_k"), g.sub(g.const([1]), S), name="ring/past_after")
        past = g.node("Where", [first, g.const([0]), seen], name="ring/past")    # [B]
        steps = g.node("Range", [g.const(0), g.squeeze(S, [0]), g.const(1)], name="ring/steps")
        pos = g.add(g.unsqueeze(past, [1]), g.unsqueeze(steps, [0]), name="ring/positions")  # [B,S]
        c, sn = self._plain_tables(pos, local=True)
        # slot j holds the latest position p < past with p = j (mod W); none when p < 0
        last = g.sub(g.unsqueeze(past, [1]), g.const([[1]]), name="ring/last")     # [B,1]
        slots = g.const(np.arange(W, dtype=np.int64)[None, :])
        back = g.node("Mod", [g.add(g.sub(last, slots), g.const(W)), g.const(W)], name="ring/back")
        held = g.sub(last, back, name="ring/slot_positions")                        # [B,W]
        qpos = g.unsqueeze(pos, [2])                                                # [B,S,1]
        kpos = g.unsqueeze(held, [1])                                               # [B,1,W]
        ring_ok = g.node("And", [g.node("GreaterOrEqual", [kpos, g.const(0)]),
                                 g.node("Less", [g.sub(qpos, kpos), g.const(W)])],
                         name="ring/ring_allowed")                                   # [B,S,W]
        sq, sk = g.unsqueeze(steps, [1]), g.unsqueeze(steps, [0])
        new_ok = g.node("And", [g.node("LessOrEqual", [sk, sq]),
                                g.node("Less", [g.sub(sq, sk), g.const(W)])],
                        name="ring/new_allowed")                                     # [S,S]
        row = g.node("GreaterOrEqual", [g.unsqueeze(past, [1, 2]), g.const(0)])     # [B,1,1]
        new_ok = g.node("And", [new_ok, row], name="ring/new_allowed_rows")          # [B,S,S]
        allowed = g.concat([ring_ok, new_ok], axis=-1, name="ring/allowed")
        mask = g.unsqueeze(self._additive(allowed, "ring/additive"), [1])          # [B,1,S,W+S]
        self._ring = (c, sn, mask)
        return self._ring

    def ring_attention(self, i: int, q: str, k: str, v: str, name: str) -> str:
        """Sliding-window attention of ring layer ``i`` (fused graph): scores over the
        ring ``[B,KV,W,D]`` and the step's own keys, one softmax, the new rotated keys and
        values as ``present.i.*`` ``[B,KV,S,D]`` (module docstring)."""
        g, s = self.g, self.spec
        c, sn, mask = self._ring_tables()
        N, KV, D, W = s.num_heads, s.num_kv_heads, s.head_dim, s.sliding_window
        bhsd = lambda x, n: g.transpose(g.reshape(x, [0, 0, n, D]), [0, 2, 1, 3])  # noqa: E731
        q = self._apply_rope(bhsd(q, N), name + "/q_rope", (c, sn))
        pk, pv, ok, ov = self.kv_names(i)
        k = self._apply_rope(bhsd(k, KV), name + "/k_rope", (c, sn))
        g.node("Identity", [k], outputs=[ok], name=name + "/present_k")
        g.node("Identity", [bhsd(v, KV)], outputs=[ov], name=name + "/present_v")
        for o in (ok, ov):
            g.output(o, self.ftype, ["batch_size", KV, "sequence_length", D])
        # query heads of one KV head side by side: [B,KV,rep*S,D] (no K/V copy per head)
        qg = g.reshape(q, [0, KV, -1, D], name=name + "/q_groups")
        per_head = lambda x: g.reshape(x, [0, N, -1, 0])  # noqa: E731   [B,KV,rep*S,T] -> [B,N,S,T]
        s_ring = per_head(self._scores(qg, g.transpose(pk, [0, 1, 3, 2]), name + "/ring"))
        s_new = per_head(self._scores(qg, g.transpose(ok, [0, 1, 3, 2]), name + "/new"))
        scores = g.add(g.concat([s_ring, s_new], axis=-1, name=name + "/scores"), mask)
        probs = g.node("Softmax", [scores], name=name + "/softmax", axis=-1)
        p_ring, p_new = g.node("Split", [probs, g.concat([g.const([W]), g.shape(ok, 2, 3)], 0)],
                               n_out=2, axis=-1, name=name + "/split_probs")
        grouped = lambda p: g.reshape(p, [0, KV, -1, 0])  # noqa: E731
        ctx = g.add(g.matmul(grouped(p_ring), pv, name=name + "/pv_ring"),
                    g.matmul(grouped(p_new), ov, name=name + "/pv_new"), name=name + "/ctx")
        ctx = g.reshape(ctx, [0, N, -1, D])                                          # [B,N,S,D]
        return g.reshape(g.transpose(ctx, [0, 2, 1, 3]), [0, 0, N * D], name=name + "/merge")

    # ---------------------------------------------------------------- I/O
    def past_length_dim(self, i: int, default: str):
        """The past cache's length axis of layer ``i`` (``default`` unless a ring)."""
        if not self.ring_layer(i):
            return default
        return self.spec.sliding_window if self.fused else "past_window_length"


__all__ = ["AttentionMixin", "END", "rope_limit"]
