"""Running COUNTDOWN exports: the on/off flag and the measured MLP bytes per decode token.

A COUNTDOWN export (``exporters.countdown``, COUNTDOWN: Cheon et al., EMNLP 2025) needs
nothing special to run: ``runtime.load(folder)`` decodes with the sparse MLP and
prefills densely, because the graph itself switches on ``sequence_length == 1`` (an
``If`` per layer). This module adds:

* the runtime flag: ``runtime.countdown.load(folder, countdown=False)`` overrides the graph's bool
  initializer ``countdown.enabled`` (``SessionOptions.add_initializer``), so the same
  file decodes densely (for A/B comparisons without a second export);
* :class:`CountdownSession`, which binds the graph's ``countdown_kept int64 [L]`` output
  (rows kept per layer) at every decode step and reports the measured fraction of MLP
  weight bytes read per decode token (:meth:`CountdownSession.mlp_read_report`).

Batches (and any step with more than one token) run the dense branch: a batch row then
decodes like the dense model, not like the same prompt filtered alone.

Torch-free (onnxruntime + numpy).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnxruntime as ort

from .errors import RuntimeLoadError
from .session import Session
from .variants import register_session, variant_records

KEPT_OUTPUT = "countdown_kept"


@register_session("countdown")
class CountdownSession(Session):
    """A :class:`runtime.session.Session` over a COUNTDOWN export.

    Args:
        folder, device, threads, max_length, context_policy: as :class:`Session`.
        countdown: ``False`` switches the filter off (dense decode from the same file).

    Raises:
        RuntimeLoadError: the folder is not a COUNTDOWN export (``edgeprune.json``
            ``countdown`` is null), or ``countdown=False`` on a graph without the switch.
    """

    supports_prompt_lookup = False   # own cache layout / per-step statistics

    def __init__(self, folder, countdown: bool = True, **session_kw):
        """``countdown``: False runs the dense MLP; ``session_kw`` as :class:`runtime.session.Session`."""
        self.countdown_enabled = bool(countdown)
        super().__init__(folder, **session_kw)
        self.countdown = self._countdown_meta()
        self.kept_log: list = []
        self._has_kept = KEPT_OUTPUT in self.output_names

    def _countdown_meta(self) -> dict:
        cd = variant_records(self.meta).get("countdown")
        if not cd:
            raise RuntimeLoadError(f"{self.folder} is not a COUNTDOWN export",
                                   "export one with `edgeprune countdown` + `edgeprune export --variant`, "
                                   "or load this folder with runtime.load")
        return cd

    def _session_options(self) -> "ort.SessionOptions":
        """The base options; with ``countdown=False`` the graph's ``countdown.enabled``
        initializer is overridden to False, so the one session built decodes densely."""
        so = super()._session_options()
        if not self.countdown_enabled:
            cd = self._countdown_meta()
            name = cd.get("enabled_initializer")
            if not name and cd.get("graph_mode") == "dense":
                return so                # never filters (e.g. act_sparsity 0): nothing to switch off
            if not name:
                raise RuntimeLoadError("this COUNTDOWN export has no on/off switch "
                                       f"(graph_mode={cd.get('graph_mode')!r})",
                                       "re-export with graph_mode='if'")
            self._off = ort.OrtValue.ortvalue_from_numpy(np.array(False))
            so.add_initializer(name, self._off)
        return so

    # -------------------------------------------------------------- decode hooks
    def _prefill(self, prompts, need=None) -> dict:
        st = super()._prefill(prompts, need)
        if self._has_kept and "binding" in st and self.in_place_io:
            buf = np.zeros((len(self.countdown.get("thresholds") or []) or
                            int(self.meta["num_layers"]),), np.int64)
            st["binding"].bind_ortvalue_output(KEPT_OUTPUT, ort.OrtValue.ortvalue_from_numpy(buf))
            st["kept_buf"] = buf
        self.kept_log = []
        return st

    def _decode_step(self, st, feed):
        out = super()._decode_step(st, feed)
        buf = st.get("kept_buf")
        if buf is not None:
            self.kept_log.append(buf.copy())
        return out

    # -------------------------------------------------------------- reporting
    def mlp_read_report(self) -> dict:
        """Measured MLP weight reads of the decode steps of the last generation.

        From the rows kept per layer (graph output ``countdown_kept``): per layer and step
        M reads all ``I`` rows of up plus ``k`` rows of gate and of down^T (plus its ``I``
        channel scales when the export has them); D reads ``k``
        rows of each plus its predictor (``2 (H r + r I)`` values; none in a layer that
        reports all ``I`` rows, i.e. the dense branch of a batched decode step). Bytes per row follow
        the export's precision (fp32 ``4H``, fp16 ``2H``, int4 ``H/2`` codes + a
        scale (4 B) and a packed zero point per block).

        Returns:
            ``{"decode_steps", "kept_rows_mean", "kept_fraction_mean",
            "mlp_bytes_read_per_token", "mlp_bytes_dense_per_token",
            "mlp_bytes_fraction"}`` (fractions in [0, 1]; None when nothing was recorded,
            e.g. plain graphs or a non-CPU device).
        """
        m, cd = self.meta, self.countdown
        H, I, L = int(m["hidden_size"]), int(m["intermediate_size"]), int(m["num_layers"])
        if not self.kept_log:
            return {"decode_steps": 0, "kept_rows_mean": None, "kept_fraction_mean": None,
                    "mlp_bytes_read_per_token": None, "mlp_bytes_dense_per_token": None,
                    "mlp_bytes_fraction": None}
        k = np.stack(self.kept_log).astype(np.float64)                    # [steps, L]
        prec = m.get("precision", "fp32")
        if cd.get("int4"):
            bs = int((cd["int4"] if isinstance(cd["int4"], dict) else {}).get("block_size") or 32)
            row = H / 2 + (H / bs) * (4 + 0.5)
            elem_pred = 4.0 if prec != "fp16" else 2.0
        else:
            item = 2.0 if prec == "fp16" else 4.0
            row = H * item
            elem_pred = item
        r = int(cd.get("rank") or 0)
        dense = 3 * I * row * L
        if not self.countdown_enabled or all(float(t) < 0 for t in cd.get("thresholds") or [0]):
            per_step = np.full(len(k), dense)        # filter off / act_sparsity 0: all rows
        elif cd.get("mode") == "m":
            per_step = (I * row + 2 * k * row).sum(1) + \
                (L * I * elem_pred if cd.get("channel_scale") else 0)
        else:
            pb = cd.get("predictor_bytes_per_layer")      # q4 predictor: as exported
            pred = float(pb) if pb and not r else 2 * (H * r + r * I) * elem_pred
            # a layer reporting all I rows ran the dense branch (batched decode): no predictor
            per_step = (3 * k * row + pred * (k < I)).sum(1)
        return {"decode_steps": int(len(k)), "kept_rows_mean": float(k.mean()),
                "kept_fraction_mean": float(k.mean() / I),
                "mlp_bytes_read_per_token": float(per_step.mean()),
                "mlp_bytes_dense_per_token": float(dense),
                "mlp_bytes_fraction": float(per_step.mean() / dense)}


def load(folder, device: str = "cpu", threads: Optional[int] = None,
         max_length: Optional[int] = None, context_policy: str = "error",
         countdown: bool = True, huge_pages: bool = True) -> CountdownSession:
    """Load a COUNTDOWN export: ``runtime.countdown.load(folder, threads=2, countdown=True)``.

    See :class:`CountdownSession`.
    """
    return CountdownSession(folder, device=device, threads=threads, max_length=max_length,
                            context_policy=context_policy, countdown=countdown,
                            huge_pages=huge_pages)


__all__ = ["CountdownSession", "load", "KEPT_OUTPUT"]
