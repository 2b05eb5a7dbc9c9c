"""Saving a compressed model as a checkpoint folder (both formats: see :mod:`edgeprune.checkpoint`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from edgeprune_runtime.files import atomic_folder, write_json

from ..errors import CheckpointError
from ..quantize import QuantizedWeight
from .folder import claim_out_dir, source_paths
from .format import (CHECKPOINT_JSON, FORMATS, MASKS_FILE, QPARAMS_FILE, WEIGHTS_FILE,
                     embedding_names, is_tied)
from .embeddings import storage_dtype
from .pack import pack_int32, pack_mask, pad_rows
from .record import checkpoint_record, config_section, run_id, sparsity_config

#: Config keys that point transformers at the source folder's own Python code
#: (``trust_remote_code``): the checkpoint holds no such code, so they are not copied.
REMOTE_CODE_KEYS = ("auto_map", "custom_pipelines")
#: compressed-tensors layouts of asymmetric layers (``save_checkpoint(asym_layout=...)``):
#: ``pack-quantized``: codes packed 8 per int32, zero points packed along the output
#: dimension and zero-padded to ``[out, n_groups]`` rows (the shape transformers 5.24 +
#: compressed-tensors 0.20 allocate, llm-compressor#1618; their unpacking reads only the
#: leading packed rows); ``pack-quantized-compact``: the same without the padding, the
#: layout llm-compressor writes (plain transformers 5.24 cannot load it);
#: ``naive-quantized``: one int8 per code.
ASYM_LAYOUTS = ("pack-quantized", "pack-quantized-compact", "naive-quantized")


def _group_key(qw: QuantizedWeight, asym_layout: str = "pack-quantized") -> tuple:
    """``(bits, group_size or -1, sym, act_order, layout)``: one compressed-tensors
    config group per distinct key."""
    mid = 2 ** (qw.bits - 1)
    sym = bool(qw.sym) and bool((qw.zeros == mid).all())
    per_row = qw.n_groups == 1 and qw.group_size >= qw.shape[1]
    layout = "naive-quantized" if not sym and asym_layout == "naive-quantized" else "pack-quantized"
    return (qw.bits, -1 if per_row else qw.group_size, sym, not qw.has_default_order(), layout)


def _weights_args(key: tuple) -> dict:
    bits, gs, sym, actorder, _layout = key
    args = {"num_bits": bits, "type": "int", "symmetric": sym,
            "group_size": None if gs == -1 else gs,
            "strategy": "channel" if gs == -1 else "group", "dynamic": False}
    if actorder:
        args["actorder"] = "group"
    return args


def _ct_version() -> str:
    try:
        from importlib.metadata import version
        return version("compressed-tensors")
    except Exception:  # noqa: BLE001 - the package is optional for writing
        return "0.20.1"


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt", **(metadata or {})})


# --------------------------------------------------------------------------- steps

def _check_options(format: str, asym_layout: str) -> None:
    if asym_layout not in ASYM_LAYOUTS:
        raise CheckpointError(f"unknown asym_layout {asym_layout!r}",
                              f"use one of {', '.join(ASYM_LAYOUTS)}")
    if format not in FORMATS:
        raise CheckpointError(f"unknown checkpoint format {format!r}",
                              f"use one of {', '.join(FORMATS)}")


def _check_linear(model, names) -> None:
    modules = dict(model.named_modules())
    for name in names:
        if not isinstance(modules.get(name), torch.nn.Linear):
            raise CheckpointError(f"{name!r} is not a linear layer of this model",
                                  "result.quantized / result.masks keys must be module names "
                                  "such as 'model.layers.0.self_attn.q_proj'")


def _tied_policy(model, quantized: dict) -> str:
    """``"untied-quantized-head"`` when the head is quantized, else ``"tied"`` /
    ``"untied"`` as the source model."""
    tied_src = is_tied(model)
    _, head_name = embedding_names(model)
    head_mod = head_name.rsplit(".", 1)[0] if head_name else None
    if head_mod in quantized:
        return "untied-quantized-head"
    return "tied" if tied_src else "untied"


def _dense_tensors(model, sd: dict, tied_policy: str, half_embeddings: bool) -> dict[str, torch.Tensor]:
    """The state dict on the CPU; a tied head is dropped from ``sd`` (stored once, as the
    embedding: transformers' own convention); an untied embedding is copied. With
    ``half_embeddings`` the embedding and an unquantized head are stored in 16 bits where
    that keeps every value (:func:`~edgeprune.checkpoint.embeddings.storage_dtype`)."""
    emb_name, head_name = embedding_names(model)
    if tied_policy == "tied" and head_name in sd:
        sd.pop(head_name)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        tensors[k] = v.detach().to("cpu").clone() if (tied_policy == "untied-quantized-head"
                                                      and k == emb_name) else v.detach().cpu()
        exact = storage_dtype(tensors[k]) if half_embeddings and k in (emb_name, head_name) else None
        if exact is not None:
            tensors[k] = tensors[k].to(exact)
    return tensors


def _checked_dequantized(name: str, qw: QuantizedWeight, sd: dict) -> torch.Tensor:
    """``qw.dequantize()`` rounded to the model's dtype (float32), after checking it is
    the model's weight (a half-precision model holds it rounded).

    Raises:
        CheckpointError: shapes differ, or the weight was changed after compression.
    """
    stored = sd[f"{name}.weight"].dtype
    w = sd[f"{name}.weight"].detach().float().cpu()
    if tuple(w.shape) != tuple(qw.shape):
        raise CheckpointError(f"{name}: weight shape {tuple(w.shape)} != codes shape {qw.shape}",
                              "save the model that produced this CompressionResult")
    w_hat = qw.dequantize().to(stored).float()
    if torch.equal(w, w_hat):          # the usual case, without allclose's cost
        return w_hat
    tol = 1e-5 * float(w_hat.abs().max()) + 1e-7
    if not torch.allclose(w, w_hat, rtol=1e-5, atol=tol):
        raise CheckpointError(
            f"{name}: the model's weight differs from its integer codes "
            f"(max |diff| {float((w - w_hat).abs().max()):.3g})",
            "the model was modified after compression; re-run compress or save the "
            "matching model")
    return w_hat


def _layer_tensors(name: str, qw: QuantizedWeight, key: tuple, format: str, w_hat: torch.Tensor,
                   dtype: torch.dtype, tensors: dict, qparams: dict, pad_zero_points: bool = True) -> None:
    """Store one quantized layer: compressed-tensors ``naive-quantized`` (signed int8
    codes as ``weight``) or ``pack-quantized`` (``weight_packed`` + ``weight_shape``, zero
    points packed along the output dimension, zero-padded to ``[out, n_groups]`` with
    ``pad_zero_points``) in ``tensors``; ``dense``: the dequantized weight in ``tensors``,
    scales / zero points in ``qparams``. ``weight_g_idx`` for act_order with dynamic groups."""
    w, mid = f"{name}.weight", 2 ** (qw.bits - 1)
    naive = key[4] == "naive-quantized"
    side = qparams if format == "dense" else tensors
    if format == "dense":
        tensors[w] = w_hat.to(dtype)
    elif naive:
        tensors[w] = (qw.codes.to(torch.int16) - mid).to(torch.int8)
    else:
        del tensors[w]
        tensors[f"{name}.weight_packed"] = pack_int32(qw.codes, qw.bits, 1)
    side[f"{name}.weight_scale"] = qw.scales.float().contiguous()
    if format == "dense":
        side[f"{name}.weight_zero_point"] = qw.zeros.to(torch.uint8).contiguous()
    elif naive:
        side[f"{name}.weight_zero_point"] = (qw.zeros.to(torch.int16) - mid).to(torch.int8)
    else:
        tensors[f"{name}.weight_shape"] = torch.tensor(list(qw.shape), dtype=torch.int64)
        if not key[2]:
            zp = pack_int32(qw.zeros, qw.bits, 0)
            tensors[f"{name}.weight_zero_point"] = pad_rows(zp, qw.shape[0]) if pad_zero_points else zp
    if key[3]:
        side[f"{name}.weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()


def _store_quantized(tensors: dict, sd: dict, quantized: dict[str, QuantizedWeight], format: str,
                     asym_layout: str) -> tuple[dict, dict, dict]:
    """Every quantized layer into ``tensors`` / the returned qparams; returns
    ``(qparams, per-layer records, {group key: layer names})``."""
    qparams: dict[str, torch.Tensor] = {}
    layer_records: dict[str, dict] = {}
    groups: dict[tuple, list[str]] = {}
    for name, qw in quantized.items():
        w_hat = _checked_dequantized(name, qw, sd)
        key = _group_key(qw, asym_layout)
        groups.setdefault(key, []).append(name)
        layer_records[name] = {"bits": qw.bits, "group_size": qw.group_size, "sym": key[2],
                               "act_order": key[3], "bits_per_weight": round(qw.bits_per_weight(), 5),
                               "shape": list(qw.shape)}
        _layer_tensors(name, qw, key, format, w_hat, sd[f"{name}.weight"].dtype, tensors, qparams,
                       pad_zero_points=asym_layout != "pack-quantized-compact")
    return qparams, layer_records, groups


def _store_masks(masks: dict, patterns: dict, quantized: dict, sd: dict) -> tuple[dict, dict]:
    """Packed masks, only where they cannot be read back as ``weight != 0`` (a kept
    weight that is exactly zero), and the pruned layers' records."""
    mask_tensors: dict[str, torch.Tensor] = {}
    sparse_records: dict[str, dict] = {}
    for name, m in masks.items():
        m = m.bool().cpu()
        w_now = quantized[name].dequantize() if name in quantized else sd[f"{name}.weight"].float().cpu()
        derived = bool(torch.equal(m, w_now != 0))
        if not derived:
            mask_tensors[f"{name}.mask_packed"] = pack_mask(m)
        sparse_records[name] = {"pattern": patterns.get(name, "unstructured"),
                                "sparsity": round(1.0 - float(m.float().mean()), 6),
                                "shape": list(m.shape),
                                "mask": "nonzero" if derived else "stored"}
    return mask_tensors, sparse_records


def _quantization_config(groups: dict[tuple, list[str]], sparsity: dict) -> dict:
    """compressed-tensors' ``quantization_config``: one config group per key, targeting
    the exact module names."""
    return {
        "quant_method": "compressed-tensors",
        "format": ("pack-quantized" if all(k[4] == "pack-quantized" for k in groups)
                   else "mixed-precision"),
        "quantization_status": "compressed",
        "version": _ct_version(),
        "config_groups": {
            f"group_{i}": {"targets": sorted(names), "weights": _weights_args(key),
                           "input_activations": None, "output_activations": None,
                           "format": key[4]}
            for i, (key, names) in enumerate(sorted(groups.items()))},
        "ignore": [],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": sparsity,
        "transform_config": {},
    }


def _hf_config(model, format: str, tied_policy: str, quantized: dict, groups: dict,
               sparsity: dict, record: dict) -> dict:
    """``config.json``: the model's config, untied when the head is quantized, with the
    ``quantization_config`` and the ``edgeprune`` section, the model's ``dtype`` when the
    config has none, without the source's pointers to remote code (:data:`REMOTE_CODE_KEYS`)."""
    cfg = model.config.to_dict()
    for k in ("quantization_config", "edgeprune") + REMOTE_CODE_KEYS:
        cfg.pop(k, None)
    if cfg.get("dtype") is None and cfg.get("torch_dtype") is None:
        # without it transformers takes the first float tensor's dtype: a 16-bit embedding
        # would load the whole model in 16 bits
        cfg["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    if tied_policy == "untied-quantized-head":
        cfg["tie_word_embeddings"] = False
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"]["tie_word_embeddings"] = False
    if format == "compressed-tensors" and quantized:
        cfg["quantization_config"] = _quantization_config(groups, sparsity)
    cfg["edgeprune"] = config_section(record, sparsity)
    return cfg


def _write_files(folder: Path, model, tokenizer, cfg: dict, record: dict, tensors: dict,
                 qparams: dict, mask_tensors: dict) -> None:
    write_json(folder / "config.json", cfg, sort_keys=True)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(folder))
        except Exception:  # noqa: BLE001 - a bad generation config never blocks a save
            pass
    _write_safetensors(tensors, folder / WEIGHTS_FILE)
    if qparams:
        _write_safetensors(qparams, folder / QPARAMS_FILE)
    if mask_tensors:
        _write_safetensors(mask_tensors, folder / MASKS_FILE)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
        _drop_remote_code(folder / "tokenizer_config.json")
    write_json(folder / CHECKPOINT_JSON, record)


def _drop_remote_code(path: Path) -> None:
    """Remove :data:`REMOTE_CODE_KEYS` from a saved JSON file (the tokenizer's config):
    the code they point at is not part of the checkpoint."""
    if not path.is_file():
        return
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(cfg, dict) and any(k in cfg for k in REMOTE_CODE_KEYS):
        write_json(path, {k: v for k, v in cfg.items() if k not in REMOTE_CODE_KEYS})


# --------------------------------------------------------------------------- save

def save_checkpoint(model, tokenizer, result=None, out_dir: str | os.PathLike = "checkpoint", *,
                    format: str = "compressed-tensors", provenance: Optional[dict] = None,
                    overwrite: bool = False, asym_layout: str = "pack-quantized") -> Path:
    """Save a (compressed) causal LM as a folder transformers can load.

    The folder is claimed first (:func:`~edgeprune.checkpoint.claim_out_dir`: a second
    writer is refused at once; a claim this thread holds is joined) and written
    atomically (:func:`runtime.files.atomic_folder`).

    Args:
        model: the HF model holding the dense-equivalent weights (as left by
            ``edgeprune.engine.compress``: every quantized layer's ``weight`` equals
            ``result.quantized[name].dequantize()``).
        tokenizer: saved next to the weights (may be ``None``).
        result: an ``edgeprune.engine.CompressionResult`` (or anything with
            ``.quantized``, ``.masks``, ``.sparsity_pattern``, ``.recipe``), or ``None``
            for an uncompressed model.
        out_dir: output folder; must not be (inside) the source model folder.
        format: ``"compressed-tensors"`` (packed int codes) or ``"dense"``.
        provenance: recorded as is; recognised keys: ``method``, ``source``,
            ``calibration`` (``{"source", "nsamples", "seqlen", "seed"}``), ``seed``.
        overwrite: replace a non-empty ``out_dir`` that holds a different run.
        asym_layout: compressed-tensors layout of *asymmetric* layers
            (:data:`ASYM_LAYOUTS`): ``"pack-quantized"`` (default; codes packed 8 per
            int32, zero points packed and zero-padded to the ``[out, n_groups]`` shape
            plain transformers 5.24 + compressed-tensors 0.20 allocate, so it loads there:
            the work-around of llm-compressor#1618), ``"pack-quantized-compact"`` (zero
            points without the padding, as llm-compressor writes them; transformers 5.24
            cannot load it) or ``"naive-quantized"`` (one int8 per code, twice the bytes
            of 4-bit layers). Symmetric layers are always packed; edgeprune's own loader
            reads all three.

    In the ``compressed-tensors`` format the embedding (and an unquantized head) is
    stored in 16 bits when that keeps every value
    (:func:`~edgeprune.checkpoint.embeddings.storage_dtype`; round it first with
    :func:`~edgeprune.checkpoint.round_embeddings` for a small checkpoint of a float32
    model); nothing saved ever differs from the model's weights.

    Returns:
        The output folder path.

    Raises:
        CheckpointError: unknown ``format``; ``out_dir`` is non-empty and holds a
            different run (without ``overwrite``); ``out_dir`` is or contains the input
            model folder; another process is writing it; a quantized layer's weight
            disagrees with its integer codes; a quantized name that is not a linear layer;
            any I/O failure (nothing is left on disk in that case).
    """
    _check_options(format, asym_layout)
    provenance = dict(provenance or {})
    quantized: dict[str, QuantizedWeight] = dict(getattr(result, "quantized", None) or {})
    masks: dict[str, torch.Tensor] = dict(getattr(result, "masks", None) or {})
    patterns: dict[str, str] = dict(getattr(result, "sparsity_pattern", None) or {})
    recipe = getattr(result, "recipe", None) or {}
    run = run_id(format, recipe, provenance)

    out = Path(out_dir).expanduser().resolve()
    with claim_out_dir(out, source_paths(model, provenance), overwrite, run):
        _check_linear(model, list(quantized) + list(masks))
        tied_policy = _tied_policy(model, quantized)
        sd = model.state_dict()
        tensors = _dense_tensors(model, sd, tied_policy, half_embeddings=format == "compressed-tensors")
        qparams, layer_records, groups = _store_quantized(tensors, sd, quantized, format, asym_layout)
        mask_tensors, sparse_records = _store_masks(masks, patterns, quantized, sd)
        sparsity = sparsity_config(sparse_records)
        record = checkpoint_record(format, run, recipe, provenance, tied_policy, quantized,
                                   layer_records, sparse_records)
        try:
            # temp folder beside `out`, renamed over it at the end; removed (with any parent
            # folders made for it) on any failure or interrupt, Ctrl-C included
            with atomic_folder(out, overwrite=True, error=CheckpointError) as tmp:
                cfg = _hf_config(model, format, tied_policy, quantized, groups, sparsity, record)
                _write_files(tmp, model, tokenizer, cfg, record, tensors, qparams, mask_tensors)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised as a CheckpointError with a hint
            raise CheckpointError(f"writing the checkpoint to {out} failed: {e}",
                                  "check free disk space and permissions; nothing was written") from e
    return out


__all__ = ["save_checkpoint", "ASYM_LAYOUTS"]
