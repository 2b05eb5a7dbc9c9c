"""ONNX decoder whose key cache keeps only LeanK's kept key channels (LeanK, EMNLP 2025).

The mask comes as the JSON dict of ``edgeprune.leank.LeanKMask.to_dict()`` (this package
does not import ``edgeprune``): ``keep[layer][kv_head]`` = kept post-rotary channels,
``scales`` the matching query-channel multipliers, ``head_dim``.

Cache layout (batch rows must have equal lengths; positions are derived in the graph)
    Per layer ``i`` four cache tensors (inputs ``past_*``, outputs ``present_*``):

    * ``past_key_values.{i}.key  [B, 1, T_mid, W_i]``: the pruned middle of the key cache.
      The kept channels of the layer's KV heads are concatenated head after head
      (``W_i = sum_h kept_h``), so ragged per-head widths waste no byte: K-cache bytes of
      the middle are exactly ``kept / (KV * D)`` of dense.
    * ``past_key_values.{i}.value [B, A_i, T_mid, D]``: middle values of the ``A_i`` heads
      that keep at least one channel (dead heads drop their middle V).
    * ``past_full.{i}.key / .value [B, KV, T_full, D]``: full keys/values of the first
      ``sink`` tokens followed by the most recent ``window`` tokens
      (``T_full <= sink + window``).

    Each step appends the new tokens' keys/values to the full part; tokens that leave the
    window are moved to the middle (keys gathered to the kept channels). A new token's
    position is ``T_mid + T_full + s``: no ``position_ids`` / ``attention_mask`` inputs.

Attention (standard ONNX ops; the contrib ``GroupQueryAttention`` needs equal K/V head
sizes, so it cannot run on pruned keys). Per layer, with ``q`` rotated in full and scaled
by ``1/sqrt(D)``:

    * middle:   ``Q' = q @ P_i`` (``P_i [N, D, W_i]`` one-hot with the mask's scales: each
      query head's kept channels land at its KV head's block), then one GEMM
      ``Q' [B, 1, N*S, W_i] x K_mid^T`` (dead heads masked to -1e9);
    * full part (sink + window + new): full-channel scores; for keys that are, for a given
      query, neither sink nor within ``window`` (possible inside a long prefill chunk) the
      pruned-channel scores replace them, exactly as the torch reference does;
    * one softmax over ``[middle | full part]``; values per part.

Inputs: ``input_ids int64 [B, S]``, ``num_logits_to_keep int64 []`` + the caches.
The linears, norms and embedding come from the base builder (``graph="fused"``:
``MatMulNBits`` int4 and fused norms; ``"plain"``: standard ops).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from edgeprune_runtime.errors import ExportError

from .variants import VariantMixin, register_export_variant

NEG = -1e9


def check_mask(mask: dict, spec) -> dict:
    """Validate a LeanK spec dict against a :class:`~exporters.decoder.DecoderSpec`.

    Raises:
        ExportError: not a LeanK mask, geometry mismatch, bad or missing sink/window.
    """
    if not isinstance(mask, dict) or "keep" not in mask or "head_dim" not in mask:
        raise ExportError("leank spec is not a LeanKMask dict",
                          "pass edgeprune.leank.LeanKMask (or a file from `edgeprune leank`)")
    keep = mask["keep"]
    if len(keep) != spec.num_layers or any(len(l) != spec.num_kv_heads for l in keep) or \
            int(mask["head_dim"]) != spec.head_dim:
        raise ExportError(f"leank mask geometry ({len(keep)} layers x {len(keep[0])} KV heads "
                          f"x {mask['head_dim']}) does not match the model ({spec.num_layers} x "
                          f"{spec.num_kv_heads} x {spec.head_dim})",
                          "use a mask learned on this model")
    for n in ("sink", "window"):
        v = mask.get(n)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ExportError(f"leank {n}={v!r} must be a non-negative integer",
                              "load the mask with edgeprune.variants.load_spec (it fills in "
                              "the sink and window), or set e.g. sink=64, window=448")
    if all(len(h) == 0 for l in keep for h in l):
        raise ExportError("leank mask keeps no key channel at all", "use a larger k_keep")
    return mask


@register_export_variant("leank")
class LeanKMixin(VariantMixin):
    """Builder mixin: LeanK attention and caches (see the module docstring).

    Its spec dict is ``edgeprune.leank.LeanKMask.to_dict()``: ``keep``, ``scales``,
    ``head_dim``, ``sink`` and ``window`` (tokens kept with full keys), ``meta``...

    Raises:
        ExportError: the mask does not fit the model (:func:`check_mask`), or its
            sink + window cover the whole context (nothing would be pruned).
    """

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        self.leank_mask = check_mask(opts.variants["leank"], spec)
        self.leank_sink = int(self.leank_mask["sink"])
        self.leank_window = int(self.leank_mask["window"])
        if self.leank_sink + self.leank_window >= int(opts.max_length):
            raise ExportError(f"LeanK sink + window = {self.leank_sink} + {self.leank_window} "
                              f"tokens cover the whole context (max_length={opts.max_length}): "
                              "no key would be pruned",
                              f"give the mask a sink and window summing to less than "
                              f"{opts.max_length} (`edgeprune leank --sink N --window N`), or "
                              "export with a larger --max-length")

    # ------------------------------------------------------------------ export
    @property
    def shares_kv_buffer(self) -> bool:
        return False

    @property
    def genai_loadable(self) -> bool:
        return False            # four caches per layer: onnxruntime-genai feeds two

    def parity_tokens(self, tokens: int) -> int:
        # within sink + window nothing is pruned: the graph must equal the dense model
        # (the pruned path is tested against edgeprune.leank.apply_reference)
        n = self.leank_sink + self.leank_window
        return min(tokens, n) if n > 0 else tokens

    def variant_record(self) -> dict:
        return leank_metadata(self.leank_mask, self.leank_sink, self.leank_window)

    # -------------------------------------------------------------- geometry
    def _lk_layer(self, i):
        keep = self.leank_mask["keep"][i]
        scales = self.leank_mask["scales"][i]
        widths = [len(h) for h in keep]
        alive = [h for h, w in enumerate(widths) if w > 0]
        return keep, scales, widths, alive

    def key_head_dim(self, i: int) -> int:
        """Width of layer ``i``'s middle key cache: its KV heads' kept channels, summed."""
        return int(sum(len(h) for h in self.leank_mask["keep"][i]))

    # ------------------------------------------------------------------- I/O
    def build_inputs(self):
        """``input_ids``, ``num_logits_to_keep`` and the four caches of each layer (no
        positions or mask: they are derived from the cache lengths)."""
        g, s = self.g, self.spec
        g.input("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
        g.input("num_logits_to_keep", TensorProto.INT64, [])
        for i in range(s.num_layers):
            _, _, widths, alive = self._lk_layer(i)
            g.input(f"past_key_values.{i}.key", self.ftype,
                    ["batch_size", 1, "past_middle_length", int(sum(widths))])
            g.input(f"past_key_values.{i}.value", self.ftype,
                    ["batch_size", len(alive), "past_middle_length", s.head_dim])
            g.input(f"past_full.{i}.key", self.ftype,
                    ["batch_size", s.num_kv_heads, "past_full_length", s.head_dim])
            g.input(f"past_full.{i}.value", self.ftype,
                    ["batch_size", s.num_kv_heads, "past_full_length", s.head_dim])
        self._present_shape = "present_middle_length"
        self._lk = None

    def io_metadata(self) -> dict:
        """The LeanK cache layout for ``edgeprune.json``'s ``kv_layout``."""
        s = self.spec
        return {
            "buffer": "leank: pruned middle (concat) + full sink/window caches; see leank.layout",
            "inputs": ["input_ids", "num_logits_to_keep"],
            "past_key": {"name": "past_key_values.%d.key",
                         "shape": ["batch_size", 1, "past_middle_length", "key_width"],
                         "key_width": [self.key_head_dim(i) for i in range(s.num_layers)],
                         "note": "pruned middle: kept channels of all KV heads concatenated"},
            "past_value": {"name": "past_key_values.%d.value",
                           "shape": ["batch_size", "alive_kv_heads", "past_middle_length",
                                     s.head_dim],
                           "alive_kv_heads": [len(self._lk_layer(i)[3])
                                              for i in range(s.num_layers)]},
            "past_full_key": {"name": "past_full.%d.key",
                              "shape": ["batch_size", s.num_kv_heads, "past_full_length",
                                        s.head_dim]},
            "past_full_value": {"name": "past_full.%d.value",
                                "shape": ["batch_size", s.num_kv_heads, "past_full_length",
                                          s.head_dim]},
            "present": "present.%d.key/value, present_full.%d.key/value (same layouts)",
            "logits": {"name": "logits",
                       "shape": ["batch_size", "num_logits_to_keep", s.vocab_size]},
        }

    # ------------------------------------------------ shared position logic
    def _lk_positions(self):
        """Scalars, positions, region masks and rotary tables shared by all layers."""
        if self._lk is not None:
            return self._lk
        g, s = self.g, self.spec
        sink, window = int(self.leank_sink), int(self.leank_window)
        ref = next((i for i in range(s.num_layers) if self.key_head_dim(i) > 0), 0)
        c = lambda v: g.const(v)  # noqa: E731
        Tm = g.shape(f"past_key_values.{ref}.key", 2, 3, name="lk/Tm")          # [1]
        Tf = g.shape("past_full.0.key", 2, 3, name="lk/Tf")
        S = g.shape("input_ids", 1, 2, name="lk/S")
        Lp = g.add(Tm, Tf, name="lk/L_past")
        Ln = g.add(Lp, S, name="lk/L_new")
        Tc = g.add(Tf, S, name="lk/Tc")
        mn = lambda a, b, n: g.node("Min", [a, b], name=n)  # noqa: E731
        mx = lambda a, b, n: g.node("Max", [a, b], name=n)  # noqa: E731
        ns_p = mn(c([sink]), Tf, "lk/ns_past")
        nr_p = g.sub(Tf, ns_p, name="lk/nr_past")
        ns_n = mn(c([sink]), Ln, "lk/ns_new")
        nr_n = mn(c([window]), g.sub(Ln, ns_n), "lk/nr_new")
        e = mx(g.sub(g.sub(g.sub(Ln, ns_n), nr_n), Tm), c([0]), "lk/evicted")
        ev_end = g.add(ns_n, e, name="lk/ev_end")
        sq = lambda t: g.squeeze(t, [0])  # noqa: E731
        rng = lambda a, b, n: g.node("Range", [sq(a), sq(b), g.const(1)], name=n)  # noqa: E731
        qpos = rng(Lp, Ln, "lk/qpos")                                          # [S]
        kpos = g.concat([rng(c([0]), ns_p, "lk/kpos_sink"),
                         rng(g.sub(Lp, nr_p), Ln, "lk/kpos_recent")], axis=0,
                        name="lk/kpos")                                          # [Tc]
        kp = g.unsqueeze(kpos, [0])                                              # [1,Tc]
        qp = g.unsqueeze(qpos, [1])                                              # [S,1]
        allowed = g.node("LessOrEqual", [kp, qp], name="lk/causal")              # [S,Tc]
        is_sink = g.node("Less", [kp, c(sink)], name="lk/is_sink")
        recent = g.node("Greater", [kp, g.sub(qp, c(window))], name="lk/is_recent")
        full = g.node("Or", [is_sink, recent], name="lk/full_region")            # [S,Tc]
        neg = NEG if self.fdtype == np.float32 else -1e4
        zero = g.const(0.0, self.fdtype)
        cmask = g.node("Where", [allowed, zero, g.const(neg, self.fdtype)],
                       name="lk/causal_add")                                     # [S,Tc]
        # rotary tables [max_len, D] (rotate-half layout), gathered at the positions
        cos, sin = self.rope_tables(self.opts.max_length)
        cos = np.concatenate([cos, cos], -1)
        sin = np.concatenate([sin, sin], -1)
        cg = g.unsqueeze(g.gather(g.initializer("lk_cos_cache", cos), qpos), [0, 1])
        sg = g.unsqueeze(g.gather(g.initializer("lk_sin_cache", sin), qpos), [0, 1])
        split_sizes = g.concat([Tm, Tc], axis=0, name="lk/split_sizes")
        self._lk = dict(Tm=Tm, Tc=Tc, ns_n=ns_n, ev_end=ev_end, full=full, cmask=cmask,
                        cos=cg, sin=sg, split=split_sizes, S=S, neg=neg)
        return self._lk

    def _lk_rope(self, x, name):
        g, d = self.g, self.spec.head_dim
        P = self._lk
        x1 = g.slice(x, [0], [d // 2], [3])
        x2 = g.slice(x, [d // 2], [d], [3])
        rot = g.concat([g.node("Neg", [x2]), x1], axis=3, name=name + "/rotate_half")
        return g.add(g.mul(x, P["cos"]), g.mul(rot, P["sin"]), name=name)

    # ------------------------------------------------------------ attention
    def build_attention(self, i: int, layer, h: str) -> str:
        """Projections (fused or not, as the base graph) around :meth:`leank_attention`."""
        g, s = self.g, self.spec
        pre = f"model.layers.{i}.self_attn"
        name = f"layers.{i}.attn"
        qkv = [f"{pre}.q_proj", f"{pre}.k_proj", f"{pre}.v_proj"]
        N, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        if self.fused:
            packed = self.linear(h, qkv, name + ".qkv_proj")
            q, k, v = g.split(packed, [N * D, KV * D, KV * D], axis=-1, name=name + "/qkv")
        else:
            q = self.linear(h, qkv[:1], name + ".q_proj")
            k = self.linear(h, qkv[1:2], name + ".k_proj")
            v = self.linear(h, qkv[2:], name + ".v_proj")
        attn = self.leank_attention(i, q, k, v, name)
        return self.linear(attn, [f"{pre}.o_proj"], name + ".o_proj")

    def leank_attention(self, i: int, q: str, k: str, v: str, name: str) -> str:
        """Layer ``i``'s attention on ``q/k/v [B, S, heads*D]`` with the pruned middle and
        full sink/window caches (module docstring) -> ``[B, S, N*D]``."""
        g, s = self.g, self.spec
        P = self._lk_positions()
        N, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        rep = N // KV
        keep, scales, widths, alive = self._lk_layer(i)
        W = int(sum(widths))
        A = len(alive)
        dead_q = [n for n in range(N) if widths[n // rep] == 0]
        bhsd = lambda x, n: g.transpose(g.reshape(x, [0, 0, n, D]), [0, 2, 1, 3])  # noqa: E731
        q = self._lk_rope(bhsd(q, N), name + "/q_rope")
        q = g.mul(q, g.const(1.0 / np.sqrt(D), self.fdtype), name=name + "/q_scale")
        k = self._lk_rope(bhsd(k, KV), name + "/k_rope")
        v = bhsd(v, KV)
        pmk, pmv = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        pfk, pfv = f"past_full.{i}.key", f"past_full.{i}.value"
        ck = g.concat([pfk, k], axis=2, name=name + "/cand_k")                   # [B,KV,Tc,D]
        cv = g.concat([pfv, v], axis=2, name=name + "/cand_v")
        shp_ns = g.concat([g.const([0, N]), P["S"], g.const([-1])], axis=0)     # [B,N,S,-1]
        # full-channel scores on the candidate (sink + window + new) keys
        qg = g.reshape(q, [0, KV, -1, D])                                        # [B,KV,rep*S,D]
        s_full = g.reshape(g.matmul(qg, g.transpose(ck, [0, 1, 3, 2])), shp_ns,
                           name=name + "/s_full")                                # [B,N,S,Tc]
        if W > 0:
            # P_i [N, D, W]: query head n's kept channels (with scales) at its block
            Pm = np.zeros((N, D, W), self.fdtype)
            off = np.cumsum([0] + widths)[:-1]
            flat = []
            for hh in range(KV):
                for j, (ch, sc) in enumerate(zip(keep[hh], scales[hh])):
                    for r in range(rep):
                        Pm[hh * rep + r, ch, off[hh] + j] = sc
                    flat.append(hh * D + ch)
            qp = g.matmul(q, g.initializer(f"{name}.leank_P", Pm), name=name + "/q_kept")
            qp = g.reshape(qp, [0, 1, -1, W])                                     # [B,1,N*S,W]
            # pruned keys of the candidates: [B,Tc,KV*D] -> gather -> [B,1,Tc,W]
            ckf = g.reshape(g.transpose(ck, [0, 2, 1, 3]), [0, 0, KV * D])
            ckp = g.unsqueeze(g.gather(ckf, g.const(flat, np.int64), axis=2,
                                       name=name + "/prune_k"), [1])
            s_cp = g.reshape(g.matmul(qp, g.transpose(ckp, [0, 1, 3, 2])), shp_ns,
                             name=name + "/s_cand_pruned")
            shp_mid = g.concat([g.const([0, N]), P["S"], P["Tm"]], axis=0)
            s_mid = g.reshape(g.matmul(qp, g.transpose(pmk, [0, 1, 3, 2])), shp_mid,
                              name=name + "/s_mid")                               # [B,N,S,Tm]
            if dead_q:
                bias = np.zeros((1, N, 1, 1), self.fdtype)
                bias[0, dead_q] = P["neg"]
                bname = g.initializer(f"{name}.leank_dead_bias", bias)
                s_cp = g.add(s_cp, bname)
                s_mid = g.add(s_mid, bname)
        else:
            s_cp = g.const(P["neg"], self.fdtype)
            s_mid = None
        s_c = g.add(g.node("Where", [P["full"], s_full, s_cp], name=name + "/region"),
                    P["cmask"], name=name + "/s_cand")
        if s_mid is not None:
            scores = g.concat([s_mid, s_c], axis=-1, name=name + "/scores")
            probs = g.node("Softmax", [scores], axis=-1, name=name + "/softmax")
            p_mid, p_c = g.node("Split", [probs, P["split"]], n_out=2, axis=-1,
                                name=name + "/split_probs")
        else:
            p_c = g.node("Softmax", [s_c], axis=-1, name=name + "/softmax")
        ctx = g.matmul(self._group(p_c, KV, name + "/pc"), cv, name=name + "/pv_cand")
        ctx = self._ungroup(ctx, N, name + "/ctx_c")                              # [B,N,S,D]
        if s_mid is not None:
            if dead_q:
                alive_q = [n for n in range(N) if n not in dead_q]
                p_mid = g.gather(p_mid, g.const(alive_q, np.int64), axis=1,
                                 name=name + "/p_mid_alive")
            cm = g.matmul(self._group(p_mid, A, name + "/pm"), pmv, name=name + "/pv_mid")
            cm = self._ungroup(cm, A * rep, name + "/ctx_m")                      # [B,A*rep,S,D]
            if dead_q:
                cm = g.node("Pad", [cm, g.const([0, 0, 0, 0, 0, rep, 0, 0])],
                            name=name + "/pad_dead")
                idx, a = [], 0
                for n in range(N):
                    if n in dead_q:
                        idx.append(A * rep + n % rep)
                    else:
                        idx.append(a)
                        a += 1
                cm = g.gather(cm, g.const(idx, np.int64), axis=1, name=name + "/scatter")
            ctx = g.add(ctx, cm, name=name + "/ctx")
        # caches: sink + window stay full; evicted tokens move to the pruned middle
        ok, ov = f"present.{i}.key", f"present.{i}.value"
        ofk, ofv = f"present_full.{i}.key", f"present_full.{i}.value"
        end = g.const([2 ** 62])
        for src, out in ((ck, ofk), (cv, ofv)):
            head = g.slice(src, g.const([0]), P["ns_n"], [2])
            tail = g.slice(src, P["ev_end"], end, [2])
            g.node("Concat", [head, tail], outputs=[out], axis=2, name=out + "/concat")
            g.output(out, self.ftype, ["batch_size", KV, "present_full_length", D])
        if W > 0:
            evk = g.slice(ckp, P["ns_n"], P["ev_end"], [2])
        else:
            # zero-width key cache: [B,1,Tc,0] -> evicted rows [B,1,e,0]
            evk = g.slice(g.slice(ck, [0], [1], [1]), [0], [0], [3])
            evk = g.slice(evk, P["ns_n"], P["ev_end"], [2])
        g.node("Concat", [pmk, evk], outputs=[ok], axis=2, name=ok + "/concat")
        cva = cv if A == KV else g.gather(cv, g.const(alive, np.int64), axis=1,
                                          name=name + "/v_alive")
        evv = g.slice(cva, P["ns_n"], P["ev_end"], [2])
        g.node("Concat", [pmv, evv], outputs=[ov], axis=2, name=ov + "/concat")
        g.output(ok, self.ftype, ["batch_size", 1, "present_middle_length", W])
        g.output(ov, self.ftype, ["batch_size", A, "present_middle_length", D])
        return g.reshape(g.transpose(ctx, [0, 2, 1, 3]), [0, 0, N * D], name=name + "/merge")

    def _group(self, p, groups, name):
        """``[B, G*rep, S, T] -> [B, G, rep*S, T]`` (T taken from the tensor)."""
        g = self.g
        T = g.shape(p, 3, 4, name=name + "/T")
        rs = g.mul(self._lk["S"], g.const([self.spec.num_heads // self.spec.num_kv_heads]))
        shp = g.concat([g.const([0, groups]), rs, T], axis=0, name=name + "/shape")
        return g.reshape(p, shp, name=name + "/group")

    def _ungroup(self, x, heads, name):
        """``[B, G, rep*S, D] -> [B, heads, S, D]``."""
        g = self.g
        shp = g.concat([g.const([0, heads]), self._lk["S"], g.const([self.spec.head_dim])],
                       axis=0, name=name + "/shape")
        return g.reshape(x, shp, name=name + "/ungroup")


def leank_metadata(mask: dict, sink: int, window: int) -> dict:
    """The ``leank`` entry of ``edgeprune.json``: the mask plus the cache settings."""
    keep = mask["keep"]
    D = int(mask["head_dim"])
    kept = sum(len(h) for l in keep for h in l)
    total = sum(len(l) for l in keep) * D
    return {**{k: v for k, v in mask.items() if k != "meta"},
            "sink": int(sink), "window": int(window),
            "k_middle_fraction": kept / total,
            "v_middle_fraction": sum(1 for l in keep for h in l if h) / sum(len(l) for l in keep),
            "layout": "past_key_values.i.key [B,1,T_mid,sum kept] (heads concatenated), "
                      "past_key_values.i.value [B,alive heads,T_mid,D], "
                      "past_full.i.key/value [B,KV,T_full<=sink+window,D]",
            "mask_meta": mask.get("meta", {})}


__all__ = ["LeanKMixin", "leank_metadata", "check_mask"]
