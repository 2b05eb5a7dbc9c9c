"""Loading a checkpoint folder (either format, or a compressed-tensors folder written by
another tool) back into a dense-equivalent model plus its integer codes and masks."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError
from ..quantize import QuantizedWeight
from .format import (CHECKPOINT_JSON, MASKS_FILE, QPARAMS_FILE, WEIGHTS_FILE, CheckpointInfo,
                     embedding_names, text_config)
from .pack import unpack_int32, unpack_mask
from .validate import (CHECKPOINT_FIX, TOKENIZER_JSON, check_config, check_tokenizer_files,
                       read_json_object, safetensors_header, shape_mismatch, transformers_config,
                       weight_files)

#: what a damaged ``edgeprune_checkpoint.json`` field must be: (type, what to call it)
_RECORD_FIELDS = {"format": (str, "a string"), "tied_embeddings": (str, "a string"),
                  "quantized_layers": (dict, "an object"), "sparse_layers": (dict, "an object")}


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, each file's header checked first
    (:func:`~edgeprune.checkpoint.validate.safetensors_header`).

    Raises:
        CheckpointError: a missing, truncated or damaged weight file, naming it.
    """
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        out.update(_load_safetensors(f))
    return out


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, its header checked first.

    Raises:
        CheckpointError: naming the file.
    """
    from safetensors.torch import load_file

    safetensors_header(path)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {str(e)[:200]})",
                              CHECKPOINT_FIX) from None


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
    """``(edgeprune record or {}, quantization_config or {}, format)``, each file checked:
    ``config.json`` (:func:`~edgeprune.checkpoint.validate.check_config`) and
    ``edgeprune_checkpoint.json`` JSON objects with fields of the right types.

    Raises:
        CheckpointError: not a folder; no ``config.json``; a damaged file or field (named);
            a quantization method other than compressed-tensors.
    """
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder", "pass a checkpoint folder")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json", "pass a checkpoint folder")
    record: dict = {}
    if (folder / CHECKPOINT_JSON).is_file():
        record = read_json_object(folder / CHECKPOINT_JSON)
        _check_record(record, folder / CHECKPOINT_JSON)
    raw_cfg = check_config(folder)
    qcfg = raw_cfg.get("quantization_config") or {}
    if not isinstance(qcfg, dict) or not isinstance(qcfg.get("config_groups") or {}, dict) or \
            not all(isinstance(g, dict) for g in (qcfg.get("config_groups") or {}).values()):
        raise CheckpointError(f"{folder / 'config.json'}: 'quantization_config' is not an object "
                              "of config groups", CHECKPOINT_FIX)
    if qcfg and qcfg.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"unsupported quantization_config quant_method "
                              f"{qcfg.get('quant_method')!r} in {folder}",
                              "edgeprune reads compressed-tensors or dense checkpoints")
    fmt = record.get("format") or ("compressed-tensors" if qcfg else "dense")
    if fmt not in ("compressed-tensors", "dense"):
        raise CheckpointError(f"{folder / CHECKPOINT_JSON}: field 'format' = {fmt!r} is not "
                              "'compressed-tensors' or 'dense'", CHECKPOINT_FIX)
    return record, qcfg, fmt


def _check_record(record: dict, path: Path) -> None:
    """The fields of ``edgeprune_checkpoint.json`` the loader reads: their types, and
    each layer record's ``bits`` / ``group_size`` / ``sym`` / ``mask`` / ``shape``.

    Raises:
        CheckpointError: naming the file and the field.
    """
    def bad(field, v, want):
        return CheckpointError(f"{path}: field {field!r} = {str(v)[:60]!r} is not {want}",
                               CHECKPOINT_FIX)

    for k, (typ, want) in _RECORD_FIELDS.items():
        if record.get(k) is not None and not isinstance(record[k], typ):
            raise bad(k, record[k], want)
    for name, lr in (record.get("quantized_layers") or {}).items():
        if not isinstance(lr, dict) or not _whole(lr.get("bits")) or \
                not _whole(lr.get("group_size")) or not isinstance(lr.get("sym"), bool):
            raise bad(f"quantized_layers.{name}", lr, "{bits, group_size, sym}")
    for name, sr in (record.get("sparse_layers") or {}).items():
        if not isinstance(sr, dict) or sr.get("mask", "nonzero") not in ("stored", "nonzero") or \
                (sr.get("mask") == "stored" and not (isinstance(sr.get("shape"), list) and len(
                    sr["shape"]) == 2 and all(_whole(d) and d > 0 for d in sr["shape"]))):
            raise bad(f"sparse_layers.{name}", sr, "{pattern, mask, shape}")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _empty_model(folder: Path):
    """The config's model in float32, weights not initialised (they are loaded next)."""
    from transformers import AutoModelForCausalLM

    config = transformers_config(folder)
    for attr in ("quantization_config", "edgeprune"):
        if hasattr(config, attr):
            delattr(config, attr)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    try:
        with no_init_weights():
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, TypeError, KeyError, RuntimeError, AttributeError, AssertionError) as e:
        raise CheckpointError(f"{folder / 'config.json'} does not describe a model transformers "
                              f"can build ({type(e).__name__}: {str(e)[:200]})", CHECKPOINT_FIX) from None


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


@contextmanager
def _damaged(path: Path, what: str):
    """Errors the readers raise on a damaged file (a missing tensor, a bad shape or
    field) as one :class:`CheckpointError` naming ``path`` and ``what`` was being read."""
    try:
        yield
    except CheckpointError:
        raise
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError, AttributeError,
            re.error) as e:
        raise CheckpointError(f"{path}: {what} cannot be read ({type(e).__name__}: "
                              f"{str(e)[:200]})", CHECKPOINT_FIX) from None


def _decode_quantized(tensors: dict, modules: dict, qcfg: dict, where: Path
                      ) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """Every layer with a ``weight_scale``: ``(codes by name, dequantized weights by
    parameter name)``.

    Raises:
        CheckpointError: a layer no config group targets, whose tensors are missing or
            damaged, or whose shape is not its module's; naming ``where`` (the weights).
    """
    quantized: dict[str, QuantizedWeight] = {}
    state: dict[str, torch.Tensor] = {}
    for k in [k for k in tensors if k.endswith(".weight_scale")]:
        name = k[: -len(".weight_scale")]
        with _damaged(where.parent / "config.json", f"the quantization_config of {name}"):
            args = _scheme_for(name, modules.get(name), qcfg)
        if args is None:
            raise CheckpointError(f"{name} has a weight_scale in {where.name} but no config group of "
                                  f"{where.parent / 'config.json'}'s quantization_config targets it",
                                  "the checkpoint's quantization_config is inconsistent: " + CHECKPOINT_FIX)
        with _damaged(where, f"the quantized layer {name}"):
            qw = _decode_layer(name, args, tensors)
            mod = modules.get(name)
            if isinstance(mod, torch.nn.Linear) and tuple(qw.codes.shape) != tuple(mod.weight.shape):
                raise CheckpointError(f"{where}: layer {name} has codes of shape "
                                      f"{tuple(qw.codes.shape)}, but config.json makes it "
                                      f"{tuple(mod.weight.shape)}",
                                      "the weights and config.json come from different models, or "
                                      "the file is damaged: " + CHECKPOINT_FIX)
            state[f"{name}.weight"] = qw.dequantize()
        quantized[name] = qw
    return quantized, state


def _dense_codes(folder: Path, tensors: dict, record: dict) -> dict[str, QuantizedWeight]:
    """A dense checkpoint's codes, re-derived from its weights and the sidecar
    ``edgeprune_qparams.safetensors``, and checked to reproduce the stored weights.

    Raises:
        CheckpointError: the stored dense weights do not match their codes.
    """
    qp = _load_safetensors(folder / QPARAMS_FILE)
    quantized: dict[str, QuantizedWeight] = {}
    for name, lr in (record.get("quantized_layers") or {}).items():
        with _damaged(folder / QPARAMS_FILE, f"the scales of {name}"):
            qw = _dense_layer(name, lr, tensors, qp)
        stored = tensors[f"{name}.weight"].dtype    # half precision: stored rounded
        if not torch.equal(qw.dequantize().to(stored).float(), tensors[f"{name}.weight"].float()):
            raise CheckpointError(f"{name}: stored dense weights do not match their codes",
                                  "the dense checkpoint was edited, or its half-precision "
                                  "weights cannot pin down the codes; save it again with "
                                  "format='compressed-tensors'")
        quantized[name] = qw
    return quantized


def _dense_layer(name: str, lr: dict, tensors: dict, qp: dict) -> QuantizedWeight:
    """One dense-format layer's codes from its weight and the sidecar's scales."""
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
    qw.dequantize()            # scales / zero points of the codes' shape, or an error now
    return qw


def _load_state(model, state: dict, folder: Path) -> bool:
    """Load ``state`` into ``model`` (a tied head may be missing); returns whether the
    config ties the embeddings.

    Raises:
        CheckpointError: missing or unexpected tensors, a tensor whose shape is not the
            one ``config.json`` makes, or no embedding tensor.
    """
    where = folder / WEIGHTS_FILE if (folder / WEIGHTS_FILE).exists() else folder
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    bad = shape_mismatch(expected, {k: tuple(v.shape) for k, v in state.items()}, where)
    if bad is not None:
        raise bad
    with _damaged(where, "the weights"):
        missing, unexpected = model.load_state_dict(state, strict=False)
    emb_name, head_name = embedding_names(model)
    tied = bool(getattr(text_config(model.config), "tie_word_embeddings", False))
    allowed_missing = {head_name} if tied else set()
    bad_missing = [m for m in missing if m not in allowed_missing]
    if bad_missing or unexpected:
        raise CheckpointError(f"checkpoint {folder} does not match its config: {where.name} "
                              f"lacks {bad_missing[:5]} and has unexpected {list(unexpected)[:5]} "
                              "for the model config.json describes",
                              "the folder is incomplete or from another architecture: " + CHECKPOINT_FIX)
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
        stored = _load_safetensors(folder / MASKS_FILE)
    for name, sr in (record.get("sparse_layers") or {}).items():
        if sr.get("mask") == "stored":
            with _damaged(folder / MASKS_FILE, f"the mask of {name}"):
                masks[name] = unpack_mask(stored[f"{name}.mask_packed"], sr["shape"])
        elif isinstance(modules.get(name), torch.nn.Linear):
            masks[name] = modules[name].weight.detach() != 0
        else:
            raise CheckpointError(f"{folder / CHECKPOINT_JSON}: sparse layer {name!r} is not a "
                                  "linear layer of the model", CHECKPOINT_FIX)
        patterns[name] = str(sr.get("pattern", "unstructured"))
    return masks, patterns


def _read_tokenizer(folder: Path):
    """The folder's tokenizer (``None`` without tokenizer files), its files checked first
    (:func:`~edgeprune.checkpoint.validate.check_tokenizer_files`).

    Raises:
        CheckpointError: a damaged tokenizer file, naming it.
    """
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    check_tokenizer_files(folder)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - tokenizers / transformers raise many types
        named = ", ".join(n for n in TOKENIZER_JSON if n != "tokenizer.json" and (folder / n).exists())
        raise CheckpointError(f"the tokenizer settings of {folder} ({named or 'tokenizer files'}) "
                              f"cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]})",
                              CHECKPOINT_FIX) from None


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
        CheckpointError: missing, damaged or inconsistent files (every such error names
            the file and what to do: :mod:`edgeprune.checkpoint.validate`), unsupported
            quantization scheme, codes that do not reproduce the stored dense weights
            (``dense`` format). Pickled weights are never read.
    """
    folder = Path(path)
    record, qcfg, fmt = _read_configs(folder)
    model = _empty_model(folder)
    modules = dict(model.named_modules())
    tensors = _read_safetensors(folder)
    quantized, state = _decode_quantized(tensors, modules, qcfg, folder / WEIGHTS_FILE)
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
