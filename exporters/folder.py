"""An export folder: what it holds, the guard and claim on it, and writing it atomically.

The mechanisms (the output guard, the claim, the atomic folder and JSON writers) live in
:mod:`runtime.files`; this module gives them the export's kind (:data:`EXPORT_OUTPUT`)
and error (:class:`~runtime.errors.ExportError`), and keeps the export-only writers
(tokenizer, page-aligned external data).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from edgeprune_runtime.errors import ExportError
from edgeprune_runtime.files import (OutputKind, atomic_folder as _atomic_folder, check_output,
                           claim_output, foreign_entries, plain_modes, shown_names,
                           source_conflict, write_json)

#: Files a Hugging Face tokenizer's ``save_pretrained`` may write (exports and checkpoints
#: carry the model's tokenizer).
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model"})
#: What an export folder holds: anything else in it is the user's, and ``overwrite``
#: refuses to delete it.
EXPORT_FILES = frozenset({"model.onnx", "model.onnx.data", "edgeprune.json",
                          "genai_config.json", "genai_model.onnx",
                          "config.json"}) | TOKENIZER_FILES
#: An export folder, for the output guard: replaced as a whole, marked by
#: ``edgeprune.json``; an existing folder (even empty) needs ``overwrite``.
EXPORT_OUTPUT = OutputKind("export", files=EXPORT_FILES, marker="edgeprune.json", empty_ok=False)


def check_out_dir(out_dir: Path, source_dirs: list[Path], overwrite: bool, *,
                  label: str | None = None) -> None:
    """Refuse an export folder before any work (:func:`runtime.files.check_output` with
    :data:`EXPORT_OUTPUT`): one that is, holds or lies in an input
    (:func:`source_conflict`), is a file, cannot be written, is being written by another
    process, exists without ``overwrite``, or, even with it, holds files that are not an
    earlier export's (they would be deleted).

    Args:
        out_dir: the export folder.
        source_dirs: the model's input files and folders.
        overwrite: an earlier export there may be replaced.
        label: how messages name the path (the CLI's argument, e.g. ``OUT``).

    Raises:
        ExportError: with the fix (pick another path / pass overwrite=True).
    """
    check_output(out_dir, EXPORT_OUTPUT, inputs=source_dirs, overwrite=overwrite,
                 error=ExportError, label=label)


def claim_out_dir(out_dir: Path, source_dirs: list[Path], overwrite: bool, *,
                  label: str | None = None):
    """:func:`check_out_dir`, then claim the folder for this process until the export is
    written (:func:`runtime.files.claim_output`): a second export into the same folder is
    refused at once. Call it before loading the model and hold it around the work::

        with claim_out_dir(out, [source], overwrite, label="OUT"):
            model, tok = load_model(source)
            export_onnx(model, tok, out, overwrite=overwrite, ...)

    Returns:
        The held :class:`runtime.files.OutputClaim` (a context manager).

    Raises:
        ExportError: everything :func:`check_out_dir` refuses; another writer holds it.
    """
    return claim_output(out_dir, EXPORT_OUTPUT, inputs=source_dirs, overwrite=overwrite,
                        error=ExportError, label=label)


def atomic_folder(out_dir: Path, overwrite: bool = False):
    """Yield a temporary folder beside ``out_dir``, renamed to ``out_dir`` on success
    (:func:`runtime.files.atomic_folder`, raising :class:`ExportError`); on any exception
    nothing is left and an existing ``out_dir`` is untouched."""
    return _atomic_folder(out_dir, overwrite=overwrite, error=ExportError)


def check_disk(parent: Path, needed_bytes: int) -> None:
    """Raise :class:`ExportError` when ``parent``'s file system lacks ``needed_bytes`` (+10%)."""
    here = Path(parent)
    while not here.exists() and here != here.parent:   # nothing created: a failed export
        here = here.parent                              # must leave no new folders
    free = shutil.disk_usage(here).free
    need = int(needed_bytes * 1.1) + (16 << 20)
    if free < need:
        raise ExportError(f"not enough disk space in {parent}: {free / 2**20:.0f} MiB free, "
                          f"~{need / 2**20:.0f} MiB needed",
                          "free some space or export to another disk")


def save_tokenizer(tokenizer, folder: Path) -> list[str]:
    """Save ``tokenizer`` (HF) into ``folder`` keeping ``chat_template`` inside
    ``tokenizer_config.json``; returns the files written."""
    if tokenizer is None:
        return []
    tokenizer.save_pretrained(str(folder))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    tmpl = getattr(tokenizer, "chat_template", None)
    if tmpl and not cfg.get("chat_template"):
        cfg["chat_template"] = tmpl
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = getattr(tokenizer, attr, None)
        if v is not None and attr not in cfg:
            cfg[attr] = str(v)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    if not (folder / "tokenizer.json").exists():
        raise ExportError("the tokenizer has no fast tokenizer.json",
                          "load the model with a fast (tokenizers) tokenizer")
    compact_merges(folder / "tokenizer.json")
    return sorted(p.name for p in folder.iterdir() if p.name in TOKENIZER_FILES
                  or p.name.endswith(".jinja"))


#: text :func:`compact_merges` encodes with both files before keeping the rewritten one
MERGES_CHECK_TEXT = ("Hello world! The history of computing, 1,024 tokens; naïve café, "
                     "日本語のテキスト, emoji 🙂, tabs\tand\nnew lines  double  spaces.")


def compact_merges(path: Path) -> bool:
    """Rewrite a BPE ``tokenizer.json``'s merges from pairs (``[["a", "b"], ...]``, what
    ``tokenizers`` >= 0.20 writes) to the ``"a b"`` strings older versions wrote (and
    every version reads), without indentation. Same tokenizer, less memory to load it:
    ``tokenizers`` 0.23 parses each pair into two strings, so the parse of Gemma 3's
    514,906 merges peaked 356 MiB above the process (164 MiB as strings; resident
    afterwards 96 vs 92 MiB), above llama.cpp's whole peak for that model. Skipped
    (False) when the model is not BPE, the merges are already strings, or a token holds
    a space (the string form would be ambiguous); kept only when both files give the
    same vocabulary and the same ids for :data:`MERGES_CHECK_TEXT`.

    Returns:
        Whether the file was rewritten.
    """
    from tokenizers import Tokenizer

    text = path.read_text(encoding="utf-8")
    data = json.loads(text)
    model = data.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or not all(
            isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges):
        return False
    model["merges"] = [f"{a} {b}" for a, b in merges]
    new = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    del data, merges, model
    old_tok, new_tok = Tokenizer.from_str(text), Tokenizer.from_str(new)
    same = (old_tok.get_vocab_size(True) == new_tok.get_vocab_size(True) and
            old_tok.encode(MERGES_CHECK_TEXT).ids == new_tok.encode(MERGES_CHECK_TEXT).ids)
    if same:
        path.write_text(new, encoding="utf-8")
    return same


DATA_ALIGN = 4096


def save_external(proto, model_path: Path, location: str) -> dict[str, tuple[int, int]]:
    """Save ``proto`` with every initializer >= 1 KiB in ``location`` (next to
    ``model_path``), each at a 4 KiB-aligned (page) offset, so onnxruntime can
    memory-map it instead of copying.

    Returns:
        ``{initializer name: (offset, length)}`` in bytes within ``location``.
    """
    import onnx
    from onnx import numpy_helper

    placed = {}
    off = 0
    with open(model_path.parent / location, "wb") as f:
        for t in proto.graph.initializer:
            raw = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
            if len(raw) < 1024:
                continue
            pad = (-off) % DATA_ALIGN
            f.write(b"\0" * pad)
            off += pad
            f.write(raw)
            t.ClearField("raw_data")
            del t.external_data[:]
            t.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", location), ("offset", str(off)), ("length", str(len(raw)))):
                e = t.external_data.add()
                e.key, e.value = k, v
            placed[t.name] = (off, len(raw))
            off += len(raw)
    onnx.save_model(proto, str(model_path))
    return placed


def row_read_ranges(proto, placed: dict[str, tuple[int, int]]) -> list[list[int]]:
    """Byte ranges ``[[offset, length], ...]`` (sorted, merged) of the external
    initializers the graph reads a row at a time: the data input of a ``Gather`` (the
    embedding table, the quantized codes shared with the head, float zero points). The
    runtime gives just these ranges small page-cache pages before loading
    (``runtime.memory.small_page_cache``); every other initializer is read whole by
    onnxruntime's pre-packing (or folded into a copy) and then dropped from memory.
    """
    names = {n.input[0] for n in proto.graph.node
             if n.op_type == "Gather" and n.input and n.input[0] in placed}
    out: list[list[int]] = []
    for off, length in sorted(placed[n] for n in names):
        if out and off <= out[-1][0] + out[-1][1] + DATA_ALIGN:
            out[-1][1] = max(out[-1][1], off + length - out[-1][0])
        else:
            out.append([off, length])
    return out


__all__ = ["check_out_dir", "claim_out_dir", "check_disk", "atomic_folder", "save_tokenizer",
           "write_json", "save_external", "row_read_ranges", "source_conflict", "foreign_entries",
           "shown_names", "plain_modes", "EXPORT_FILES", "TOKENIZER_FILES", "EXPORT_OUTPUT"]
