"""What a checkpoint folder holds: file names, the record read back
(:class:`CheckpointInfo`), and the model facts both save and load need (embeddings, ties)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..quantize import QuantizedWeight

CHECKPOINT_JSON = "edgeprune_checkpoint.json"
QPARAMS_FILE = "edgeprune_qparams.safetensors"
MASKS_FILE = "edgeprune_masks.safetensors"
WEIGHTS_FILE = "model.safetensors"
#: What a checkpoint folder holds besides the tokenizer's files: anything else in it is the
#: user's, and ``overwrite`` refuses to delete it.
CHECKPOINT_FILES = frozenset({"config.json", "generation_config.json", WEIGHTS_FILE, QPARAMS_FILE,
                              MASKS_FILE, CHECKPOINT_JSON})
FORMATS = ("compressed-tensors", "dense")
SCHEMA_VERSION = 1


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` read besides the model.

    Attributes:
        path: the checkpoint folder.
        format: ``"compressed-tensors"`` or ``"dense"``.
        quantized: ``module name -> QuantizedWeight`` with the stored integer codes
            (``uint8 [out, in]``), scales (``float32 [out, n_groups]``) and zero points.
        masks: ``module name -> bool [out, in]`` (True = kept) for pruned layers.
        sparsity_pattern: ``module name -> "2:4" | "unstructured" | ...``.
        tied_embeddings: ``"tied"``, ``"untied"`` or ``"untied-quantized-head"``.
        provenance: the ``edgeprune`` record (method, recipe, calibration, seed, ...);
            empty for a compressed-tensors folder written by another tool.
    """

    path: str
    format: str
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    sparsity_pattern: dict[str, str] = field(default_factory=dict)
    tied_embeddings: str = "tied"
    provenance: dict = field(default_factory=dict)

    @property
    def avg_bits_per_weight(self) -> Optional[float]:
        """Weighted average of :meth:`QuantizedWeight.bits_per_weight` over quantized layers."""
        return avg_bits(self.quantized)


def avg_bits(quantized: dict[str, QuantizedWeight]) -> Optional[float]:
    """Bits per weight (scales and zero points included) averaged over the layers'
    weights; ``None`` without quantized layers."""
    if not quantized:
        return None
    tot = sum(q.codes.numel() for q in quantized.values())
    return sum(q.bits_per_weight() * q.codes.numel() for q in quantized.values()) / tot


def is_edgeprune_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder written by :func:`save_checkpoint`."""
    p = Path(path)
    return p.is_dir() and (p / CHECKPOINT_JSON).is_file() and (p / "config.json").is_file()


def text_config(config):
    """The text model's config of a (possibly multimodal) HF config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def embedding_names(model) -> tuple[Optional[str], Optional[str]]:
    """(input embedding param name, output head param name) or None when not found."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in model.named_modules()}
    e = f"{names[id(emb)]}.weight" if emb is not None and id(emb) in names else None
    h = f"{names[id(head)]}.weight" if head is not None and id(head) in names else None
    return e, h


def is_tied(model) -> bool:
    """True when the model's head shares the input embedding's storage."""
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if emb is None or head is None:
        return False
    return emb.weight.data_ptr() == head.weight.data_ptr()


__all__ = ["CHECKPOINT_JSON", "QPARAMS_FILE", "MASKS_FILE", "WEIGHTS_FILE", "CHECKPOINT_FILES",
           "FORMATS", "SCHEMA_VERSION", "CheckpointInfo", "avg_bits", "is_edgeprune_checkpoint",
           "text_config", "embedding_names", "is_tied"]
