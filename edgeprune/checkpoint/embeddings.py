"""Embeddings in 16 bits: the step that makes a 4-bit checkpoint small.

A 4-bit SmolLM2-135M stores ~100M linear weights in ~60 MB, but its 49152 x 576 float32
embedding alone is 113 MB. :func:`round_embeddings` puts the input embedding (and an
untied, unquantized output head) on a 16-bit grid in place, so the model in memory is
exactly what is saved; :func:`storage_dtype` lets the writer store any such tensor in 16
bits without changing a value (a bfloat16 source model's embedding needs no rounding).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..errors import CheckpointError
from .format import embedding_names, is_tied

#: the values of ``embedding_dtype`` (``"auto"``: bfloat16 when that is exact, else float16
#: when every value is in its range, else bfloat16; ``"float32"``: leave the weights as they are)
EMBEDDING_DTYPES = ("auto", "float16", "bfloat16", "float32")
#: largest magnitude "auto" rounds to float16 (its largest finite value is 65504)
_FP16_LIMIT = 60000.0


def storage_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The 16-bit float dtype that holds every value of ``t`` exactly (bfloat16 first,
    then float16), ``None`` when neither does or ``t`` is already 16-bit or not float32."""
    if t.dtype != torch.float32:
        return None
    for dt in (torch.bfloat16, torch.float16):
        if torch.equal(t.to(dt).float(), t):
            return dt
    return None


def _rounding_dtype(t: torch.Tensor, dtype: str) -> torch.dtype:
    if dtype == "float16":
        return torch.float16
    if dtype == "bfloat16":
        return torch.bfloat16
    exact = storage_dtype(t)                         # "auto"
    if exact is not None:
        return exact
    return torch.float16 if float(t.abs().max()) <= _FP16_LIMIT else torch.bfloat16


def round_embeddings(model, dtype: str = "auto", skip: Iterable[str] = ()) -> Optional[str]:
    """Round the input embedding (and an untied output head not in ``skip``) of ``model``
    to a 16-bit float grid, in place; the tensors keep their dtype (float32), so the model
    computes what the checkpoint will hold (:func:`storage_dtype` then stores them in 16
    bits). Call it before compression, so calibration sees the rounded embedding.

    Args:
        model: a transformers causal LM.
        dtype: one of :data:`EMBEDDING_DTYPES`; ``"float32"`` changes nothing.
        skip: module names not to touch (e.g. a head the recipe quantizes).

    Returns:
        The 16-bit dtype used (``"float16"`` / ``"bfloat16"``), or ``None`` (``"float32"``,
        or no float32 embedding).

    Raises:
        CheckpointError: an unknown ``dtype``; a float16 rounding that would overflow.
    """
    if dtype not in EMBEDDING_DTYPES:
        raise CheckpointError(f"unknown embedding dtype {dtype!r}", f"use one of {', '.join(EMBEDDING_DTYPES)}")
    if dtype == "float32":
        return None
    emb_name, head_name = embedding_names(model)
    names = [emb_name] if emb_name else []
    if head_name and not is_tied(model) and head_name.rsplit(".", 1)[0] not in set(skip):
        names.append(head_name)
    params = dict(model.named_parameters())
    used = None
    with torch.no_grad():
        for name in names:
            p = params.get(name)
            if p is None or p.dtype != torch.float32:
                continue
            dt = _rounding_dtype(p.data, dtype)
            if dt == torch.float16 and float(p.data.abs().max()) > 65504.0:
                raise CheckpointError(f"{name} has values beyond float16's range (65504)",
                                      "use embedding dtype bfloat16 or auto")
            p.data.copy_(p.data.to(dt).float())
            used = str(dt).replace("torch.", "")
    return used


__all__ = ["EMBEDDING_DTYPES", "storage_dtype", "round_embeddings"]
