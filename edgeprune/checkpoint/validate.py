"""Checks of a model or checkpoint folder's files before anything reads them, so that a
damaged file gives one error naming the file and what to do, never an internal error
from ``json``, ``safetensors``, ``transformers`` or ``torch`` (and never an unpickling).

* :func:`read_json_object`: a JSON file that must hold an object.
* :func:`check_config`: ``config.json``: a JSON object whose fields the model is built
  from have the right types (``"hidden_size": "big"`` is named, not a
  ``StrictDataclassFieldValidationError``).
* :func:`safetensors_header`: a ``.safetensors`` file's header read and checked against
  the file's size without loading a tensor (a truncated or damaged file is named).
* :func:`refuse_pickles`: a folder whose weights are pickles (``pytorch_model.bin``...),
  refused: unpickling runs code.
* :func:`check_tokenizer_files`: the tokenizer's JSON files parse and build.
* :func:`check_model_folder`: all of them for a Hugging Face folder (a plain model, the
  GGUF conversion cache, a checkpoint).

Every check takes the error class to raise and the fix to name: a checkpoint says "save
it again", the GGUF cache "delete this cache entry".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError

#: bytes per element of the safetensors dtypes
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                      "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                      "I64": 8, "U64": 8, "F64": 8, "C64": 8}
#: the header of a safetensors file is at most 100 MB (the format's own limit)
_MAX_HEADER = 100_000_000
#: weight files that are pickles: loading them may run code, so edgeprune never does
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
                  "model.ckpt", "tf_model.h5", "flax_model.msgpack")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: ``config.json`` fields the model is built from: positive integers, numbers, booleans, text
_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim")
_NUMBERS = ("rms_norm_eps", "rope_theta", "initializer_range", "attention_dropout")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
_TEXTS = ("model_type", "hidden_act", "torch_dtype", "dtype")
#: what to do about a damaged checkpoint file
CHECKPOINT_FIX = "copy the checkpoint again, or save it again (`edgeprune compress ... --out`)"


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_json_object(path: Path, *, error: type = CheckpointError, fix: str = CHECKPOINT_FIX) -> dict:
    """The JSON object in ``path``.

    Raises:
        error: the file cannot be read, is not UTF-8 JSON, or holds no object; naming
            ``path`` and ``fix``.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path} is missing", fix) from None
    except (OSError, ValueError) as e:            # UnicodeDecodeError, JSONDecodeError
        raise error(f"{path} is not readable JSON ({type(e).__name__}: {str(e)[:200]})", fix) from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, not an object", fix)
    return data


def check_config_fields(cfg: dict, path: Path, *, error: type = CheckpointError,
                        fix: str = CHECKPOINT_FIX) -> None:
    """The types of the ``config.json`` fields a llama/qwen2 model is built from (the
    top level, and a nested ``text_config``), and the head layout they imply.

    Raises:
        error: naming ``path``, the field, its value and what it must be.
    """
    def bad(k, v, want):
        return error(f"{path}: field {k!r} = {str(v)[:60]!r} is not {want}", fix)

    for c in (cfg, cfg.get("text_config")):
        if not isinstance(c, dict):
            continue
        for k in _POSITIVE_INTS:
            v = c.get(k)
            if v is not None and not (_whole(v) and v >= 1):
                raise bad(k, v, "a positive integer")
        for k in _NUMBERS:
            v = c.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise bad(k, v, "a number")
        for k in _BOOLS:
            v = c.get(k)
            if v is not None and not isinstance(v, bool):
                raise bad(k, v, "true or false")
        for k in _TEXTS:
            v = c.get(k)
            if v is not None and not isinstance(v, str):
                raise bad(k, v, "a string")
        pad, vocab = c.get("pad_token_id"), c.get("vocab_size")
        if pad is not None and not (_whole(pad) and (vocab is None or -vocab <= pad < vocab)):
            raise bad("pad_token_id", pad, f"a token id below vocab_size={vocab}")
        heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
        if heads and kv and heads % kv:
            raise error(f"{path}: num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv}", fix)
        if heads and c.get("hidden_size") and c.get("head_dim") is None and c["hidden_size"] % heads:
            raise error(f"{path}: hidden_size={c['hidden_size']} is not a multiple of "
                        f"num_attention_heads={heads}", fix)


def check_config(folder: Path, *, error: type = CheckpointError, fix: str = CHECKPOINT_FIX) -> dict:
    """``folder/config.json`` read (:func:`read_json_object`) and its fields checked
    (:func:`check_config_fields`); then transformers' own config class must accept it.

    Returns:
        The JSON object.

    Raises:
        error: naming ``config.json`` and the field.
    """
    path = Path(folder) / "config.json"
    cfg = read_json_object(path, error=error, fix=fix)
    check_config_fields(cfg, path, error=error, fix=fix)
    return cfg


def transformers_config(folder: Path, *, error: type = CheckpointError, fix: str = CHECKPOINT_FIX):
    """``AutoConfig.from_pretrained(folder)`` (remote code off), its failures (a field
    transformers' own validation refuses) as ``error`` naming ``config.json``."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad config
        first = " ".join(str(e).split())[:300]
        raise error(f"{Path(folder) / 'config.json'} is not a config transformers can build "
                    f"({type(e).__name__}: {first})", fix) from None


def safetensors_header(path: Path, *, error: type = CheckpointError,
                       fix: str = CHECKPOINT_FIX) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Read and check a safetensors file's header without loading a tensor: its length
    fits the file, it is a JSON object of tensors with a known dtype, a shape and
    ``data_offsets`` whose length is the shape's, and the tensors end where the file does.

    Returns:
        ``{tensor name: (dtype, shape)}``.

    Raises:
        error: the file is missing, truncated, padded or damaged; naming it and ``fix``.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            raw = f.read(n) if 0 <= n <= min(_MAX_HEADER, size - 8) else b""
    except FileNotFoundError:
        raise error(f"{path} is missing", fix) from None
    except OSError as e:
        raise error(f"{path} cannot be read ({e})", fix) from None

    def damaged(why):
        return error(f"{path} is truncated or damaged ({why})", fix)

    if n < 0:
        raise damaged(f"{size} bytes, shorter than a safetensors header")
    if n > size - 8 or n > _MAX_HEADER:
        raise damaged(f"its header claims {n:,} bytes, the file has {size:,}")
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise damaged(f"unreadable header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise damaged("the header is not a JSON object")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict):
            raise damaged(f"tensor {name!r} has no description")
        dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES or not isinstance(shape, list) or \
                not all(_whole(s) and s >= 0 for s in shape) or not isinstance(offs, list) or \
                len(offs) != 2 or not all(_whole(o) for o in offs) or not 0 <= offs[0] <= offs[1]:
            raise damaged(f"tensor {name!r} has a bad dtype, shape or offsets")
        numel = 1
        for s in shape:
            numel *= s
        if offs[1] - offs[0] != numel * SAFETENSORS_DTYPES[dtype]:
            raise damaged(f"tensor {name!r}: {offs[1] - offs[0]:,} bytes for shape {shape} of {dtype}")
        end = max(end, offs[1])
        out[name] = (dtype, tuple(shape))
    if 8 + n + end != size:
        raise damaged(f"its tensors end at byte {8 + n + end:,}, the file has {size:,}")
    return out


def weight_files(folder: Path, *, error: type = CheckpointError, fix: str = CHECKPOINT_FIX) -> list[Path]:
    """The safetensors files holding the folder's weights: the shards of
    ``model.safetensors.index.json``, or ``model.safetensors``.

    Raises:
        error: a damaged index, a shard it names that is missing; no weights at all
            (a folder of pickles: :func:`refuse_pickles`).
    """
    folder = Path(folder)
    idx = folder / "model.safetensors.index.json"
    if idx.exists():
        wm = read_json_object(idx, error=error, fix=fix).get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise error(f"{idx}: 'weight_map' is not an object of tensor -> file names", fix)
        files = [folder / f for f in sorted(set(wm.values()))]
        for f in files:
            if f.resolve().parent != folder.resolve():
                raise error(f"{idx} names {f.name!r}, which is not a file of this folder", fix)
        return files
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    refuse_pickles(folder, error=error)
    raise error(f"{folder} has no weights (no model.safetensors)", fix)


def refuse_pickles(folder: Path, *, error: type = CheckpointError) -> None:
    """Refuse a folder whose weights are pickles (``pytorch_model.bin``, ``*.pt``...) and
    that has no safetensors: edgeprune never unpickles (a pickle can run any code).

    Raises:
        error: naming the file and how to convert it.
    """
    folder = Path(folder)
    if any(folder.glob("*.safetensors")):
        return
    found = sorted(p.name for p in folder.iterdir()
                   if p.is_file() and (p.name in PICKLE_WEIGHTS or p.suffix in PICKLE_SUFFIXES))
    if found:
        raise error(f"{folder / found[0]} holds pickled weights, which edgeprune does not load "
                    "(unpickling a file can run code)",
                    "use the model's safetensors release, or convert the file where you trust it: "
                    "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, "
                    "safe_serialization=True)")


def check_model_folder(folder: Path, *, error: type = CheckpointError, fix: str = CHECKPOINT_FIX,
                       build_config: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every file a Hugging Face model folder is loaded from, checked before transformers
    reads it: ``config.json`` (:func:`check_config`, then transformers' config class when
    ``build_config``), the weights (no pickles; each safetensors header,
    :func:`safetensors_header`), and the tokenizer files (:func:`check_tokenizer_files`).

    Args:
        folder: the model folder.
        error: the error class to raise (``ModelLoadError`` for models,
            ``CheckpointError`` for checkpoints).
        fix: what the user should do (re-download, save again, delete a cache entry).
        build_config: also build transformers' config from ``config.json``.

    Returns:
        ``{tensor name: (dtype, shape)}`` over the weight files.

    Raises:
        error: naming the damaged file and ``fix``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise error(f"{folder} is not a folder", fix)
    check_config(folder, error=error, fix=fix)
    if build_config:
        transformers_config(folder, error=error, fix=fix)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in weight_files(folder, error=error, fix=fix):
        tensors.update(safetensors_header(f, error=error, fix=fix))
    check_tokenizer_files(folder, error=error, fix=fix)
    return tensors


#: the tokenizer files of a model folder that are JSON objects
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: the special-token fields of ``tokenizer_config.json``: a string or an AddedToken object
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                   "mask_token")


def check_tokenizer_files(folder: Path, *, error: type = CheckpointError,
                          fix: str = CHECKPOINT_FIX) -> None:
    """The folder's tokenizer files: JSON objects; ``tokenizer.json`` a tokenizer the
    ``tokenizers`` library builds; the special tokens of ``tokenizer_config.json`` strings
    or AddedToken objects.

    Raises:
        error: naming the file (and the field).
    """
    folder = Path(folder)
    data = {n: read_json_object(folder / n, error=error, fix=fix)
            for n in TOKENIZER_JSON if (folder / n).exists()}
    if "tokenizer.json" in data:
        if not isinstance(data["tokenizer.json"].get("added_tokens"), list):   # transformers reads it
            raise error(f"{folder / 'tokenizer.json'}: field 'added_tokens' is not a list", fix)
        from tokenizers import Tokenizer
        try:
            Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise error(f"{folder / 'tokenizer.json'} is not a tokenizer "
                        f"({' '.join(str(e).split())[:200]})", fix) from None
    tc = data.get("tokenizer_config.json", {}).get("tokenizer_class")
    if tc is not None and not isinstance(tc, str):
        raise error(f"{folder / 'tokenizer_config.json'}: field 'tokenizer_class' = {str(tc)[:60]!r} "
                    "is not a class name", fix)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        for k in _SPECIAL_TOKENS:
            v = data.get(name, {}).get(k)
            if v is not None and not isinstance(v, str) and not (
                    isinstance(v, dict) and isinstance(v.get("content"), str)):
                raise error(f"{folder / name}: field {k!r} = {str(v)[:60]!r} is not a token "
                            "string or an AddedToken object", fix)


def shape_mismatch(expected: dict, found: dict, where: Path, *, error: type = CheckpointError,
                   fix: str = CHECKPOINT_FIX) -> Optional[Exception]:
    """The error for the first tensor of ``found`` (``name -> shape``) whose shape is not
    the one the config makes (``expected``, ``name -> shape``); ``None`` when all agree."""
    for name, shape in found.items():
        want = expected.get(name)
        if want is not None and tuple(want) != tuple(shape):
            return error(f"{where}: tensor {name} has shape {tuple(shape)}, but config.json makes "
                         f"it {tuple(want)}",
                         "the weights and config.json come from different models, or the file is "
                         "damaged: " + fix)
    return None


__all__ = ["read_json_object", "check_config", "check_config_fields", "transformers_config",
           "safetensors_header", "weight_files", "refuse_pickles", "check_model_folder",
           "check_tokenizer_files", "TOKENIZER_JSON",
           "shape_mismatch", "SAFETENSORS_DTYPES", "PICKLE_WEIGHTS", "CHECKPOINT_FIX"]
