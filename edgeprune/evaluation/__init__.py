"""Evaluation of a model, checkpoint or export, one concern per module.

* :mod:`.perplexity`: perplexity under one recorded protocol (windows, no BOS);
* :mod:`.fidelity`: KL, top-1 agreement, per-layer activation SNR and greedy-continuation
  change against the dense model;
* :mod:`.languages`: per-language perplexity on parallel text, relative to the dense model;
* :mod:`.tasks` (with :mod:`.task_data` and :mod:`.lm`): zero-shot task accuracy scored by
  lm-eval (the ``eval`` extra), from local files or lm-eval's hub data;
* :mod:`.backends`: one scoring interface over a torch model and an ONNX export;
* :mod:`.decode_path`: an export's logits token by token through its KV cache (what
  generation computes) beside its one-pass logits, and its fidelity on both paths.

``edgeprune.evaluate`` re-exports these names (the module's earlier home).
"""

from __future__ import annotations

from .decode_path import DecodePathModel, ExportFidelity, PathAgreement, export_fidelity, path_agreement
from .fidelity import FidelityResult, continuation_prompts, fidelity, snr_db
from .perplexity import PerplexityResult, Protocol, eval_windows, perplexity, resolve_text

__all__ = ["Protocol", "PerplexityResult", "FidelityResult", "perplexity", "fidelity", "eval_windows",
           "resolve_text", "snr_db", "continuation_prompts", "DecodePathModel", "ExportFidelity",
           "PathAgreement", "export_fidelity", "path_agreement"]
