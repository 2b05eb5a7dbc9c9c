"""The output guard and claim on a checkpoint folder (:mod:`runtime.files` with the
checkpoint's kind and :class:`~edgeprune.errors.CheckpointError`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from edgeprune_exporters.folder import TOKENIZER_FILES
from edgeprune_runtime.files import OutputClaim, OutputKind, check_output, claim_output

from ..errors import CheckpointError
from .format import CHECKPOINT_FILES, CHECKPOINT_JSON

#: A checkpoint folder, for the output guard: replaced as a whole, marked by
#: ``edgeprune_checkpoint.json`` whose ``run_id`` names the run (the same run is replaced
#: without ``overwrite``); an existing empty folder is taken.
CHECKPOINT_OUTPUT = OutputKind("checkpoint", files=CHECKPOINT_FILES | TOKENIZER_FILES,
                               marker=CHECKPOINT_JSON, marker_key="run_id")


def source_paths(model, provenance: dict) -> list[Path]:
    """The files and folders on this machine the model was read from (a folder, or a
    single ``.gguf``): a checkpoint may not replace them."""
    out = []
    for cand in (getattr(model.config, "_name_or_path", None), getattr(model, "name_or_path", None),
                 provenance.get("source_path"), provenance.get("source")):
        if cand and isinstance(cand, (str, os.PathLike)):
            p = Path(cand)
            if p.exists():                       # a folder, or a single file (.gguf)
                out.append(p.resolve())
    return out


def check_out_dir(out: Path, sources: list[Path], overwrite: bool, run_id: str = "", *,
                  label: Optional[str] = None) -> None:
    """Refuse a checkpoint folder that is, holds or lies in an input model folder (or is
    or holds an input file), is a file, cannot be written, is being written by another
    process, holds another run without ``overwrite`` (``run_id`` differs; ``""``: any
    earlier checkpoint), and, even with it, holds files that are not an edgeprune
    checkpoint's: they would be deleted (:func:`runtime.files.check_output`).

    Args:
        out: the checkpoint folder.
        sources: the model's input files and folders.
        overwrite: an earlier checkpoint there may be replaced.
        run_id: this run's id (``""`` before the run exists: the CLI, ahead of calibrating).
        label: how messages name the path (a CLI flag, e.g. ``--out``).

    Raises:
        CheckpointError: naming the folder and the fix.
    """
    check_output(out, CHECKPOINT_OUTPUT, inputs=sources, overwrite=overwrite,
                 run_id=run_id or None, error=CheckpointError, label=label)


def claim_out_dir(out: Path, sources: list[Path], overwrite: bool, run_id: str = "", *,
                  label: Optional[str] = None) -> OutputClaim:
    """:func:`check_out_dir`, then claim the folder until the checkpoint is written
    (:func:`runtime.files.claim_output`): a second writer is refused at once. Hold it
    around the whole job (``with claim_out_dir(...): ... save_checkpoint(...)``);
    :func:`save_checkpoint` joins a claim its thread holds.

    Raises:
        CheckpointError: everything :func:`check_out_dir` refuses; another writer holds it.
    """
    return claim_output(out, CHECKPOINT_OUTPUT, inputs=sources, overwrite=overwrite,
                        run_id=run_id or None, error=CheckpointError, label=label)


__all__ = ["CHECKPOINT_OUTPUT", "check_out_dir", "claim_out_dir", "source_paths"]
