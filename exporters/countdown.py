"""COUNTDOWN in ONNX: a decode-time MLP that reads only the kept weight rows.

COUNTDOWN (Cheon et al., EMNLP 2025) keeps, per token, only the MLP coefficients
``c_j = act(gate_j(x)) * up_j(x)`` whose filter score passes a per-layer threshold
(M: ``|up(x) * f|`` with ``f [I]`` a static per-channel scale from calibration, or the
paper's ``|up(x)|``; D: ``|act(x Vg Ug) * (x Vu Uu)|``, a low-rank predictor). This module
turns a calibrated spec (``edgeprune.countdown.CountdownSpec`` as a dict: ``mode``,
``act_sparsity``, ``thresholds``, ``rank``, ``graph_mode``, ``stats``, and under
``"arrays"`` the predictor tensors ``layers.{i}.{name}``) into the MLP blocks of the
exported decoder: the builder mixin :class:`CountdownMixin`, registered as the graph
variant ``"countdown"``::

    exporters.export_onnx(model, tok, out, variants=[spec])                  # graph_mode "if"
    exporters.export_onnx(model, tok, out, variants=[(spec, {"graph_mode": "sparse"})])

Weight layout (so every selected unit is one *contiguous row*):

* ``gate`` and ``up`` stored ``[I, H]`` (PyTorch's own ``[out, in]`` layout); the dense
  path uses ``Gemm(x, W, transB=1)``, the sparse path ``Gather(W, idx, axis=0)`` rows;
* ``down`` stored transposed, ``W_down^T [I, H]``: the dense path is a plain ``MatMul``,
  the sparse path gathers rows (= the needed columns of ``W_down``).

No weight is stored twice in fp32/fp16.

Sparse MLP (per layer, ``x [T, H]``, ``T = batch * seq``)::

    score = |up(x) * f|  (M)   or   |act(x Vg Ug) * (x Vu Uu)|  (D)   [T, I]
    keep  = score > tau                                              [T, I]
    idx   = NonZero(ReduceMax(keep, over tokens))                    [k]   (union of rows)
    g     = Gemm(x, Gather(W_gate, idx), transB=1)                   [T, k]
    u     = Gather(up, idx, axis=1)  (M)  |  Gemm(x, Gather(W_up, idx), transB=1)  (D)
    y     = ((act(g) * u) * Gather(keep, idx, axis=1)) @ Gather(W_down^T, idx)    [T, H]

The per-token mask multiply makes the result exact per token even when several tokens
(a batch row or a teacher-forced window) share one union of rows, so the same graph
computes exactly the PyTorch reference at every position.

``graph_mode``:

* ``"if"`` (default): an ``If`` on ``batch_size * sequence_length == 1 and
  countdown.enabled``: single-sequence decode steps run sparse (a branch specialised to
  one token: no union, no per-token mask), prefill and batched decode run the dense path
  (the union of many tokens' masks is most rows, so sparsity does not pay there). ``countdown.enabled`` is a
  bool initializer the runtime can override to switch filtering off
  (``runtime.countdown.load(folder, countdown=False)``).
* ``"sparse"``: always sparse (every position filtered; used to score quality through
  ONNX and in the equality tests).
* ``"dense"``: never filtered, same weight layout (overhead baseline).

int4 (``precision="int4"`` or ``quantized``): ``MatMulNBits`` cannot gather rows, so the
sparse path uses ``GatherBlockQuantized`` (com.microsoft) on row-major 4-bit codes with
blocks of ``block_size`` along ``H``: the granularity of skipping stays one
intermediate unit (one row of gate/up/down^T), and a row is dequantized block by block.
gate/up rows are exactly the quantizer's codes (blocks along their input dim ``H``).
``down``'s quantization groups run along ``I`` (its input dim), which a row gather of
``W_down^T`` would cut, so ``W_down^T`` is re-quantized RTN asym along ``H`` in blocks
of ``group_size`` (from the already-quantized values); its quality effect is measured
by ``bench/countdown.py`` (case ``*-int4`` vs the unfiltered int4 export). The dense
(prefill) path keeps the original ``MatMulNBits`` codes, so int4 stores the MLP twice.

Every layer also emits its kept-row count; graph output ``countdown_kept int64 [L]``
(``I`` for dense layers) lets the runtime measure the fraction of MLP weight bytes read.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError

from .graph import MS_DOMAIN, GraphBuilder
from .int4 import IntWeight, pack_uint4, rtn_int
from .variants import VariantMixin, register_export_variant

GRAPH_MODES = ("if", "sparse", "dense")
KEPT_OUTPUT = "countdown_kept"
ENABLED_NAME = "countdown.enabled"


def _sub_builder(main: GraphBuilder) -> GraphBuilder:
    """A builder for an ``If`` branch: own node list, shared names/initializers/consts."""
    sub = GraphBuilder(main.name + "_branch", main.float_dtype)
    sub._names = main._names
    sub.initializers = main.initializers
    sub._consts = main._consts
    return sub


def check_spec(spec: dict, model) -> str:
    """Validate a COUNTDOWN spec dict against ``model``; returns the graph mode to build
    (``"dense"`` when ``act_sparsity`` is 0: nothing to skip, same weight layout).

    Raises:
        ExportError: not a COUNTDOWN spec, a layer count that differs from the model's,
            a D spec without predictors, an unknown ``graph_mode``.
        UnsupportedArchitectureError: an MLP without gate/up/down projections.
    """
    for a in ("mode", "act_sparsity", "thresholds"):
        if a not in spec:
            raise ExportError(f"countdown spec lacks '{a}'",
                              "pass edgeprune.countdown.calibrate(...)'s CountdownSpec, or a "
                              "file from `edgeprune countdown`")
    n = model.config.num_hidden_layers
    if len(spec["thresholds"]) != n:
        raise ExportError(f"countdown spec has {len(spec['thresholds'])} layers, the model {n}",
                          "calibrate the spec on this model")
    if spec["mode"] == "d" and float(spec["act_sparsity"]) > 0 and not predictor_arrays(spec, 0):
        raise ExportError("D-COUNTDOWN spec without predictors", "calibrate with mode='d'")
    mlp = model.model.layers[0].mlp
    if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        raise UnsupportedArchitectureError(
            f"{type(mlp).__name__} is not a gated MLP", "COUNTDOWN needs gate/up/down projections")
    mode = spec.get("graph_mode") or "if"
    if mode not in GRAPH_MODES:
        raise ExportError(f"countdown graph_mode={mode!r} is unknown",
                          f"use one of {', '.join(GRAPH_MODES)}")
    return "dense" if float(spec["act_sparsity"]) == 0.0 else mode


def predictor_arrays(spec: dict, i: int) -> dict:
    """Layer ``i``'s predictor (D) or channel scale (M) arrays of a spec dict
    (``spec["arrays"]["layers.{i}.{name}"]``) as ``{name: array}``."""
    pre = f"layers.{i}."
    return {k[len(pre):]: np.asarray(v) for k, v in (spec.get("arrays") or {}).items()
            if k.startswith(pre)}


@register_export_variant("countdown")
class CountdownMixin(VariantMixin):
    """Builder mixin: the COUNTDOWN MLP (``build_mlp``) and the ``countdown_kept`` output.

    Its spec dict is ``edgeprune.countdown.CountdownSpec``'s (see the module docstring);
    ``graph_mode`` (``"if"`` default, ``"sparse"``, ``"dense"``) picks the graph.

    Raises:
        ExportError: see :func:`check_spec`; int weights that are not 4-bit or use
            act_order.
    """

    _cd_int_info = None
    _cd_block_size = None

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        self.countdown_spec = opts.variants["countdown"]
        self.countdown_mode = check_spec(self.countdown_spec, model)
        self._cd_cond_name = None
        self._cd_kept: list = []
        # an always-sparse graph filters prefill too: its logits stand for the filtered
        # model, not the given one, so export validation checks the graph but not them
        self.logits_match_model = self.countdown_mode != "sparse"
        self.logits_differ_because = "its sparse MLP drops the small activations, prefill included"

    # ------------------------------------------------------------------ shared
    def _cd_cond(self) -> str:
        g = self.g
        if self._cd_cond_name is None:
            en = g.initializer(ENABLED_NAME, np.array(True))
            n = g.node("Size", ["input_ids"], name="countdown/tokens")          # B * S
            one = g.node("Equal", [n, g.const(1)], name="countdown/is_decode")
            self._cd_cond_name = g.node("And", [one, en], name="countdown/cond")
            self._cd_kept = []
        return self._cd_cond_name

    def _cd_weights(self, i: int) -> dict:
        """Float ``[I, H]`` initializers (gate, up, down^T) or int4 row tables."""
        pre = f"model.layers.{i}.mlp"
        name = f"layers.{i}.mlp"
        g = self.g
        ints = None
        if self.opts.precision == "int4" or self.opts.quantized:
            ints = {p: self.weight_int(f"{pre}.{p}") for p in ("gate_proj", "up_proj", "down_proj")}
            if any(v is None for v in ints.values()):
                ints = None
        w = {"int": ints is not None}
        if ints is None:
            for p in ("gate_proj", "up_proj"):
                w[p] = g.initializer(f"{name}.{p}.weight_rows",
                                     self.param(f"{pre}.{p}.weight").astype(self.fdtype))
                self.quant_summary[f"{pre}.{p}"] = self.opts.precision if \
                    self.opts.precision != "int4" else "fp32"
            w["down_t"] = g.initializer(
                f"{name}.down_proj.weight_t",
                np.ascontiguousarray(self.param(f"{pre}.down_proj.weight").T.astype(self.fdtype)))
            self.quant_summary[f"{pre}.down_proj"] = self.quant_summary[f"{pre}.gate_proj"]
            return w
        for p in ("gate_proj", "up_proj"):
            iw = ints[p]
            if p == "up_proj" and self.countdown_spec["mode"] == "m":
                continue                      # M reads up in full (MatMulNBits)
            if iw.bits != 4:
                raise ExportError(f"{pre}.{p}: COUNTDOWN int export supports 4-bit weights "
                                  f"(got {iw.bits})", "quantize the MLP with bits=4")
            if iw.perm is not None:
                raise ExportError(f"{pre}.{p}: act_order permutations are not supported by "
                                  "the COUNTDOWN row gather", "quantize without act_order")
            w[p] = self._cd_int_rows(iw, f"{name}.{p}")
        dq = ints["down_proj"].dequantize(original_order=True)             # [H, I]
        rq = rtn_int(np.ascontiguousarray(dq.T), 4, self.opts.group_size)  # [I, H] blocks on H
        w["down_t"] = self._cd_int_rows(rq, f"{name}.down_proj_t")
        w["down_t_requant"] = f"rtn asym int4 g{self.opts.group_size} along hidden"
        return w

    def _cd_int_rows(self, iw, name: str) -> dict:
        g = self.g
        self._cd_block_size = int(iw.block_size)      # recorded: read reports price rows by it
        return {"data": g.initializer(name + ".rows_q4", pack_uint4(iw.codes)),
                "scales": g.initializer(name + ".rows_scales", iw.scales.astype(self.fdtype)),
                "zp": g.initializer(name + ".rows_zp", pack_uint4(iw.zeros)),
                "block_size": int(iw.block_size), "K": int(iw.K)}

    def _cd_rows(self, sb: GraphBuilder, w, idx: str, name: str) -> str:
        """Selected rows ``[k, H]`` (float) of a float initializer or an int4 table."""
        if isinstance(w, str):
            return sb.gather(w, idx, axis=0, name=name + "/gather_rows")
        out = sb.node("GatherBlockQuantized", [w["data"], idx, w["scales"], w["zp"]],
                      name=name + "/gather_rows_q4", domain=MS_DOMAIN, gather_axis=0,
                      quantize_axis=1, block_size=w["block_size"], bits=4)
        self.g.uses_ms_domain = True
        return out

    def _cd_q4_matmul(self, sb: GraphBuilder, x2: str, p: dict, which: str, name: str) -> str:
        """``x2 @ Ŵ^T`` for the D q4 predictor's 4-bit ``which`` ("gate"/"up") copy:
        ``MatMulNBits`` (fused graph) or a float MatMul on the dequantized copy (plain
        graph), with
        ``accuracy_level=0`` (fp32 activations) so it selects the same coefficients as
        the PyTorch reference (``edgeprune.countdown.predictor_score``)."""
        iw = IntWeight(codes=p[which + "_codes"].astype(np.uint8),
                       scales=p[which + "_scales"].astype(np.float32),
                       zeros=p[which + "_zeros"].astype(np.uint8), bits=4,
                       block_size=int(p["block_size"].reshape(-1)[0]))
        if not self.fused:
            # plain graph: the exact dequantized values as a float initializer (no byte
            # saving; the blocked DequantizeLinear path did not match the reference here)
            wt = np.ascontiguousarray(iw.dequantize().T.astype(self.fdtype))     # [H, I]
            return sb.matmul(x2, self.g.initializer(name + ".weight_t", wt), name=name)
        with self.building_into(sb):
            return self.int_matmul(x2, iw, name, level=self._accuracy_level(name, default=0))

    # ------------------------------------------------------------------ branches
    def _cd_dense(self, sb: GraphBuilder, i: int, x2: str, w: dict) -> str:
        name = f"layers.{i}.mlp"
        pre = f"model.layers.{i}.mlp"
        if w["int"]:
            with self.building_into(sb):
                gu = self.linear(x2, [f"{pre}.gate_proj", f"{pre}.up_proj"],
                                 name + ".gate_up_proj")
                I = self.spec.intermediate_size
                gate, up = sb.split(gu, [I, I], axis=-1, name=name + "/split")
                c = sb.mul(sb.mul(gate, sb.node("Sigmoid", [gate])), up, name=name + "/gated")
                return self.linear(c, [f"{pre}.down_proj"], name + ".down_proj")
        gate = sb.node("Gemm", [x2, w["gate_proj"]], name=name + ".gate_proj", transB=1)
        up = sb.node("Gemm", [x2, w["up_proj"]], name=name + ".up_proj", transB=1)
        c = sb.mul(sb.mul(gate, sb.node("Sigmoid", [gate])), up, name=name + "/gated")
        return sb.matmul(c, w["down_t"], name=name + ".down_proj")

    def _cd_sparse(self, sb: GraphBuilder, i: int, x2: str, w: dict,
                   single: bool = False) -> tuple[str, str]:
        """Sparse MLP on ``x2 [T, H]``; ``single``: the graph guarantees ``T == 1`` (the
        ``If`` decode branch), so the kept rows are the token's own mask and the union /
        per-token mask multiply are left out (the same result, four nodes fewer)."""
        spec = self.countdown_spec
        name = f"layers.{i}.mlp"
        tau = float(spec["thresholds"][i])
        silu = lambda t, n: sb.mul(t, sb.node("Sigmoid", [t]), name=n)  # noqa: E731
        up_full = None
        p = predictor_arrays(spec, i)
        ini = lambda k: self.g.initializer(f"{name}.countdown.{k}",  # noqa: E731
                                           p[k].astype(self.fdtype))
        if spec["mode"] == "m" or not p:       # D at act_sparsity 0 has no predictor
            if w["int"]:
                with self.building_into(sb):
                    up_full = self.linear(x2, [f"model.layers.{i}.mlp.up_proj"],
                                          name + ".up_proj")
            else:
                up_full = sb.node("Gemm", [x2, w["up_proj"]], name=name + ".up_proj", transB=1)
            score = up_full
            if "channel_scale" in p:          # M refinement: |up * f| (f > 0, static)
                score = sb.mul(up_full, ini("channel_scale"), name=name + "/scaled_up")
        elif "gate_codes" in p:                # D q4: 4-bit copies of gate/up (MatMulNBits)
            pg = self._cd_q4_matmul(sb, x2, p, "gate", name + ".countdown.gate_q4")
            pu = self._cd_q4_matmul(sb, x2, p, "up", name + ".countdown.up_q4")
            score = sb.mul(sb.mul(silu(pg, name + "/pred_act"), pu, name=name + "/pred"),
                           ini("channel_scale"), name=name + "/pred_scaled")
        else:
            pg = sb.matmul(sb.matmul(x2, ini("v_gate")), ini("u_gate"), name=name + "/pred_gate")
            pu = sb.matmul(sb.matmul(x2, ini("v_up")), ini("u_up"), name=name + "/pred_up")
            score = sb.mul(silu(pg, name + "/pred_act"), pu, name=name + "/pred")
        keep = sb.node("Greater", [sb.node("Abs", [score]), sb.const(tau, self.fdtype)],
                       name=name + "/keep")
        if single:                                                          # [1, I]
            keepf = None
            idx = sb.reshape(sb.node("NonZero", [sb.reshape(keep, [-1])], name=name + "/idx"),
                             [-1])                                          # [k]
        else:
            keepf = sb.cast(keep, self.ftype)                               # [T, I]
            anyk = sb.node("ReduceMax", [keepf, sb.const([0])], name=name + "/union", keepdims=0)
            idx = sb.reshape(sb.node("NonZero", [anyk], name=name + "/idx"), [-1])   # [k]
        kept = sb.shape(idx, name=name + "/kept")                          # int64 [1]
        gsel = sb.node("Gemm", [x2, self._cd_rows(sb, w["gate_proj"], idx, name + ".gate")],
                       name=name + ".gate_proj_sel", transB=1)
        if up_full is not None:
            usel = sb.gather(up_full, idx, axis=1, name=name + "/up_sel")
        else:
            usel = sb.node("Gemm", [x2, self._cd_rows(sb, w["up_proj"], idx, name + ".up")],
                           name=name + ".up_proj_sel", transB=1)
        c = sb.mul(silu(gsel, name + "/act"), usel, name=name + "/coef")
        if keepf is not None:
            c = sb.mul(c, sb.gather(keepf, idx, axis=1, name=name + "/mask_sel"),
                       name=name + "/masked")
        y = sb.matmul(c, self._cd_rows(sb, w["down_t"], idx, name + ".down"),
                      name=name + ".down_proj_sel")
        return y, kept

    # ------------------------------------------------------------------ block
    def build_mlp(self, i: int, layer, h: str) -> str:
        """COUNTDOWN MLP of layer ``i`` on ``h [B, S, H]`` -> ``[B, S, H]``."""
        g, s = self.g, self.spec
        name = f"layers.{i}.mlp"
        mode = self.countdown_mode
        w = self._cd_weights(i)
        x2 = g.reshape(h, [-1, s.hidden_size], name=name + "/flatten")
        out_shape = g.shape(h, name=name + "/shape")
        if mode == "dense":
            y = self._cd_dense(g, i, x2, w)
            kept = g.const([s.intermediate_size])
        elif mode == "sparse":
            y, kept = self._cd_sparse(g, i, x2, w)
        else:
            cond = self._cd_cond()
            tb, eb = _sub_builder(g), _sub_builder(g)
            ty, tk = self._cd_sparse(tb, i, x2, w, single=True)
            ey = self._cd_dense(eb, i, x2, w)
            ek = eb.node("Identity", [eb.const([s.intermediate_size])], name=name + "/kept_dense")
            if tb.uses_ms_domain or eb.uses_ms_domain:
                g.uses_ms_domain = True
            vi = lambda n, t: helper.make_tensor_value_info(n, t, None)  # noqa: E731
            then_g = helper.make_graph(tb.nodes, f"{name}_sparse", [],
                                       [vi(ty, self.ftype), vi(tk, TensorProto.INT64)])
            else_g = helper.make_graph(eb.nodes, f"{name}_dense", [],
                                       [vi(ey, self.ftype), vi(ek, TensorProto.INT64)])
            y, kept = g.node("If", [cond], n_out=2, name=name + "/countdown_if",
                             then_branch=then_g, else_branch=else_g)
        self._cd_kept.append(kept)
        self._cd_int_info = w.get("down_t_requant")
        return g.node("Reshape", [y, out_shape], name=name + "/unflatten")

    def build_extra_outputs(self) -> None:
        """``countdown_kept int64 [L]``: the MLP rows each layer kept (after ``logits``)."""
        super().build_extra_outputs()
        g = self.g
        g.node("Concat", list(self._cd_kept), outputs=[KEPT_OUTPUT], name="countdown/kept",
               axis=0)
        g.output(KEPT_OUTPUT, TensorProto.INT64, [self.spec.num_layers])

    def variant_record(self) -> dict:
        """The ``edgeprune.json`` record: the spec (without its arrays), the graph mode and
        the weight layout the runtime's read report prices."""
        spec = self.countdown_spec
        meta = {k: v for k, v in spec.items() if k != "arrays"}
        s = self.spec
        H, I, r = s.hidden_size, s.intermediate_size, spec.get("rank") or 0
        p0 = predictor_arrays(spec, 0)
        meta.update({
            "graph_mode": self.countdown_mode,
            "decode_path": "sparse" if self.countdown_mode in ("if", "sparse") else "dense",
            "prefill_path": {"if": "dense", "sparse": "sparse", "dense": "dense"}[self.countdown_mode],
            "switch": f"If(batch_size * sequence_length == 1 and {ENABLED_NAME})"
            if self.countdown_mode == "if"
            else None,
            "enabled_initializer": ENABLED_NAME if self.countdown_mode == "if" else None,
            "kept_output": KEPT_OUTPUT,
            "weight_layout": "gate/up [I, H] rows, down^T [I, H] rows",
            "granularity": "one intermediate unit (a row of gate, up and down^T)",
            "int4": ({"rows": "GatherBlockQuantized, blocks along hidden",
                      "block_size": self._cd_block_size,
                      "down_t": self._cd_int_info or "n/a"} if self._cd_int_info else None),
            "mlp_rows_bytes_per_unit": {"gate": H, "up": H, "down": H},
            "predictor_kind": spec.get("predictor_kind"),
            "predictor_params_per_layer": (2 * (H * r + r * I)) if spec["mode"] == "d" and r else 0,
            "predictor_bytes_per_layer": (spec.get("stats") or {}).get("predictor_bytes_per_layer"),
            "up_read_in_full": spec["mode"] == "m",
            "channel_scale": bool(spec["mode"] == "m" and p0 and "channel_scale" in p0),
        })
        return meta


__all__ = ["CountdownMixin", "check_spec", "predictor_arrays", "GRAPH_MODES", "KEPT_OUTPUT",
           "ENABLED_NAME"]
