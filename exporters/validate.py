"""Checks run on every export: ``onnx.checker``, shape inference, one-window parity."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx

from edgeprune_runtime.errors import ExportError


def check_graph(model_path: Path) -> dict:
    """``onnx.checker`` (full) and strict-off shape inference on the saved model file.

    Raises:
        ExportError: the checker rejects the graph.
    """
    t0 = time.perf_counter()
    try:
        onnx.checker.check_model(str(model_path))
        inferred = onnx.shape_inference.infer_shapes_path(str(model_path), str(model_path) + ".si")
        Path(str(model_path) + ".si").unlink(missing_ok=True)
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"the exported graph failed onnx validation: {e}",
                          "report this export (graph builder bug)") from e
    del inferred
    return {"onnx_checker": "ok", "shape_inference": "ok",
            "check_s": round(time.perf_counter() - t0, 3)}


class substituted_weights:
    """Context manager: temporarily replace the model's weights by the exported
    integer weights' dequantized values (the exact function the ONNX graph computes),
    restoring the originals afterwards.

    Args:
        model: torch model.
        int_weights: ``{module name: IntWeight}`` from the builder.
    """

    def __init__(self, model, int_weights: dict):
        self.model, self.int_weights, self.saved = model, int_weights, {}

    def __enter__(self):
        import torch
        mods = dict(self.model.named_modules())
        with torch.no_grad():
            for name, w in self.int_weights.items():
                p = mods[name].weight
                if name in self.saved or any(p is q for q in self.saved.values()):
                    continue
                self.saved[name] = p.detach().clone()
                p.copy_(torch.from_numpy(w.dequantize(original_order=True)).to(p.dtype))
        return self.model

    def __exit__(self, *exc):
        import torch
        mods = dict(self.model.named_modules())
        with torch.no_grad():
            for name, orig in self.saved.items():
                mods[name].weight.copy_(orig)
        self.saved.clear()


SAMPLE_TEXT = (
    "The tower is 324 metres tall, about the same height as an 81-storey building, and the "
    "tallest structure in Paris. Its base is square, measuring 125 metres on each side. "
    "During its construction, the Eiffel Tower surpassed the Washington Monument to become "
    "the tallest man-made structure in the world, a title it held for 41 years until the "
    "Chrysler Building in New York City was finished in 1930. It was the first structure to "
    "reach a height of 300 metres. Due to the addition of a broadcasting aerial at the top of "
    "the tower in 1957, it is now taller than the Chrysler Building by 5.2 metres. Excluding "
    "transmitters, the Eiffel Tower is the second tallest free-standing structure in France "
    "after the Millau Viaduct. ")


def window_ids(tokenizer, vocab: int, seqlen: int, seed: int = 0) -> np.ndarray:
    """``int64 [1, seqlen]``: a built-in English passage (repeated) when a tokenizer is
    given, random ids otherwise."""
    if tokenizer is not None:
        try:
            ids = tokenizer(SAMPLE_TEXT * 8, add_special_tokens=False)["input_ids"]
            ids = [i for i in ids if i < vocab]
            if len(ids) >= seqlen:
                return np.array([ids[:seqlen]], dtype=np.int64)
        except Exception:  # noqa: BLE001  (fall back to random ids)
            pass
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(1, seqlen), dtype=np.int64)


def parity(model, folder: Path, seqlen: int = 64, seed: int = 0,
           int_weights: dict | None = None, tokenizer=None) -> dict:
    """Run one window of token ids through the torch model and the exported folder.

    Args:
        model: the HF torch model the export came from.
        folder: the (temporary) export folder, loaded with :func:`runtime.load`.
        seqlen: window length in tokens.

    Returns:
        ``{"window_tokens", "max_abs_logit_diff", "mean_abs_logit_diff", "top1_agreement"}``.
    """
    import torch

    import edgeprune_runtime as runtime

    ids = window_ids(tokenizer, model.config.vocab_size, seqlen, seed)
    with torch.no_grad():
        dense = model(torch.from_numpy(ids)).logits.float().numpy()
        if int_weights:
            with substituted_weights(model, int_weights):
                ref = model(torch.from_numpy(ids)).logits.float().numpy()
        else:
            ref = dense
    with runtime.load(folder) as sess:
        got = sess.logits(ids)
    diff = np.abs(got - ref)
    out = {"window_tokens": seqlen, "reference": "torch model with the exported integer "
           "weights dequantized" if int_weights else "torch model",
           "max_abs_logit_diff": float(diff.max()),
           "mean_abs_logit_diff": float(diff.mean()),
           "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
           "reference_abs_max": float(np.abs(ref).max()),
           "reference_spread": float(np.abs(ref - ref.mean(-1, keepdims=True)).mean())}
    if int_weights:
        out["top1_agreement_vs_given_model"] = float((got.argmax(-1) == dense.argmax(-1)).mean())
        head = next((k for k in ("lm_head", "model.embed_tokens") if k in int_weights), None)
        if head is not None and int_weights[head].bits == 4:
            out["lm_head_int4_ppl_cost"] = head_int4_cost(model, ids, int_weights, head)
    return out


#: Exact graphs (fp32 compute throughout): the largest logit difference allowed, relative
#: to ``1 + max |reference logit|``. Measured: <= 3e-6 on tiny models, 7e-5 on SmolLM2
#: (logits to ~20), so a factor of ~100 is left for other CPUs' summation orders.
EXACT_TOLERANCE = 1e-3
#: Approximate graphs (fp16, int8 activations): a catastrophic-failure bound only. Their
#: rounding noise reaches mean |diff| 0.23 of a logit spread ~2 and 91 % top-1 agreement
#: on SmolLM2 int4, close to what a structural error costs on a tiny model (0.08 of 0.49,
#: 70 %), so subtler errors are left to the exact graphs and the structural checks.
APPROX_MAX_SPREAD_FRACTION = 0.5
APPROX_MIN_TOP1 = 0.5


def check_parity(p: dict, approximate: bool) -> None:
    """Fail an export whose logits do not match the model's (:func:`parity`'s record).

    Exact graphs: ``max_abs_logit_diff <= EXACT_TOLERANCE * (1 + reference_abs_max)``.
    Approximate graphs (fp16 weights or int8-activation ``MatMulNBits``): mean
    ``|diff| <= APPROX_MAX_SPREAD_FRACTION x reference_spread`` (the logits' mean absolute
    deviation from their row mean) and ``top1_agreement >= APPROX_MIN_TOP1``.

    Raises:
        ExportError: naming the figures; the export folder is then not written.
    """
    fix = ("the model has a feature the exporter does not reproduce (please report its config); "
           "export with validate=False (CLI: --no-validate) to keep the graph anyway")
    if not approximate:
        bound = EXACT_TOLERANCE * (1.0 + p["reference_abs_max"])
        if p["max_abs_logit_diff"] > bound:
            raise ExportError(f"validation failed: the graph's logits differ from the model's by up "
                              f"to {p['max_abs_logit_diff']:.3g} (allowed {bound:.3g} for an fp32 "
                              f"graph; top-1 agreement {p['top1_agreement']:.1%} over "
                              f"{p['window_tokens']} tokens)", fix)
        return
    bound = APPROX_MAX_SPREAD_FRACTION * p["reference_spread"]
    if p["mean_abs_logit_diff"] > bound or p["top1_agreement"] < APPROX_MIN_TOP1:
        raise ExportError(f"validation failed: mean |logit difference| {p['mean_abs_logit_diff']:.3g} "
                          f"(allowed {bound:.3g}), top-1 agreement {p['top1_agreement']:.1%} (allowed "
                          f">= {APPROX_MIN_TOP1:.0%}) over {p['window_tokens']} tokens", fix)


def _ppl(logits: np.ndarray, ids: np.ndarray) -> float:
    lg = logits[0, :-1].astype(np.float64)
    lg = lg - lg.max(-1, keepdims=True)
    logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(lg)), ids[0, 1:]].mean()))


def head_int4_cost(model, ids: np.ndarray, int_weights: dict, head: str) -> dict:
    """Perplexity of the window with the exported int4 ``lm_head`` vs an 8-bit head
    (both with the exported body weights): the quality cost of asking for an int4 head
    (int4 heads are known to make small models repeat themselves)."""
    import torch

    from .int4 import q8_head_block, rtn_int

    w = model.get_submodule(head).weight.detach().float().numpy()
    q8 = dict(int_weights)
    q8[head] = rtn_int(w, 8, q8_head_block(w.shape[1]))    # the exporter's own 8-bit head
    with torch.no_grad():
        with substituted_weights(model, int_weights):
            p4 = _ppl(model(torch.from_numpy(ids)).logits.float().numpy(), ids)
        with substituted_weights(model, q8):
            p8 = _ppl(model(torch.from_numpy(ids)).logits.float().numpy(), ids)
    return {"window_ppl_int4_head": p4, "window_ppl_int8_head": p8,
            "cost_pct": 100.0 * (p4 / p8 - 1.0)}


__all__ = ["check_graph", "parity"]
