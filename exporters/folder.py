"""Writing an export folder atomically (temp dir in the same parent, then rename)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import ExportError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def source_conflict(out, sources) -> "str | None":
    """Why writing ``out`` (and, on overwrite, replacing it) would touch an input, or
    ``None``. A source folder: ``out`` is it, lies inside it or holds it. A source file
    (a ``.gguf``): ``out`` is it or holds it (a folder beside it is harmless)."""
    out = Path(out).expanduser().resolve()
    for src in sources:
        src = Path(src).expanduser().resolve()
        if src.is_dir():
            if out == src or src in out.parents:
                return f"{out} is or lies inside the input model folder {src}"
            if out in src.parents:
                return f"{out} holds the input model folder {src}"
        elif out == src or out in src.parents:
            return f"{out} is or holds the input model file {src}"
    return None


#: Files a Hugging Face tokenizer's ``save_pretrained`` may write (exports and checkpoints
#: carry the model's tokenizer).
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model"})
#: What an export folder holds: anything else in it is the user's, and ``overwrite``
#: refuses to delete it.
EXPORT_FILES = frozenset({"model.onnx", "model.onnx.data", "edgeprune.json",
                          "genai_config.json"}) | TOKENIZER_FILES


def foreign_entries(out: Path, allowed=None, marker: str | None = None) -> list[str]:
    """Names in the existing folder ``out`` that a replacement would delete although no
    edgeprune step wrote them: everything when ``marker`` (e.g. ``edgeprune.json``) is
    missing, else the names outside ``allowed`` (``None``: any name)."""
    names = sorted(p.name for p in out.iterdir())
    if marker is not None and marker not in names:
        return names
    return [n for n in names if allowed is not None and n not in allowed]


def check_out_dir(out_dir: Path, source_dirs: list[Path], overwrite: bool) -> None:
    """Refuse an output path that is, holds or lies in an input (:func:`source_conflict`),
    an existing one without ``overwrite``, and, even with it, a folder that is not an
    earlier export (no ``edgeprune.json``): its files would be deleted.

    Raises:
        ExportError: with the fix (pick another path / pass overwrite=True).
    """
    why = source_conflict(out_dir, source_dirs)
    if why:
        raise ExportError(f"refusing to export there: {why}",
                          "choose an output path outside the model's folder")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out_dir} exists and is not a folder", "choose a new path")
    if out.exists() and not overwrite:
        raise ExportError(f"output folder {out_dir} already exists",
                          "pass overwrite=True (--overwrite) or choose a new path")
    if out.exists():
        other = foreign_entries(out, EXPORT_FILES, marker="edgeprune.json")
        if other:
            raise ExportError(f"output folder {out_dir} holds files that are not an edgeprune "
                              f"export ({shown_names(other)}); overwrite only replaces an earlier export",
                              "move those files out, or choose a new or empty output path")


def shown_names(names: list[str], k: int = 4) -> str:
    """The first ``k`` names for an error message, ``", ..."`` after them when cut."""
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")


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


def _fsync_tree(folder: Path) -> None:
    """Flush every file of ``folder`` (and the folder) to disk before it is renamed into
    place, so a crash right after the rename cannot leave a complete-looking folder with
    truncated files; it also leaves no dirty page-cache pages behind for the runtime's
    memory-mapped weights."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:        # folders cannot be opened for fsync on some platforms
        pass


def plain_modes(path: Path) -> None:
    """Give ``path`` (a file, or a folder and all it holds) the permissions a plain
    ``mkdir``/``open`` would: ``0o777`` / ``0o666`` minus the umask. ``mkdtemp`` and
    ``mkstemp`` create 0700 / 0600 and safetensors writes 0600, which would hide the
    outputs from the other users or the service account an app runs as."""
    path = Path(path)
    mask = os.umask(0)
    os.umask(mask)
    for p in [path] + (sorted(path.rglob("*")) if path.is_dir() else []):
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


@contextmanager
def atomic_folder(out_dir: Path, overwrite: bool = False):
    """Yield a temp folder next to ``out_dir``; rename it to ``out_dir`` on success.

    On any exception the temp folder is removed: nothing half-written is left.
    """
    out_dir = Path(out_dir)
    made = [p for p in [out_dir.parent, *out_dir.parent.parents] if not p.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        plain_modes(tmp)
        _fsync_tree(tmp)
        if out_dir.exists():
            if not overwrite:
                raise ExportError(f"output folder {out_dir} appeared during the export",
                                  "pass overwrite=True or choose a new path")
            trash = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            os.replace(out_dir, trash)
            os.replace(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:                 # the parent folders this export created, innermost first
            try:
                p.rmdir()
            except OSError:
                break
        raise


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
    return sorted(p.name for p in folder.iterdir() if p.name in TOKENIZER_FILES
                  or p.name.endswith(".jinja"))


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


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, default=_default))


def _default(o):
    import numpy as np
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


__all__ = ["check_out_dir", "check_disk", "atomic_folder", "save_tokenizer", "write_json"]
