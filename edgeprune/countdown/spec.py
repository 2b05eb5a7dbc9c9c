"""The COUNTDOWN spec: the compress-side spec of the ``"countdown"`` graph variant, its
(de)serialisation, and :func:`calibrate` / :func:`calibrate_many`, which build specs from
calibration windows (the work: ``edgeprune.countdown.calibration``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

import numpy as np
import torch

from ..errors import CheckpointError
from ..variants import VariantSpec, load_spec, register_variant, save_spec
from .calibration import calibrate_fields
from .config import DEFAULT_PREDICTOR, DEFAULT_RANK, check_graph_mode
from .reference import apply_reference


@register_variant
@dataclass
class CountdownSpec(VariantSpec):
    """Calibrated COUNTDOWN filter for one model: the compress-side spec of the graph
    variant ``"countdown"`` (exported by ``exporters.countdown.CountdownMixin``, run by
    ``runtime.countdown.CountdownSession``).

    Attributes:
        mode: ``"m"`` (threshold on ``|up(x)|``) or ``"d"`` (threshold on a predictor).
        act_sparsity: target fraction ``s`` of coefficients skipped per token.
        thresholds: ``[num_layers]`` floats ``τ_l`` (``-1`` keeps everything).
        rank: predictor rank ``r`` (D only).
        predictors: per layer dict of tensors. D low-rank: ``{"v_gate": [H, r],
            "u_gate": [r, I], "v_up": [H, r], "u_up": [r, I]}`` (float32); D q4:
            ``{"gate_codes"/"up_codes": uint8 [I, H], "gate_scales"/"up_scales": float32
            [I, H/g], "gate_zeros"/"up_zeros": uint8 [I, H/g], "block_size": int64 [1],
            "channel_scale": [I]}``; M with a channel scale:
            ``{"channel_scale": [I]}``; ``None`` for the paper's plain M (``|up(x)|``).
        activation: the MLP's activation name (``"silu"``).
        stats: JSON-able calibration figures (realised sparsity per layer, recall,
            predictor bytes vs MLP bytes, calibration tokens, seconds).
        graph_mode: the exported graph: ``"if"`` (sparse decode, dense prefill),
            ``"sparse"`` (every position filtered), ``"dense"`` (never filtered).
    """

    name: ClassVar[str] = "countdown"
    title: ClassVar[str] = "COUNTDOWN spec"

    mode: str
    act_sparsity: float
    thresholds: list
    rank: Optional[int] = None
    predictors: Optional[list] = None
    activation: str = "silu"
    stats: dict = field(default_factory=dict)
    graph_mode: str = "if"

    @property
    def num_layers(self) -> int:
        return len(self.thresholds)

    @property
    def predictor_kind(self) -> Optional[str]:
        """D: ``"q4"`` (4-bit copy of gate/up) or ``"lowrank"``; ``None`` for M."""
        if self.mode != "d" or not self.predictors:
            return None
        if "gate_codes" in self.predictors[0]:
            return "q4"
        return "lowrank"

    def to_dict(self) -> dict:
        """Everything but the predictor tensors (the exporter's spec; with the graph's
        layout, the ``countdown`` record of ``edgeprune.json``)."""
        return {"method": "COUNTDOWN (Cheon et al., EMNLP 2025)",
                "mode": self.mode, "variant": f"{self.mode.upper()}-COUNTDOWN",
                "act_sparsity": self.act_sparsity,
                "thresholds": [float(t) for t in self.thresholds], "rank": self.rank,
                "predictor_kind": self.predictor_kind,
                "activation": self.activation, "stats": self.stats,
                "graph_mode": self.graph_mode}

    def arrays(self) -> dict:
        """The predictors as ``{"layers.{i}.{name}": array}`` (floats as float32)."""
        return {f"layers.{i}.{k}": (v.detach().float() if v.is_floating_point() else v.detach())
                .contiguous().cpu().numpy()
                for i, p in enumerate(self.predictors or []) for k, v in p.items()}

    @classmethod
    def from_dict(cls, d: dict, arrays: Optional[dict] = None) -> "CountdownSpec":
        """Inverse of :meth:`to_dict` + :meth:`arrays`.

        Raises:
            CheckpointError: a dict that is not a COUNTDOWN spec, or a filtering D spec
                without its predictors.
        """
        try:
            n, s = len(d["thresholds"]), float(d["act_sparsity"])
            preds = None
            if arrays:
                preds = [{k.split(".", 2)[2]: torch.from_numpy(np.array(v)) for k, v in arrays.items()
                          if k.startswith(f"layers.{i}.")} for i in range(n)]
            if d["mode"] == "d" and s > 0 and not preds:
                raise CheckpointError("D-COUNTDOWN spec without its predictors",
                                      "re-run `edgeprune countdown` (D specs are safetensors files)")
            return cls(mode=d["mode"], act_sparsity=s, thresholds=list(d["thresholds"]),
                       rank=d.get("rank"), predictors=preds,
                       activation=d.get("activation", "silu"), stats=d.get("stats", {}),
                       graph_mode=d.get("graph_mode") or "if")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"corrupt COUNTDOWN spec: {e!r}", "re-run the calibration") from e

    def save(self, path) -> Path:
        """Write the spec atomically (:func:`edgeprune.variants.save_spec`: safetensors
        when it holds predictors or channel scales, else JSON)."""
        return save_spec(self, path)

    @classmethod
    def load(cls, path) -> "CountdownSpec":
        """Read a spec written by :meth:`save`, or a spec folder written before the variant
        registry (``countdown.json`` + ``countdown.safetensors``); never a pickle.

        Raises:
            CheckpointError: missing, unreadable or foreign files.
        """
        return load_spec(path, kind=cls)

    @classmethod
    def read_legacy(cls, path: Path) -> Optional["CountdownSpec"]:
        """A spec folder written by ``CountdownSpec.save`` before the variant registry
        (``countdown.json`` + ``countdown.safetensors``) or one of its two files, else
        ``None``."""
        folder = path if path.is_dir() else path.parent
        if not (folder / "countdown.json").is_file() or \
                (path.is_file() and path.name not in ("countdown.json", "countdown.safetensors")):
            return None
        try:
            d = json.loads((folder / "countdown.json").read_text())
            st = folder / "countdown.safetensors"
            arrays = {}
            if float(d["act_sparsity"]) > 0 and (d["mode"] == "d" or st.exists()):
                from safetensors.numpy import load_file
                arrays = load_file(str(st))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read the COUNTDOWN spec {folder}: {e}",
                                  "re-run the calibration (`edgeprune countdown`)") from e
        return cls.from_dict(d, arrays)

    # -------------------------------------------------------------- variant stages
    @classmethod
    def calibrate(cls, model, calib_ids, *, act_sparsity: float, mode: str = "m",
                  graph_mode: str = "if", **options) -> "CountdownSpec":
        """:func:`calibrate` (``options``: its keywords) with the exported graph's
        ``graph_mode``."""
        check_graph_mode(graph_mode)
        spec = calibrate(model, calib_ids, act_sparsity, mode, **options)
        spec.graph_mode = graph_mode
        return spec

    def reference(self, model):
        """:func:`apply_reference`: every position filtered (the ``"sparse"`` graph)."""
        return apply_reference(model, self)


@torch.no_grad()
def calibrate(model, calib_ids: torch.Tensor, act_sparsity: float, mode: str = "m", *,
              rank: int = DEFAULT_RANK, max_tokens: int = 8192, seed: int = 0,
              progress: bool = False, allocation: str = "uniform",
              channel_scale: str = "gate_down", threshold_rule: str = "pooled",
              train_epochs: Optional[int] = None,
              predictor: str = DEFAULT_PREDICTOR) -> CountdownSpec:
    """Calibrate COUNTDOWN thresholds (and D predictors) on calibration windows.

    The work is :func:`edgeprune.countdown.calibration.calibrate_fields`.

    Args:
        model: llama/qwen2 causal LM with gated MLPs (fp32, eval mode; not modified).
        calib_ids: ``int64 [nsamples, seqlen]`` (``edgeprune.calibration``).
        act_sparsity: fraction ``s`` in ``[0, 1)`` of MLP coefficients skipped per token.
        mode: ``"m"`` (M-COUNTDOWN) or ``"d"`` (D-COUNTDOWN).
        rank: D predictor rank ``r`` (per gate and per up factor).
        max_tokens: calibration tokens used per layer (random subset; D trains its
            predictor on all of them, thresholds use at most ``8192``).
        seed: seed of that subset.
        allocation: ``"uniform"`` (paper) or ``"greedy"`` per-layer sparsities with the
            same mean (see :func:`calibrate_many`).
        channel_scale: M only. ``"gate_down"`` (default, our refinement): score
            ``|up_j(x)| * f_j`` with the static ``f_j = E|act(gate_j(x))| * ||W_down[:, j]||``
            (calibration mean), the expected size of term ``j`` of the down projection
            given ``up_j``; ``"none"``: the paper's ``|up_j(x)|``.
        threshold_rule: ``"pooled"`` (default: ``τ`` = the ``s``-quantile of all
            calibration scores) or ``"median"`` (median over tokens of each token's
            ``k``-th smallest score, the first implementation).
        train_epochs: D low-rank only: epochs of :func:`train_predictor` after the
            closed-form initialisation (default :data:`DEFAULT_TRAIN_EPOCHS`; ``0`` =
            closed form).
        predictor: D only. ``"q4"`` (default): a 4-bit RTN copy of gate and up (blocks
            of :data:`Q4_GROUP` along ``H``) scored ``|act(x Ŵ_g^T) ⊙ (x Ŵ_u^T)| ⊙
            ||W_down[:, j]||`` (~9.5% of the fp32 MLP bytes on SmolLM2-135M);
            ``"lowrank"``: rank-``rank`` factors (:func:`lowrank_factors`, then
            :func:`train_predictor`).

    Returns:
        :class:`CountdownSpec`; ``stats`` holds the realised sparsity per layer on the
        calibration tokens and, for D, the recall of the true top-``(1-s)`` coefficients,
        and the predictor bytes vs MLP weight bytes.

    Raises:
        ConfigError: ``act_sparsity`` outside ``[0, 1)``, unknown mode, bad rank.
        UnsupportedArchitectureError: non-gated MLP.
        CalibrationError: empty calibration set.
    """
    return calibrate_many(model, calib_ids, [act_sparsity], mode, rank=rank,
                          max_tokens=max_tokens, seed=seed, progress=progress,
                          allocation=allocation, channel_scale=channel_scale,
                          threshold_rule=threshold_rule, train_epochs=train_epochs,
                          predictor=predictor)[0]


@torch.no_grad()
def calibrate_many(model, calib_ids: torch.Tensor, sparsities, mode: str = "m",
                   **options) -> list:
    """:func:`calibrate` for several act-sparsities at once (one pass over the
    calibration data; D predictors shared, only the thresholds differ).

    Args:
        options: :func:`calibrate`'s keywords, and ``err_tokens`` (256) and ``stat_tokens``
            (8192): calibration tokens per layer for the greedy allocation's error and
            for the thresholds. ``allocation``: ``"uniform"`` (every layer skips ``s``;
            the paper's setting) or ``"greedy"`` (our extension: per-layer sparsities on a
            0.05 grid whose mean is ``s``, chosen greedily to minimise the summed relative
            MLP output error ``E||Δy_l||² / E||h_l||²`` (``h_l`` the residual stream after
            layer ``l``), measured on ``err_tokens`` calibration tokens per layer).

    Returns:
        ``[CountdownSpec]`` in the order of ``sparsities``.
    """
    return [CountdownSpec(**f)
            for f in calibrate_fields(model, calib_ids, sparsities, mode, **options)]


__all__ = ["CountdownSpec", "calibrate", "calibrate_many"]
