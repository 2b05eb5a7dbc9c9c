"""The IG-Pruning spec: the compress-side spec of the ``"igprune"`` graph variant, its
(de)serialisation, and :meth:`IgPruneSpec.calibrate` (static baselines and input-guided
mask candidates).

IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025, "IG-Pruning: Input-Guided Block Pruning for
Large Language Models"): stage 1 clusters calibration prompts and learns one Hard-Concrete
mask over the ``2L`` attention/MLP sub-blocks per cluster (:mod:`.router`, :mod:`.train`);
stage 2 routes each input to its nearest centroid's mask, without further training. A
static spec is the same object with one mask (``method`` ``"angular"``: ShortGPT's Block
Influence, Men et al. 2024; ``"l0"``: the best single Hard-Concrete mask).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import numpy as np
import torch

from edgeprune_exporters.igprune import model_fingerprint

from ..errors import CalibrationError, CheckpointError, ConfigError
from ..variants import VariantSpec, register_variant
from . import config as C
from .gates import gated, masked
from .importance import angular_mask, block_influence
from .router import fit_standardizer, kmeans, nearest, prompt_embeddings, standardize, sweep_k
from .train import mask_kl, train_mask

PAPER = "IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025)"


@register_variant
@dataclass
class IgPruneSpec(VariantSpec):
    """Sub-block masks and their router for one model (graph variant ``"igprune"``,
    exported by ``exporters.igprune.IgPruneMixin``, run by
    ``runtime.igprune.IgPruneSession``).

    Attributes:
        method: ``"ig"`` (input-guided: one mask per cluster), ``"l0"`` (one learned
            mask) or ``"angular"`` (ShortGPT Block Influence, one mask).
        skip_ratio: fraction of the ``2L`` sub-blocks each mask skips, in ``(0, 1)``.
        masks: ``K`` lists of ``2L`` ints (``2i`` attention, ``2i + 1`` MLP of layer
            ``i``; 1 = run).
        centroids: ``float32 [K, H]`` cluster centres in the router's space.
        center, scale: ``float32 [H]`` per-channel standardisation of raw embeddings.
        embed_layer: decoder layers the router runs.
        route_tokens: prompt tokens the router embeds.
        fingerprint: :func:`exporters.igprune.model_fingerprint` of the model calibrated on.
        settings: calibration settings (steps, lr, the K sweep's records...).
        stats: calibration figures (cluster sizes, KL per mask, seconds).
    """

    name: ClassVar[str] = "igprune"
    title: ClassVar[str] = "IG-Pruning spec"

    method: str
    skip_ratio: float
    masks: list
    centroids: np.ndarray
    center: np.ndarray
    scale: np.ndarray
    embed_layer: int
    route_tokens: int
    fingerprint: str
    settings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        C.check_method(self.method)
        self.centroids = np.asarray(self.centroids, np.float32).reshape(len(self.masks), -1)
        self.center = np.asarray(self.center, np.float32).reshape(-1)
        self.scale = np.asarray(self.scale, np.float32).reshape(-1)
        if not self.masks:
            raise ConfigError("an IG-Pruning spec needs at least one mask", "re-run the calibration")
        n = len(self.masks[0])
        self.masks = [C.check_mask(m, n, f"mask {k}") for k, m in enumerate(self.masks)]
        C.check_skip_ratio(self.skip_ratio, n)
        if self.centroids.shape[1] != self.center.shape[0] or self.scale.shape != self.center.shape:
            raise ConfigError(f"IG-Pruning centroids {self.centroids.shape} do not match the "
                              f"standardisation [{self.center.shape[0]}]", "re-run the calibration")

    @property
    def num_sub_blocks(self) -> int:
        return len(self.masks[0])

    # -------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        """Everything but the router arrays (``centroids``, ``center``, ``scale``)."""
        return {"method": self.method, "paper": PAPER, "skip_ratio": self.skip_ratio,
                "masks": [list(m) for m in self.masks], "embed_layer": self.embed_layer,
                "route_tokens": self.route_tokens, "fingerprint": self.fingerprint,
                "settings": self.settings, "stats": self.stats}

    def arrays(self) -> dict:
        """``{"centroids": [K, H], "center": [H], "scale": [H]}`` (float32)."""
        return {"centroids": self.centroids, "center": self.center, "scale": self.scale}

    @classmethod
    def from_dict(cls, d: dict, arrays: Optional[dict] = None) -> "IgPruneSpec":
        """Inverse of :meth:`to_dict` + :meth:`arrays`.

        Raises:
            CheckpointError: a dict or arrays this class did not write.
            ConfigError: a mask that skips every sub-block, a skip ratio outside (0, 1).
        """
        try:
            a = arrays or {}
            return cls(method=d["method"], skip_ratio=float(d["skip_ratio"]), masks=d["masks"],
                       centroids=a["centroids"], center=a["center"], scale=a["scale"],
                       embed_layer=int(d["embed_layer"]), route_tokens=int(d["route_tokens"]),
                       fingerprint=str(d["fingerprint"]), settings=d.get("settings") or {},
                       stats=d.get("stats") or {})
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise CheckpointError(f"corrupt IG-Pruning spec: {e!r}",
                                  "re-run `edgeprune igprune` (specs are .safetensors files)") from e

    # -------------------------------------------------------------- model checks
    def check_model(self, model) -> None:
        """Raises ConfigError when ``model`` is not the one the spec was calibrated on
        (its :func:`~exporters.igprune.model_fingerprint` differs)."""
        fp = model_fingerprint(model)
        if fp != self.fingerprint:
            raise ConfigError(f"this IG-Pruning spec was calibrated on another model "
                              f"(fingerprint {self.fingerprint[:12]}, this model {fp[:12]})",
                              "calibrate a spec for this model with `edgeprune igprune`")

    # -------------------------------------------------------------- routing
    def embed(self, model, ids: torch.Tensor) -> np.ndarray:
        """Router-space embeddings ``float64 [B, H]`` of prompts ``ids int64 [B, S]``."""
        raw = prompt_embeddings(model, ids, self.embed_layer, self.route_tokens)
        return standardize(raw, self.center, self.scale)

    def route(self, model, ids: torch.Tensor) -> np.ndarray:
        """The mask index of each prompt of ``ids int64 [B, S]`` (``int64 [B]``): the
        nearest centroid of its first ``route_tokens`` tokens' embedding."""
        if len(self.masks) == 1:
            return np.zeros(len(ids), np.int64)
        return nearest(self.embed(model, ids), self.centroids)

    def _route_rows(self, model, ids: torch.Tensor, attention_mask=None) -> list:
        """:meth:`route` of each row's real tokens (left padding, where ``attention_mask``
        has zeros, is left out)."""
        if attention_mask is None or bool(attention_mask.bool().all()):
            return self.route(model, ids).tolist()
        return [int(self.route(model, ids[b][attention_mask[b].bool()][None])[0]) for b in range(len(ids))]

    @contextlib.contextmanager
    def reference(self, model, mask=None):
        """Context manager: inside it ``model`` computes what the exported graph computes.

        Args:
            mask: ``None``: every forward call without cached tokens routes each batch
                row by its own first ``route_tokens`` tokens (the runtime routes each
                prompt the same way); a call on top of a KV cache (a continuation, a
                decode step) keeps the masks of the call that filled it (one row's mask
                is repeated over the rows selected from it);
                an index into :attr:`masks`, or a ``2L`` 0/1 list: that mask for every row.

        Raises:
            ConfigError: ``model`` is not the one the spec was calibrated on.
        """
        self.check_model(model)
        if mask is not None:
            m = self.masks[mask] if isinstance(mask, (int, np.integer)) else \
                C.check_mask(mask, self.num_sub_blocks)
            with masked(model, torch.tensor(m)):
                yield model
            return
        rows: dict = {}
        routing = [False]

        def pre(module, args, kwargs):
            if routing[0]:
                return None
            ids = kwargs.get("input_ids", args[0] if args else None)
            if _cached_tokens(kwargs) and "m" in rows:
                rows["m"] = _continued(rows["m"], len(ids))
                return None
            routing[0] = True
            try:
                k = self._route_rows(model, ids, kwargs.get("attention_mask"))
            finally:
                routing[0] = False
            rows["m"] = torch.tensor([self.masks[int(i)] for i in k]).float()
            return None

        hook = model.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            with gated(model, lambda j: None if routing[0] or bool(rows["m"][:, j].all())
                       else rows["m"][:, j]):
                yield model
        finally:
            hook.remove()

    # -------------------------------------------------------------- calibration
    @classmethod
    def calibrate(cls, model, calib_ids, *, skip_ratio: float, method: str = "ig",
                  **options) -> "IgPruneSpec":
        """:func:`calibrate_all` for one ``method``."""
        return calibrate_all(model, calib_ids, skip_ratio, methods=(method,), **options)[method]


def _cached_tokens(kwargs: dict) -> int:
    """Tokens already in the KV cache a forward call got (0 without one)."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    get = getattr(cache, "get_seq_length", None)
    return int(get()) if callable(get) else 0


def _continued(prev: torch.Tensor, rows: int) -> torch.Tensor:
    """The masks ``[rows, 2L]`` of a call continuing one whose masks were ``prev``.

    Raises:
        ConfigError: ``prev`` rows of different masks continued by another row count
            (which row continues which is unknown here).
    """
    if prev.shape[0] == rows:
        return prev
    if bool((prev == prev[:1]).all()):
        return prev[:1].expand(rows, -1)
    raise ConfigError("the rows of a cached forward call cannot be matched to their routed masks",
                      "score one context at a time (batch_groups=1)")


def _check_ids(calib_ids) -> torch.Tensor:
    ids = torch.as_tensor(calib_ids)
    if ids.dim() != 2 or ids.numel() == 0:
        raise CalibrationError(f"IG-Pruning calibration needs windows [nsamples, seqlen], got "
                               f"{tuple(ids.shape)}", "pass edgeprune.calibration windows")
    return ids.long()


@torch.no_grad()
def _base(model, ids, embed_layer, route_tokens):
    emb = prompt_embeddings(model, ids, embed_layer, route_tokens)
    center, scale = fit_standardizer(emb)
    return standardize(emb, center, scale), center, scale


def calibrate_all(model, calib_ids, skip_ratio: float, *, methods=C.METHODS,
                  ks=C.DEFAULT_KS, embed_layer: Optional[int] = None,
                  route_tokens: int = C.DEFAULT_ROUTE_TOKENS, steps: int = C.DEFAULT_STEPS,
                  lr: float = C.DEFAULT_LR, batch: int = C.DEFAULT_BATCH,
                  sparsity_weight: float = C.DEFAULT_SPARSITY_WEIGHT, seed: int = 0,
                  refine: bool = True, progress: bool = False) -> dict:
    """Calibrate IG-Pruning specs at one skip ratio, sharing the embeddings and the Block
    Influence between methods.

    Args:
        model: llama-style HF causal LM (fp32, eval; not modified).
        calib_ids: ``int64 [nsamples, seqlen]``; each window is also one "prompt" of the
            clustering (its first ``route_tokens`` tokens).
        skip_ratio: fraction of the ``2L`` sub-blocks every mask skips, in ``(0, 1)``.
        methods: any of ``"ig"`` (K-means over the K sweep ``ks``, chosen by silhouette,
            one Hard-Concrete mask per cluster), ``"l0"`` (one Hard-Concrete mask on all
            windows), ``"angular"`` (ShortGPT Block Influence).
        embed_layer: router depth (default :data:`~.config.DEFAULT_EMBED_LAYER`).
        route_tokens: prompt tokens the router embeds.
        steps, lr, batch, sparsity_weight: :func:`~.train.train_mask`'s settings.
        seed: K-means and training seed.
        refine: ``ig`` only: each cluster's mask training starts from the single L0
            mask's ``log_alpha`` (refining it on the cluster, instead of from the Block
            Influence), and each cluster keeps, of its trained mask, the single L0 mask
            and the angular mask, the one of lowest KL on its own calibration windows
            (:func:`~.train.mask_kl`; the figures and the choice are in ``stats["train"]``).
            ``False``: the paper's independent per-cluster masks.

    Returns:
        ``{method: IgPruneSpec}``.

    Raises:
        ConfigError: ``skip_ratio`` outside ``(0, 1)`` (or rounding to no / every
            sub-block), an unknown method, a bad ``embed_layer``.
        CalibrationError: empty calibration windows.
    """
    L = model.config.num_hidden_layers
    n = 2 * L
    skip_ratio = C.check_skip_ratio(skip_ratio, n)
    for m in methods:
        C.check_method(m)
    e = C.embed_layer_for(L, embed_layer)
    ids = _check_ids(calib_ids)
    n_skip = C.skip_count(skip_ratio, n)
    t0 = time.perf_counter()
    z, center, scale = _base(model, ids, e, route_tokens)
    bi = block_influence(model, ids, batch=batch)
    fp = model_fingerprint(model)
    train = dict(steps=steps, lr=lr, batch=batch, sparsity_weight=sparsity_weight, seed=seed)
    common = dict(skip_ratio=skip_ratio, center=center, scale=scale, embed_layer=e,
                  route_tokens=route_tokens, fingerprint=fp)
    one_centroid = z.mean(0, keepdims=True).astype(np.float32)
    shared_s = time.perf_counter() - t0       # embeddings + Block Influence, shared by the methods
    base_stats = {"n_skip": n_skip, "num_sub_blocks": n, "calib_windows": int(len(ids)),
                  "block_influence": [float(v) for v in bi]}
    out, single = {}, {}

    def single_l0() -> dict:          # the single L0 mask, trained once for "l0" and refine
        if not single:
            single.update(train_mask(model, ids, n_skip, init=bi, **train))
        return single

    for m in methods:
        t = time.perf_counter()
        if m == "angular":
            out[m] = IgPruneSpec(method=m, masks=[angular_mask(bi, n_skip)], centroids=one_centroid,
                                 settings={}, stats={**base_stats}, **common)
        elif m == "l0":
            r = single_l0()
            out[m] = IgPruneSpec(method=m, masks=[r["mask"]], centroids=one_centroid,
                                 settings=dict(train),
                                 stats={**base_stats, "train": [_brief(r)]}, **common)
        else:
            k, sweep = sweep_k(z, ks, seed=seed, min_cluster=C.MIN_CLUSTER)
            if k == 1:
                cents, labels = one_centroid, np.zeros(len(ids), np.int64)
            else:
                cents, labels, _ = kmeans(z, k, seed)
            masks, runs = [], []
            start = {"log_alpha0": single_l0()["log_alpha"]} if refine else {}
            for c in range(k):
                rows = torch.from_numpy(np.nonzero(labels == c)[0])
                r = train_mask(model, ids[rows], n_skip, init=bi, **start, **{**train, "seed": seed + c})
                run = {**_brief(r), "windows": int(len(rows))}
                if refine:
                    r["mask"], run["candidates"] = _best_candidate(
                        model, ids[rows], {"cluster": r["mask"], "l0": single["mask"],
                                           "angular": angular_mask(bi, n_skip)}, batch)
                masks.append(r["mask"])
                runs.append(run)
                if progress:
                    print(f"igprune: cluster {c + 1}/{k} ({len(rows)} windows) kl {r['kl_last']:.4f}"
                          + (f" candidates {run['candidates']}" if refine else ""))
            out[m] = IgPruneSpec(method=m, masks=masks, centroids=cents,
                                 settings={**train, "ks": list(ks), "k": k, "k_sweep": sweep,
                                           "k_rule": "silhouette", "refine": bool(refine)},
                                 stats={**base_stats, "train": runs,
                                        "cluster_sizes": np.bincount(labels, minlength=k).tolist()},
                                 **common)
        out[m].stats["seconds"] = time.perf_counter() - t
        out[m].stats["shared_seconds"] = shared_s
    return out


def _best_candidate(model, ids, candidates: dict, batch: int) -> tuple[list, dict]:
    """The mask of lowest :func:`~.train.mask_kl` on ``ids`` among ``candidates``
    (``{name: [2L]}``; ties: the first), and ``{"kl": {name: nats}, "chosen": name}``."""
    kls = dict(zip(candidates, mask_kl(model, ids, list(candidates.values()), batch)))
    best = min(kls, key=lambda n: (kls[n], list(candidates).index(n)))
    return candidates[best], {"kl": kls, "chosen": best}


def _brief(r: dict) -> dict:
    return {k: r[k] for k in ("kl_first", "kl_last", "expected_kept", "log_alpha")}


__all__ = ["IgPruneSpec", "calibrate_all", "PAPER"]
