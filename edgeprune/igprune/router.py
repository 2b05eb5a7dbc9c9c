"""IG-Pruning's router: prompt embeddings from the model's own early layers, K-means
clusters (K from a sweep), and the nearest centroid of a prompt.

IG-Pruning (Qiao, Zhang, Feng; EMNLP 2025) embeds inputs with a sentence encoder and
clusters them with K-means; each cluster gets its own mask. Here the encoder is the model
itself, so no extra weights ship: the embedding of a prompt is the mean residual stream
after the first ``embed_layer`` decoder layers over its first ``route_tokens`` tokens,
standardised per channel with the calibration mean/std (massive-activation channels
would otherwise decide every distance) and scaled to unit length. A prompt goes to the
centroid nearest in that space (ties: the lower index). The runtime
(``runtime.igprune``) computes the same embedding with the same layers of the exported
graph and the same arithmetic in numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from .gates import decoder_layers


class _Stop(Exception):
    def __init__(self, hidden):
        super().__init__("router layers done")
        self.hidden = hidden


@torch.no_grad()
def prompt_embeddings(model, ids: torch.Tensor, embed_layer: int, route_tokens: int,
                      batch: int = 8) -> np.ndarray:
    """Raw prompt embeddings: the mean over the first ``route_tokens`` positions of the
    residual stream after ``embed_layer`` layers (HF ``hidden_states[embed_layer]``);
    only those layers run.

    Args:
        ids: ``int64 [N, S]`` prompts (or calibration windows).

    Returns:
        ``float32 [N, H]``.
    """
    layer = decoder_layers(model)[embed_layer - 1]

    def stop(module, args, out):
        raise _Stop(out[0] if isinstance(out, tuple) else out)

    out = []
    h = layer.register_forward_hook(stop)
    try:
        for s in range(0, len(ids), batch):
            try:
                model(ids[s:s + batch, :route_tokens])
            except _Stop as e:
                out.append(e.hidden.float().mean(1))
    finally:
        h.remove()
    return torch.cat(out).cpu().numpy().astype(np.float32)


def standardize(emb: np.ndarray, center: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``(emb - center) / scale`` per channel, each row scaled to unit L2 norm
    (float64 ``[N, H]``)."""
    z = (np.asarray(emb, np.float64) - center) / scale
    return z / np.maximum(np.linalg.norm(z, axis=-1, keepdims=True), 1e-12)


def fit_standardizer(emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(center, scale)`` (``float32 [H]``) of calibration embeddings."""
    e = np.asarray(emb, np.float64)
    return e.mean(0).astype(np.float32), np.maximum(e.std(0), 1e-6).astype(np.float32)


def nearest(z: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid (L2) of each row of ``z [N, H]`` (``int64 [N]``)."""
    d = ((np.asarray(z, np.float64)[:, None, :] - np.asarray(centroids, np.float64)[None]) ** 2).sum(-1)
    return np.argmin(d, axis=1).astype(np.int64)


def kmeans(z: np.ndarray, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """K-means (sklearn's, ``n_init=10``) of ``z [N, H]``: ``(centroids float32 [k, H],
    labels int64 [N], inertia)``; labels are re-read as :func:`nearest` so they match
    the router exactly."""
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(z)
    c = km.cluster_centers_.astype(np.float32)
    return c, nearest(z, c), float(km.inertia_)


def sweep_k(z: np.ndarray, ks, seed: int = 0, min_cluster: int = 2) -> tuple[int, list]:
    """Choose K by the silhouette score of K-means over ``ks``.

    A K whose smallest cluster has fewer than ``min_cluster`` windows is not eligible
    (its mask would be fitted on too little data).

    Returns:
        ``(K, records)``: records ``[{"k", "silhouette", "inertia", "sizes", "eligible"}]``;
        ``K = 1`` when no K is eligible.
    """
    from sklearn.metrics import silhouette_score

    recs, best = [], (None, -2.0)
    for k in ks:
        k = int(k)
        if k < 2 or k >= len(z):
            continue
        c, labels, inertia = kmeans(z, k, seed)
        sizes = np.bincount(labels, minlength=k).tolist()
        ok = min(sizes) >= min_cluster and len(set(labels.tolist())) > 1
        sil = float(silhouette_score(z, labels)) if len(set(labels.tolist())) > 1 else -1.0
        recs.append({"k": k, "silhouette": sil, "inertia": inertia, "sizes": sizes, "eligible": ok})
        if ok and sil > best[1]:
            best = (k, sil)
    return (best[0] or 1), recs


__all__ = ["prompt_embeddings", "standardize", "fit_standardizer", "nearest", "kmeans", "sweep_k"]
