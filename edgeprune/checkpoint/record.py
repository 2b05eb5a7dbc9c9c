"""The provenance record of a checkpoint (``edgeprune_checkpoint.json`` and the
``edgeprune`` section of ``config.json``): method name, run id, versions."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..quantize import QuantizedWeight
from .format import SCHEMA_VERSION, avg_bits

#: The record's keys copied into ``config.json``'s ``edgeprune`` section.
CONFIG_KEYS = ("schema_version", "edgeprune_version", "format", "run_id", "method", "recipe",
               "calibration", "seed", "tied_embeddings", "avg_bits_per_weight")


def method_name(recipe: Any, provenance: dict) -> str:
    """``"gptq"``, ``"sparsegpt+gptq"``...: the method(s) of a recipe dict, or the
    provenance's ``method`` (a name, or a recipe dict named the same way)."""
    if isinstance(provenance.get("method"), dict):
        return method_name(provenance["method"], {})
    if provenance.get("method"):
        return str(provenance["method"])
    if isinstance(recipe, dict):
        if recipe.get("method"):
            return str(recipe["method"])
        for key in ("stages", "steps", "methods"):
            st = recipe.get(key)
            if isinstance(st, list) and st:
                return "+".join(str(s.get("method", s.get("name", "?"))) if isinstance(s, dict)
                                else str(s) for s in st)
        if recipe.get("name"):
            return str(recipe["name"])
    return "none" if not recipe else "custom"


def jsonable(x: Any) -> Any:
    """``x`` as JSON values: recipe objects through ``to_dict`` or their dataclass
    fields, one-element tensors as numbers, paths and anything else as strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if hasattr(x, "to_dict"):
        return jsonable(x.to_dict())
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict
        return jsonable(asdict(x))
    return str(x)


def run_id(fmt: str, recipe: Any, provenance: dict) -> str:
    """16 hex digits of the SHA-256 of the format, recipe and provenance: the same
    settings give the same id, and the same run may replace its own folder."""
    blob = json.dumps({"format": fmt, "recipe": jsonable(recipe), "provenance": jsonable(provenance)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def edgeprune_version() -> str:
    """The installed edgeprune's version (``"0.1.0"`` from a source tree)."""
    try:
        from importlib.metadata import version
        return version("edgeprune")
    except Exception:  # noqa: BLE001
        return "0.1.0"


def sparsity_config(sparse_records: dict[str, dict]) -> dict:
    """compressed-tensors' ``sparsity_config`` (``format: "dense"``) of the pruned
    layers' records: targets, global sparsity, structure; ``{}`` without pruned layers."""
    if not sparse_records:
        return {}
    pats = sorted({r["pattern"] for r in sparse_records.values()})
    tot = sum(np.prod(r["shape"]) for r in sparse_records.values())
    gs = sum(r["sparsity"] * np.prod(r["shape"]) for r in sparse_records.values()) / tot
    return {"format": "dense", "targets": sorted(sparse_records),
            "ignore": [], "global_sparsity": round(float(gs), 6),
            "sparsity_structure": pats[0] if len(pats) == 1 else "unstructured"}


def checkpoint_record(fmt: str, run: str, recipe: Any, provenance: dict, tied_policy: str,
                      quantized: dict[str, QuantizedWeight], layer_records: dict,
                      sparse_records: dict) -> dict:
    """The ``edgeprune_checkpoint.json`` record: schema and edgeprune versions, format,
    run id, creation time (UTC), method, recipe, calibration, seed, provenance, tied
    embeddings policy, average bits per weight, per-layer quantization and sparsity."""
    calib = provenance.get("calibration", {})
    return {
        "schema_version": SCHEMA_VERSION,
        "edgeprune_version": edgeprune_version(),
        "format": fmt,
        "run_id": run,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": method_name(recipe, provenance),
        "recipe": jsonable(recipe),
        "calibration": jsonable(calib),
        "seed": provenance.get("seed", calib.get("seed") if isinstance(calib, dict) else None),
        "provenance": jsonable(provenance),
        "tied_embeddings": tied_policy,
        "avg_bits_per_weight": None if not quantized else round(avg_bits(quantized), 5),
        "quantized_layers": layer_records,
        "sparse_layers": sparse_records,
    }


def config_section(record: dict, sparsity: Optional[dict]) -> dict:
    """``config.json``'s ``edgeprune`` section: :data:`CONFIG_KEYS` of the record, and the
    sparsity config when pruned."""
    section = {k: record[k] for k in CONFIG_KEYS}
    if sparsity:
        section["sparsity"] = sparsity
    return section


__all__ = ["method_name", "jsonable", "run_id", "edgeprune_version", "sparsity_config",
           "checkpoint_record", "config_section", "CONFIG_KEYS"]
