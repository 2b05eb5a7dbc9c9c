"""Compressed checkpoints: save and load a compressed model as a folder transformers reads.

Two on-disk formats (:func:`save_checkpoint`, ``format=``):

``"compressed-tensors"`` (default)
    The ``compressed-tensors`` library's ``pack-quantized`` format, the one llm-compressor
    writes and transformers / vLLM load. For every quantized linear layer ``<name>``,
    ``model.safetensors`` holds, instead of ``<name>.weight``:

    * ``weight_packed``  ``int32 [out, ceil(in*bits/32)]``: the codes, packed densely
      along the input dimension, element ``i`` at bits ``[i*bits, (i+1)*bits)`` of the
      row's little-endian bit stream (values may straddle two words for 3-bit);
    * ``weight_scale``   ``float32 [out, n_groups]``;
    * ``weight_zero_point`` ``int32 [ceil(out*bits/32), n_groups]`` (asymmetric only),
      packed the same way along the *output* dimension;
    * ``weight_shape``   ``int64 [2]`` = ``(out, in)``;
    * ``weight_g_idx``   ``int32 [in]`` only for GPTQ ``act_order`` with dynamic groups
      (``actorder: "group"``; compressed-tensors >= 0.15 refuses such checkpoints with a
      clear error, :func:`load_checkpoint` reads them).

    compressed-tensors stores *signed* codes ``q = code - 2**(bits-1)`` and packs
    ``q + 2**(bits-1)``: the packed nibble is exactly our unsigned code, and its
    dequantization ``(q - zp) * scale`` equals ours ``(code - zero) * scale`` bit for bit
    (both differences are exact small integers in float32). Nothing is re-rounded.
    ``config.json`` gets a ``quantization_config`` (``quant_method: "compressed-tensors"``)
    with one config group per distinct ``(bits, group_size, sym, act_order)`` whose
    ``targets`` are the exact module names, so mixed precision is expressed directly.
    Sparsity (2:4 or unstructured, from pruning) is recorded in ``sparsity_config`` with
    ``format: "dense"`` (compressed-tensors >= 0.15 dropped its ``sparse-24-bitmask``
    compressor; the zeros are stored as they are and the structure is marked).

``"dense"``
    A plain transformers folder with dense float weights (the dequantized values), plus a
    sidecar ``edgeprune_qparams.safetensors`` (scales, zero points, ``g_idx``) from which
    :func:`load_checkpoint` re-derives the integer codes exactly and checks them.

Both formats also get:

* an ``edgeprune`` section in ``config.json`` and a separate ``edgeprune_checkpoint.json``
  (method, recipe, calibration source/size, seed, tied-embedding policy, per-layer bits,
  group size, sparsity pattern, average bits per weight, run id);
* ``edgeprune_masks.safetensors`` only for pruned layers whose mask is *not* simply
  ``weight != 0`` (a kept weight that is exactly zero), as packed bits.

Tied embeddings policy (recorded as ``tied_embeddings``): ``"tied"`` when the source ties
``lm_head`` to ``embed_tokens`` and ``lm_head`` is not quantized (the default: only the
embedding tensor is stored, as transformers does); ``"untied-quantized-head"`` when the
recipe quantized ``lm_head`` (the embedding stays dense, the head is stored packed,
``tie_word_embeddings`` becomes false); ``"untied"`` when the source was untied. The
embedding tensor is always present after save and reload.

Writes are atomic: everything goes to a temporary folder next to ``out_dir``, which is
renamed into place only when complete; on any failure nothing is left behind and an
existing ``out_dir`` is untouched.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import torch

from .errors import CheckpointError
from .quantize import QuantizedWeight

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

__all__ = ["save_checkpoint", "load_checkpoint", "is_edgeprune_checkpoint", "CheckpointInfo",
           "pack_int32", "unpack_int32", "FORMATS"]


# --------------------------------------------------------------------------- packing

def pack_int32(values: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack unsigned integers densely into int32 words (compressed-tensors' layout).

    Args:
        values: integer tensor ``[rows, cols]`` with values in ``[0, 2**bits-1]``.
        bits: 1..8.
        packed_dim: 1 packs along columns (weights), 0 along rows (zero points).

    Returns:
        ``int32 [rows, ceil(cols*bits/32)]`` (``packed_dim=1``) or
        ``[ceil(rows*bits/32), cols]`` (``packed_dim=0``). Element ``i`` of a line occupies
        bits ``[i*bits, (i+1)*bits)`` of the line's little-endian bit stream.
    """
    if not 1 <= bits <= 8:
        raise CheckpointError(f"cannot pack {bits}-bit values", "bits must be in 1..8")
    v = values.detach().cpu().to(torch.int64).numpy()
    if packed_dim == 0:
        v = v.T
    if v.size and (v.min() < 0 or v.max() >= 2 ** bits):
        raise CheckpointError(f"values outside [0, {2 ** bits - 1}] cannot be packed in {bits} bits",
                              "quantize first; codes must be unsigned")
    rows, cols = v.shape
    n_words = math.ceil(cols * bits / 32)
    # bits of every element, least significant first: [rows, cols, bits]
    bitarr = ((v[:, :, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(rows, cols * bits)
    pad = n_words * 32 - cols * bits
    if pad:
        bitarr = np.pad(bitarr, ((0, 0), (0, pad)))
    packed = np.packbits(bitarr, axis=1, bitorder="little")  # [rows, n_words*4] bytes
    words = np.ascontiguousarray(packed).view("<u4").astype(np.uint32).view(np.int32)
    out = torch.from_numpy(words.copy())
    return out.T.contiguous() if packed_dim == 0 else out


def unpack_int32(packed: torch.Tensor, bits: int, shape: Iterable[int], packed_dim: int = 1
                 ) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``uint8 [rows, cols]`` of ``shape`` (rows, cols)."""
    rows, cols = (int(s) for s in shape)
    p = packed.detach().cpu().to(torch.int32).numpy()
    if packed_dim == 0:
        p = p.T
        rows, cols = cols, rows
    n_words = math.ceil(cols * bits / 32)
    if p.shape != (rows, n_words):
        raise CheckpointError(
            f"packed tensor has shape {tuple(p.shape)}, expected {(rows, n_words)} for "
            f"{cols} {bits}-bit values per line", "the checkpoint is corrupt or its config "
            "does not match its tensors")
    by = np.ascontiguousarray(p.astype("<i4")).view(np.uint8)  # [rows, n_words*4]
    bitarr = np.unpackbits(by, axis=1, bitorder="little")[:, :cols * bits].reshape(rows, cols, bits)
    vals = (bitarr.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=2).astype(np.uint8)
    out = torch.from_numpy(vals)
    return out.T.contiguous() if packed_dim == 0 else out


def _pack_mask(mask: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(mask.cpu().numpy().astype(bool).reshape(-1), bitorder="little"))


def _unpack_mask(packed: torch.Tensor, shape) -> torch.Tensor:
    n = int(np.prod(shape))
    bits = np.unpackbits(packed.numpy(), bitorder="little")[:n]
    return torch.from_numpy(bits.astype(bool).reshape(tuple(shape)))


# --------------------------------------------------------------------------- info

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
        return _avg_bits(self.quantized)


def _avg_bits(quantized: dict[str, QuantizedWeight]) -> Optional[float]:
    if not quantized:
        return None
    tot = sum(q.codes.numel() for q in quantized.values())
    return sum(q.bits_per_weight() * q.codes.numel() for q in quantized.values()) / tot


def is_edgeprune_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder written by :func:`save_checkpoint`."""
    p = Path(path)
    return p.is_dir() and (p / CHECKPOINT_JSON).is_file() and (p / "config.json").is_file()


# --------------------------------------------------------------------------- helpers

def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _embedding_names(model) -> tuple[Optional[str], Optional[str]]:
    """(input embedding param name, output head param name) or None when not found."""
    params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in model.named_modules()}
    e = f"{names[id(emb)]}.weight" if emb is not None and id(emb) in names else None
    h = f"{names[id(head)]}.weight" if head is not None and id(head) in names else None
    del params
    return e, h


def _is_tied(model) -> bool:
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if emb is None or head is None:
        return False
    return emb.weight.data_ptr() == head.weight.data_ptr()


def _method_name(recipe: Any, provenance: dict) -> str:
    """``"gptq"``, ``"sparsegpt+gptq"``...: the method(s) of a recipe dict, or the
    provenance's ``method`` (a name, or a recipe dict named the same way)."""
    if isinstance(provenance.get("method"), dict):
        return _method_name(provenance["method"], {})
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


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if hasattr(x, "to_dict"):
        return _jsonable(x.to_dict())
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict
        return _jsonable(asdict(x))
    return str(x)


def _run_id(fmt: str, recipe: Any, provenance: dict) -> str:
    blob = json.dumps({"format": fmt, "recipe": _jsonable(recipe), "provenance": _jsonable(provenance)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _source_dir(model, provenance: dict) -> list[Path]:
    out = []
    for cand in (getattr(model.config, "_name_or_path", None), getattr(model, "name_or_path", None),
                 provenance.get("source_path"), provenance.get("source")):
        if cand and isinstance(cand, (str, os.PathLike)):
            p = Path(cand)
            if p.exists():                       # a folder, or a single file (.gguf)
                out.append(p.resolve())
    return out


def check_out_dir(out: Path, sources: list[Path], overwrite: bool, run_id: str = "") -> None:
    """Refuse a checkpoint folder that is, holds or lies in an input model folder (or is
    or holds an input file), a non-empty folder holding another run (``run_id``
    differs) without ``overwrite``, and, even with it, a folder that is not an edgeprune
    checkpoint: its files would be deleted.

    Raises:
        CheckpointError: naming the folder and the fix.
    """
    from exporters.folder import TOKENIZER_FILES, foreign_entries, shown_names, source_conflict

    why = source_conflict(out, sources)
    if why:
        raise CheckpointError(f"refusing to write the checkpoint there: {why}",
                              "choose an output folder outside the source model's folder")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a folder", "pass a folder path")
    if out.exists() and any(out.iterdir()):
        other = foreign_entries(out, CHECKPOINT_FILES | TOKENIZER_FILES, marker=CHECKPOINT_JSON)
        if other:
            raise CheckpointError(f"{out} holds files that are not an edgeprune checkpoint "
                                  f"({shown_names(other)}); overwrite only replaces an earlier checkpoint",
                                  "choose a new or empty output folder")
        if not overwrite:
            same = False
            try:
                same = json.loads((out / CHECKPOINT_JSON).read_text()).get("run_id") == run_id
            except (OSError, ValueError, AttributeError):
                same = False
            if not same:
                # run_id "": the caller checks before the run exists (CLI, ahead of calibrating)
                raise CheckpointError(f"{out} already holds a checkpoint" if not run_id else
                                      f"{out} is not empty and holds a different run",
                                      "pass overwrite=True (CLI: --overwrite) to replace it, or "
                                      "choose another folder")


def _group_key(qw: QuantizedWeight, asym_layout: str = "pack-quantized") -> tuple:
    mid = 2 ** (qw.bits - 1)
    sym = bool(qw.sym) and bool((qw.zeros == mid).all())
    per_row = qw.n_groups == 1 and qw.group_size >= qw.shape[1]
    layout = "pack-quantized" if sym else asym_layout
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


# --------------------------------------------------------------------------- save

def save_checkpoint(model, tokenizer, result=None, out_dir: str | os.PathLike = "checkpoint", *,
                    format: str = "compressed-tensors", provenance: Optional[dict] = None,
                    overwrite: bool = False, asym_layout: str = "naive-quantized") -> Path:
    """Save a (compressed) causal LM as a folder transformers can load.

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
        asym_layout: compressed-tensors format of *asymmetric* layers:
            ``"naive-quantized"`` (default; one int8 per code, the layout plain
            transformers 5.x loads) or ``"pack-quantized"`` (codes packed 8 per int32:
            half the bytes of 4-bit layers, but transformers 5.24 + compressed-tensors
            0.20 fail to load its zero points, llm-compressor#1618). Symmetric layers are
            always packed; edgeprune's own loader reads both.

    Returns:
        The output folder path.

    Raises:
        ConfigError-like CheckpointError: unknown ``format``; ``out_dir`` is non-empty and
            holds a different run (without ``overwrite``); ``out_dir`` is or contains the
            input model folder; a quantized layer's weight disagrees with its integer codes;
            a quantized name that is not a linear layer; any I/O failure (nothing is left
            on disk in that case).
    """
    if asym_layout not in ("pack-quantized", "naive-quantized"):
        raise CheckpointError(f"unknown asym_layout {asym_layout!r}",
                              "use 'pack-quantized' (compact) or 'naive-quantized' (int8 codes)")
    if format not in FORMATS:
        raise CheckpointError(f"unknown checkpoint format {format!r}",
                              f"use one of {', '.join(FORMATS)}")
    provenance = dict(provenance or {})
    quantized: dict[str, QuantizedWeight] = dict(getattr(result, "quantized", None) or {})
    masks: dict[str, torch.Tensor] = dict(getattr(result, "masks", None) or {})
    patterns: dict[str, str] = dict(getattr(result, "sparsity_pattern", None) or {})
    recipe = getattr(result, "recipe", None) or {}
    run_id = _run_id(format, recipe, provenance)

    out = Path(out_dir).expanduser().resolve()
    check_out_dir(out, _source_dir(model, provenance), overwrite, run_id)

    modules = dict(model.named_modules())
    for name in list(quantized) + list(masks):
        mod = modules.get(name)
        if not isinstance(mod, torch.nn.Linear):
            raise CheckpointError(f"{name!r} is not a linear layer of this model",
                                  "result.quantized / result.masks keys must be module names "
                                  "such as 'model.layers.0.self_attn.q_proj'")

    tied_src = _is_tied(model)
    emb_name, head_name = _embedding_names(model)
    head_mod = head_name.rsplit(".", 1)[0] if head_name else None
    if head_mod in quantized:
        tied_policy = "untied-quantized-head"
    else:
        tied_policy = "tied" if tied_src else "untied"

    sd = model.state_dict()
    if tied_policy == "tied" and head_name in sd:
        sd.pop(head_name)  # stored once, as the embedding (transformers' own convention)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        tensors[k] = v.detach().to("cpu").clone() if (tied_policy == "untied-quantized-head"
                                                      and k == emb_name) else v.detach().cpu()

    qparams: dict[str, torch.Tensor] = {}
    layer_records: dict[str, dict] = {}
    groups: dict[tuple, list[str]] = {}
    for name, qw in quantized.items():
        stored = sd[f"{name}.weight"].dtype
        w = sd[f"{name}.weight"].detach().float().cpu()
        if tuple(w.shape) != tuple(qw.shape):
            raise CheckpointError(f"{name}: weight shape {tuple(w.shape)} != codes shape {qw.shape}",
                                  "save the model that produced this CompressionResult")
        # a half-precision model holds the dequantized weight rounded to its dtype
        w_hat = qw.dequantize().to(stored).float()
        tol = 1e-5 * float(w_hat.abs().max()) + 1e-7
        if not torch.allclose(w, w_hat, rtol=1e-5, atol=tol):
            raise CheckpointError(
                f"{name}: the model's weight differs from its integer codes "
                f"(max |diff| {float((w - w_hat).abs().max()):.3g})",
                "the model was modified after compression; re-run compress or save the "
                "matching model")
        key = _group_key(qw, asym_layout)
        groups.setdefault(key, []).append(name)
        layer_records[name] = {"bits": qw.bits, "group_size": qw.group_size, "sym": key[2],
                               "act_order": key[3], "bits_per_weight": round(qw.bits_per_weight(), 5),
                               "shape": list(qw.shape)}
        if format == "compressed-tensors" and key[4] == "naive-quantized":
            mid = 2 ** (qw.bits - 1)
            tensors[f"{name}.weight"] = (qw.codes.to(torch.int16) - mid).to(torch.int8)
            tensors[f"{name}.weight_scale"] = qw.scales.float().contiguous()
            tensors[f"{name}.weight_zero_point"] = (qw.zeros.to(torch.int16) - mid).to(torch.int8)
            if key[3]:
                tensors[f"{name}.weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()
        elif format == "compressed-tensors":
            del tensors[f"{name}.weight"]
            tensors[f"{name}.weight_packed"] = pack_int32(qw.codes, qw.bits, 1)
            tensors[f"{name}.weight_scale"] = qw.scales.float().contiguous()
            tensors[f"{name}.weight_shape"] = torch.tensor(list(qw.shape), dtype=torch.int64)
            if not key[2]:
                tensors[f"{name}.weight_zero_point"] = pack_int32(qw.zeros, qw.bits, 0)
            if key[3]:
                tensors[f"{name}.weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()
        else:
            tensors[f"{name}.weight"] = w_hat.to(sd[f"{name}.weight"].dtype)
            qparams[f"{name}.weight_scale"] = qw.scales.float().contiguous()
            qparams[f"{name}.weight_zero_point"] = qw.zeros.to(torch.uint8).contiguous()
            if key[3]:
                qparams[f"{name}.weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()

    # masks: stored only where they cannot be read back as `weight != 0`
    mask_tensors: dict[str, torch.Tensor] = {}
    sparse_records: dict[str, dict] = {}
    for name, m in masks.items():
        m = m.bool().cpu()
        w_now = quantized[name].dequantize() if name in quantized else sd[f"{name}.weight"].float().cpu()
        derived = bool(torch.equal(m, w_now != 0))
        if not derived:
            mask_tensors[f"{name}.mask_packed"] = _pack_mask(m)
        sparse_records[name] = {"pattern": patterns.get(name, "unstructured"),
                                "sparsity": round(1.0 - float(m.float().mean()), 6),
                                "shape": list(m.shape),
                                "mask": "nonzero" if derived else "stored"}

    sparsity_config: dict = {}
    if sparse_records:
        pats = sorted({r["pattern"] for r in sparse_records.values()})
        tot = sum(np.prod(r["shape"]) for r in sparse_records.values())
        gs = sum(r["sparsity"] * np.prod(r["shape"]) for r in sparse_records.values()) / tot
        sparsity_config = {"format": "dense", "targets": sorted(sparse_records),
                           "ignore": [], "global_sparsity": round(float(gs), 6),
                           "sparsity_structure": pats[0] if len(pats) == 1 else "unstructured"}

    calib = provenance.get("calibration", {})
    record = {
        "schema_version": SCHEMA_VERSION,
        "edgeprune_version": _edgeprune_version(),
        "format": format,
        "run_id": run_id,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": _method_name(recipe, provenance),
        "recipe": _jsonable(recipe),
        "calibration": _jsonable(calib),
        "seed": provenance.get("seed", calib.get("seed") if isinstance(calib, dict) else None),
        "provenance": _jsonable(provenance),
        "tied_embeddings": tied_policy,
        "avg_bits_per_weight": None if not quantized else round(_avg_bits(quantized), 5),
        "quantized_layers": layer_records,
        "sparse_layers": sparse_records,
    }

    from exporters.folder import atomic_folder
    try:
        # temp folder beside `out`, renamed over it at the end; removed (with any parent
        # folders it made) on any failure or interrupt, Ctrl-C included
        with atomic_folder(out, overwrite=True) as tmp:
            cfg = model.config.to_dict()
            for k in ("quantization_config", "edgeprune"):
                cfg.pop(k, None)
            if tied_policy == "untied-quantized-head":
                cfg["tie_word_embeddings"] = False
                if isinstance(cfg.get("text_config"), dict):
                    cfg["text_config"]["tie_word_embeddings"] = False
            if format == "compressed-tensors" and quantized:
                cfg["quantization_config"] = {
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
                    "sparsity_config": sparsity_config,
                    "transform_config": {},
                }
            cfg["edgeprune"] = {k: record[k] for k in ("schema_version", "edgeprune_version", "format",
                                                       "run_id", "method", "recipe", "calibration",
                                                       "seed", "tied_embeddings", "avg_bits_per_weight")}
            if sparsity_config:
                cfg["edgeprune"]["sparsity"] = sparsity_config
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                try:
                    gen.save_pretrained(str(tmp))
                except Exception:  # noqa: BLE001 - a bad generation config never blocks a save
                    pass
            _write_safetensors(tensors, tmp / WEIGHTS_FILE)
            if qparams:
                _write_safetensors(qparams, tmp / QPARAMS_FILE)
            if mask_tensors:
                _write_safetensors(mask_tensors, tmp / MASKS_FILE)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            (tmp / CHECKPOINT_JSON).write_text(json.dumps(record, indent=2))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised as a CheckpointError with a hint
        raise CheckpointError(f"writing the checkpoint to {out} failed: {e}",
                              "check free disk space and permissions; nothing was written") from e
    return out


def _edgeprune_version() -> str:
    try:
        from importlib.metadata import version
        return version("edgeprune")
    except Exception:  # noqa: BLE001
        return "0.1.0"


# --------------------------------------------------------------------------- load

def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(folder / f)))
        return out
    f = folder / WEIGHTS_FILE
    if not f.exists():
        raise CheckpointError(f"no {WEIGHTS_FILE} in {folder}",
                              "the folder is not a complete checkpoint; save it again")
    return load_file(str(f))


def _scheme_for(name: str, module, qcfg: dict) -> Optional[dict]:
    import re
    for grp in (qcfg.get("config_groups") or {}).values():
        for t in grp.get("targets", []):
            if t.startswith("re:"):
                hit = re.match(t[3:], name) is not None
            else:
                hit = t == name or any(c.__name__ == t for c in type(module).__mro__)
            if hit:
                return grp.get("weights") or None
    return None


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    device: str = "cpu"):
    """Load a checkpoint written by :func:`save_checkpoint` (either format).

    Also reads ``pack-quantized`` compressed-tensors folders written by other tools
    (e.g. llm-compressor); their provenance is then empty.

    Args:
        path: the checkpoint folder.
        dtype: dtype of the dense model (the dequantized ``(code - zero) * scale`` is
            computed in float32 and then cast).
        device: where to put the model.

    Returns:
        ``(model, tokenizer_or_None, CheckpointInfo)``: a plain HF model (``eval()``) with
        dense-equivalent weights, and the integer codes / masks that produced them.

    Raises:
        CheckpointError: missing or inconsistent files, unsupported quantization scheme,
            codes that do not reproduce the stored dense weights (``dense`` format).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json", "pass a checkpoint folder")
    record: dict = {}
    if (folder / CHECKPOINT_JSON).is_file():
        record = json.loads((folder / CHECKPOINT_JSON).read_text())
    raw_cfg = json.loads((folder / "config.json").read_text())
    qcfg = raw_cfg.get("quantization_config") or {}
    if qcfg and qcfg.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"unsupported quantization_config quant_method "
                              f"{qcfg.get('quant_method')!r} in {folder}",
                              "edgeprune reads compressed-tensors or dense checkpoints")
    fmt = record.get("format") or ("compressed-tensors" if qcfg else "dense")

    config = AutoConfig.from_pretrained(str(folder))
    for attr in ("quantization_config", "edgeprune"):
        if hasattr(config, attr):
            delattr(config, attr)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    modules = dict(model.named_modules())

    tensors = _read_safetensors(folder)
    quantized: dict[str, QuantizedWeight] = {}
    state: dict[str, torch.Tensor] = {}
    for k in [k for k in tensors if k.endswith(".weight_scale")]:
        name = k[: -len(".weight_scale")]
        args = _scheme_for(name, modules.get(name), qcfg)
        if args is None:
            raise CheckpointError(f"{name} has a weight_scale but no config group targets it",
                                  "the checkpoint's quantization_config is inconsistent")
        if args.get("type", "int") != "int" or args.get("strategy") not in ("group", "channel"):
            raise CheckpointError(f"{name}: quantization scheme {args} is not supported",
                                  "edgeprune reads int weights with group or channel strategy")
        bits = int(args["num_bits"])
        mid = 2 ** (bits - 1)
        packed = tensors.pop(f"{name}.weight_packed", None)
        if packed is not None:  # pack-quantized
            shape = [int(s) for s in tensors.pop(f"{name}.weight_shape").tolist()]
            codes = unpack_int32(packed, bits, shape, 1)
        else:  # naive-quantized: signed int8 codes stored as `weight`
            wq = tensors.pop(f"{name}.weight")
            if wq.is_floating_point():
                raise CheckpointError(f"{name}: float weight next to a weight_scale",
                                      "only integer (pack- or naive-quantized) layers are supported")
            shape = list(wq.shape)
            codes = (wq.to(torch.int16) + mid).to(torch.uint8)
        scales = tensors.pop(k).float()
        if scales.dim() == 1:
            scales = scales[:, None]
        n_groups = scales.shape[1]
        sym = bool(args.get("symmetric", True))
        zp = tensors.pop(f"{name}.weight_zero_point", None)
        if sym:
            zeros = torch.full((shape[0], n_groups), mid, dtype=torch.uint8)
        elif zp is None:
            raise CheckpointError(f"{name}: asymmetric scheme without weight_zero_point",
                                  "the checkpoint is incomplete")
        elif packed is not None:
            zeros = unpack_int32(zp, bits, (shape[0], n_groups), 0)
        else:
            zeros = (zp.to(torch.int16).reshape(shape[0], n_groups) + mid).to(torch.uint8)
        g_idx = tensors.pop(f"{name}.weight_g_idx", None)
        gs = shape[1] if args.get("strategy") == "channel" else int(args["group_size"])
        qw = QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits, group_size=gs,
                             sym=sym, g_idx=None if g_idx is None else g_idx.to(torch.int32))
        quantized[name] = qw
        state[f"{name}.weight"] = qw.dequantize()

    if fmt == "dense" and (folder / QPARAMS_FILE).is_file():
        from safetensors.torch import load_file
        qp = load_file(str(folder / QPARAMS_FILE))
        for name, lr in record.get("quantized_layers", {}).items():
            w = tensors[f"{name}.weight"].float()
            scales = qp[f"{name}.weight_scale"].float()
            zeros = qp[f"{name}.weight_zero_point"].to(torch.uint8)
            g_idx = qp.get(f"{name}.weight_g_idx")
            bits = int(lr["bits"])
            g = (g_idx.long() if g_idx is not None else torch.arange(w.shape[1]) // int(lr["group_size"]))
            codes = torch.round(w / scales[:, g]) + zeros.float()[:, g]
            codes = codes.clamp(0, 2 ** bits - 1).to(torch.uint8)
            qw = QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits,
                                 group_size=int(lr["group_size"]), sym=bool(lr["sym"]),
                                 g_idx=None if g_idx is None else g_idx.to(torch.int32))
            stored = tensors[f"{name}.weight"].dtype    # half precision: stored rounded
            if not torch.equal(qw.dequantize().to(stored).float(), w):
                raise CheckpointError(f"{name}: stored dense weights do not match their codes",
                                      "the dense checkpoint was edited, or its half-precision "
                                      "weights cannot pin down the codes; save it again with "
                                      "format='compressed-tensors'")
            quantized[name] = qw

    state.update(tensors)
    missing, unexpected = model.load_state_dict(state, strict=False)
    emb_name, head_name = _embedding_names(model)
    tied = bool(getattr(_text_config(model.config), "tie_word_embeddings", False))
    allowed_missing = {head_name} if tied else set()
    bad_missing = [m for m in missing if m not in allowed_missing]
    if bad_missing or unexpected:
        raise CheckpointError(f"checkpoint {folder} does not match its config: missing "
                              f"{bad_missing[:5]}, unexpected {list(unexpected)[:5]}",
                              "the folder is incomplete or from another architecture")
    if tied:
        model.tie_weights()
    if emb_name and emb_name not in state:
        raise CheckpointError(f"{folder} has no embedding tensor {emb_name}",
                              "the checkpoint is incomplete")

    masks: dict[str, torch.Tensor] = {}
    patterns: dict[str, str] = {}
    sparse = record.get("sparse_layers", {})
    stored = {}
    if (folder / MASKS_FILE).is_file():
        from safetensors.torch import load_file
        stored = load_file(str(folder / MASKS_FILE))
    for name, sr in sparse.items():
        if sr.get("mask") == "stored":
            masks[name] = _unpack_mask(stored[f"{name}.mask_packed"], sr["shape"])
        else:
            masks[name] = modules[name].weight.detach() != 0
        patterns[name] = sr.get("pattern", "unstructured")

    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = None
    if any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    info = CheckpointInfo(path=str(folder), format=fmt, quantized=quantized, masks=masks,
                          sparsity_pattern=patterns,
                          tied_embeddings=record.get("tied_embeddings", "tied" if tied else "untied"),
                          provenance=record)
    return model, tokenizer, info
