"""Loading a checkpoint folder (either format, or a compressed-tensors folder written by
another tool) back into a dense-equivalent model plus its integer codes and masks."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError
from ..quantize import QuantizedWeight
from .format import (CHECKPOINT_JSON, MASKS_FILE, QPARAMS_FILE, WEIGHTS_FILE, CheckpointInfo,
                     embedding_names, text_config)
from .pack import unpack_int32, unpack_mask


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
    """The ``weights`` quantization args of the first config group targeting ``name``
    (exact name, ``re:`` pattern, or module class name)."""
    for grp in (qcfg.get("config_groups") or {}).values():
        for t in grp.get("targets", []):
            if t.startswith("re:"):
                hit = re.match(t[3:], name) is not None
            else:
                hit = t == name or any(c.__name__ == t for c in type(module).__mro__)
            if hit:
                return grp.get("weights") or None
    return None


def _read_configs(folder: Path) -> tuple[dict, dict, str]:
    """``(edgeprune record or {}, quantization_config or {}, format)``.

    Raises:
        CheckpointError: no ``config.json``; a quantization method other than
            compressed-tensors.
    """
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
    return record, qcfg, record.get("format") or ("compressed-tensors" if qcfg else "dense")


def _empty_model(folder: Path):
    """The config's model in float32, weights not initialised (they are loaded next)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    for attr in ("quantization_config", "edgeprune"):
        if hasattr(config, attr):
            delattr(config, attr)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _decode_layer(name: str, args: dict, tensors: dict) -> QuantizedWeight:
    """One compressed-tensors layer (its tensors popped from ``tensors``): pack-quantized
    (``weight_packed``) or naive-quantized (signed int8 ``weight``) codes, scales, zero
    points (packed along the output dimension), ``g_idx``.

    Raises:
        CheckpointError: an unsupported scheme, or a layer missing its tensors.
    """
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
    scales = tensors.pop(f"{name}.weight_scale").float()
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
    return QuantizedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits, group_size=gs,
                           sym=sym, g_idx=None if g_idx is None else g_idx.to(torch.int32))


def _decode_quantized(tensors: dict, modules: dict, qcfg: dict
                      ) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """Every layer with a ``weight_scale``: ``(codes by name, dequantized weights by
    parameter name)``."""
    quantized: dict[str, QuantizedWeight] = {}
    state: dict[str, torch.Tensor] = {}
    for k in [k for k in tensors if k.endswith(".weight_scale")]:
        name = k[: -len(".weight_scale")]
        args = _scheme_for(name, modules.get(name), qcfg)
        if args is None:
            raise CheckpointError(f"{name} has a weight_scale but no config group targets it",
                                  "the checkpoint's quantization_config is inconsistent")
        qw = _decode_layer(name, args, tensors)
        quantized[name] = qw
        state[f"{name}.weight"] = qw.dequantize()
    return quantized, state


def _dense_codes(folder: Path, tensors: dict, record: dict) -> dict[str, QuantizedWeight]:
    """A dense checkpoint's codes, re-derived from its weights and the sidecar
    ``edgeprune_qparams.safetensors``, and checked to reproduce the stored weights.

    Raises:
        CheckpointError: the stored dense weights do not match their codes.
    """
    from safetensors.torch import load_file
    qp = load_file(str(folder / QPARAMS_FILE))
    quantized: dict[str, QuantizedWeight] = {}
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
    return quantized


def _load_state(model, state: dict, folder: Path) -> bool:
    """Load ``state`` into ``model`` (a tied head may be missing); returns whether the
    config ties the embeddings.

    Raises:
        CheckpointError: missing or unexpected tensors, or no embedding tensor.
    """
    missing, unexpected = model.load_state_dict(state, strict=False)
    emb_name, head_name = embedding_names(model)
    tied = bool(getattr(text_config(model.config), "tie_word_embeddings", False))
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
    return tied


def _read_masks(folder: Path, record: dict, modules: dict) -> tuple[dict, dict]:
    """``(masks, patterns)`` of the pruned layers: stored packed masks, or ``weight != 0``."""
    masks: dict[str, torch.Tensor] = {}
    patterns: dict[str, str] = {}
    stored = {}
    if (folder / MASKS_FILE).is_file():
        from safetensors.torch import load_file
        stored = load_file(str(folder / MASKS_FILE))
    for name, sr in record.get("sparse_layers", {}).items():
        if sr.get("mask") == "stored":
            masks[name] = unpack_mask(stored[f"{name}.mask_packed"], sr["shape"])
        else:
            masks[name] = modules[name].weight.detach() != 0
        patterns[name] = sr.get("pattern", "unstructured")
    return masks, patterns


def _read_tokenizer(folder: Path):
    if any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(folder))
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
    folder = Path(path)
    record, qcfg, fmt = _read_configs(folder)
    model = _empty_model(folder)
    modules = dict(model.named_modules())
    tensors = _read_safetensors(folder)
    quantized, state = _decode_quantized(tensors, modules, qcfg)
    if fmt == "dense" and (folder / QPARAMS_FILE).is_file():
        quantized.update(_dense_codes(folder, tensors, record))
    state.update(tensors)
    tied = _load_state(model, state, folder)
    masks, patterns = _read_masks(folder, record, modules)
    model = model.to(device=device, dtype=dtype).eval()
    info = CheckpointInfo(path=str(folder), format=fmt, quantized=quantized, masks=masks,
                          sparsity_pattern=patterns,
                          tied_embeddings=record.get("tied_embeddings", "tied" if tied else "untied"),
                          provenance=record)
    return model, _read_tokenizer(folder), info


__all__ = ["load_checkpoint"]
