"""The generation engine: an exported folder -> ``generate`` / ``stream`` / ``logits``.

Torch-free: onnxruntime, numpy, tokenizers (through ``runtime.tokenizer``) and psutil.

Fused graphs (``GroupQueryAttention``) keep one preallocated KV buffer per layer
(``runtime.kv_cache.SharedKVCache``) bound with IOBinding once per generation, sized to
the whole ``max_length`` when that is small (:data:`FULL_KV_BYTES`) or under
``"sliding_window"``, else to the call's requested length (prompt + ``max_new_tokens``,
rounded up to 256 tokens), reused by later calls that fit and checked against the memory
available; each
decode step only rewrites a few preallocated numpy arrays (the next token, ``seqlens_k``,
``total_sequence_length``) that ONNX Runtime reads in place, and the logits land in a
preallocated ``[B, 1, vocab]`` buffer: no per-step allocation proportional to the context.
A batch is prefilled right-padded with per-row lengths (``seqlens_k``), which is exactly
the per-row ragged cache GQA keeps, so padding is invisible to every row. Plain graphs
use left padding with an attention mask and a growing concatenated cache.

Context overflow (``context_policy``):

* ``"error"`` (default): a prompt plus ``max_new_tokens`` that does not fit in
  ``max_length`` raises :class:`GenerationError` naming ``max_length`` before any work.
* ``"sliding_window"``: when a row's cache is full, its last ``max_length // 2`` tokens
  are re-prefilled from position 0 (recomputation; rotary positions restart; the other
  rows of a batch are re-prefilled whole, unchanged) and generation continues; a prompt
  longer than ``max_length`` is cut to the same window (its last ``max_length // 2``
  tokens; ``GenerationResult.prompt_tokens`` counts what was kept). Never a silent
  overwrite of the cache.

Prompt-lookup speculative decoding (``generate(..., prompt_lookup_num_tokens=K)``, batch 1,
fused graphs; :mod:`runtime.lookup`): draft tokens found earlier in the sequence are scored
with the fed token in one multi-token pass over the same shared buffers; the rows written
past the confirmed drafts are never attended and are overwritten by the next pass.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import onnxruntime as ort

from .errors import GenerationError, RuntimeLoadError
from .hugepages import collapse_resident, resident_stretches
from .kv_cache import ConcatKVCache, KVSpec, SharedKVCache
from .lookup import DraftController, check_lookup_args, find_draft
from .sampling import Sampler
from .tokenizer import Tokenizer
from .variants import session_class

Prompt = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]]]
REQUIRED_FILES = ("model.onnx", "edgeprune.json", "tokenizer.json")


@dataclass
class GenerationResult:
    """Output of :meth:`Session.generate`.

    Attributes:
        texts: generated text per row (prompt excluded).
        token_ids: generated ids per row.
        prompt_tokens: prompt length (tokens) per row, as fed to the model (after the
            ``"sliding_window"`` policy's cut of a prompt longer than ``max_length``).
        ttft_ms: time to first token (prefill + first sampling), milliseconds.
        prefill_tok_s: prompt tokens (all rows) / prefill seconds.
        decode_tok_s: generated tokens after the first (longest row) / seconds from the
            first generated token to the last one kept (a step that produced an
            end-of-sequence token is not counted).
        step_ms: wall time of every decode step, milliseconds (with prompt lookup: per
            generated token, a verification pass's time on the first token it yields and
            ~0 on the drafted tokens it confirmed).
        finish_reasons: ``"eos"``, ``"stop"`` or ``"length"`` per row.
        draft_tokens: prompt-lookup draft tokens scored (0 without prompt lookup).
        accepted_draft_tokens: of those, the ones the model's own choice confirmed.
    """

    texts: list
    token_ids: list
    prompt_tokens: list
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    step_ms: list = field(default_factory=list)
    finish_reasons: list = field(default_factory=list)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def text(self) -> str:
        """The first row's text."""
        return self.texts[0]


def _providers(device: str, sparse_24: bool):
    avail = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" not in avail:
            raise RuntimeLoadError("device='cuda' but this onnxruntime has no CUDA provider "
                                   f"(available: {', '.join(avail)})",
                                   "pip install onnxruntime-gpu on a machine with an NVIDIA GPU, "
                                   "or use device='cpu'")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "tensorrt":
        if "TensorrtExecutionProvider" not in avail:
            raise RuntimeLoadError("device='tensorrt' but TensorRT is not available",
                                   "install onnxruntime-gpu with TensorRT, or use 'cuda'/'cpu'")
        # 2:4 structured sparsity kernels are opt-in in TensorRT.
        return [("TensorrtExecutionProvider", {"trt_sparsity_enable": bool(sparse_24)}),
                "CUDAExecutionProvider", "CPUExecutionProvider"]
    raise RuntimeLoadError(f"device '{device}' is unknown", "use 'cpu', 'cuda' or 'tensorrt'")


class Session:
    """A loaded export folder. Use :func:`runtime.load` to build one.

    Args:
        folder: export folder (``model.onnx``, ``edgeprune.json``, ``tokenizer.json``...).
        device: ``cpu`` | ``cuda`` | ``tensorrt`` (sets TensorRT's sparsity flag for 2:4
            exports).
        threads: intra-op threads (``None``: onnxruntime's default).
        max_length: KV-cache length in tokens (default and upper bound: the export's).
        context_policy: ``"error"`` | ``"sliding_window"`` (see module docstring).
        huge_pages: on CPU, back the memory the load made resident (the weights
            onnxruntime pre-packed) with 2 MiB transparent huge pages (Linux 6.1+
            ``MADV_COLLAPSE``; see :mod:`runtime.hugepages`: ~10 % faster decode, ~0.3 s
            of load, no RSS growth). ``huge_page_bytes`` records how much was collapsed.

    Raises:
        RuntimeLoadError: missing files, corrupt ``model.onnx`` / metadata, unknown device,
            ``threads`` / ``max_length`` not positive integers.
        GenerationError: ``max_length`` above the export's, unknown ``context_policy``.
    """

    #: whether ``generate(prompt_lookup_num_tokens=...)`` may run multi-token passes over
    #: this class's cache (subclasses with their own cache layout or per-step state say no)
    supports_prompt_lookup = True

    def __init__(self, folder, device: str = "cpu", threads: Optional[int] = None,
                 max_length: Optional[int] = None, context_policy: str = "error",
                 huge_pages: bool = True):
        if not isinstance(folder, (str, os.PathLike)):
            raise RuntimeLoadError(f"folder must be a path, got {type(folder).__name__}",
                                   "pass the folder written by `edgeprune export`")
        self.folder = Path(folder)
        for name, v in (("threads", threads), ("max_length", max_length)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                  or v < 1):
                raise RuntimeLoadError(f"{name} must be a positive integer or None, got {v!r}",
                                       f"pass e.g. {name}={2 if name == 'threads' else 512}")
        if not self.folder.is_dir():
            raise RuntimeLoadError(f"{folder} is not a folder",
                                   "pass the folder written by `edgeprune export`")
        missing = [f for f in REQUIRED_FILES if not (self.folder / f).is_file()]
        if missing:
            raise RuntimeLoadError(f"{self.folder} is missing {', '.join(missing)}",
                                   "re-run `edgeprune export` into a fresh folder")
        try:
            self.meta = json.loads((self.folder / "edgeprune.json").read_text())
            if not isinstance(self.meta, dict):
                raise ValueError(f"a JSON object expected, found {type(self.meta).__name__}")
            _check_meta(self.meta)
        except (OSError, ValueError) as e:
            raise RuntimeLoadError(f"cannot read {self.folder / 'edgeprune.json'}: {e}",
                                   "re-run `edgeprune export`; the metadata is corrupt") from e
        if context_policy not in ("error", "sliding_window"):
            raise GenerationError(f"context_policy '{context_policy}' is unknown",
                                  "use 'error' or 'sliding_window'")
        self.context_policy = context_policy
        self.device = "cpu" if device == "cpu" else "cuda"
        # CPU decode steps read inputs from and write logits to numpy buffers bound once
        # (in place); on a GPU each step binds its inputs and takes the logits from
        # the binding's outputs (the generic path, also reachable on CPU for tests)
        self.in_place_io = self.device == "cpu"
        sparse = isinstance(self.meta.get("sparsity"), dict) and \
            self.meta["sparsity"].get("pattern") == "2:4"
        # the tokenizer first: its transient parse memory is freed before onnxruntime's
        # load peak (lower peak RSS)
        self.tokenizer = Tokenizer.from_folder(self.folder)
        self.threads = threads
        so = self._session_options()
        data = self.folder / "model.onnx.data"
        want = self.meta.get("data_bytes")
        have = data.stat().st_size if isinstance(want, int) and data.is_file() else want
        if have != want:
            raise RuntimeLoadError(f"{data} is truncated or altered ({have:,} bytes, "
                                   f"the export wrote {want:,})",
                                   "copy the folder again, or re-run `edgeprune export`")
        _small_page_cache(data, self.meta.get("row_read_ranges"))
        collapse = huge_pages and self.device == "cpu"
        before = set()
        if collapse:
            _release_free_heap()    # freed heap the load may reuse: not resident, so counted as new
            before = resident_stretches()
        try:
            self.sess = ort.InferenceSession(str(self.folder / "model.onnx"), so,
                                             providers=_providers(device, sparse))
        except RuntimeLoadError:
            raise
        except Exception as e:  # noqa: BLE001  (onnxruntime raises several types)
            raise RuntimeLoadError(f"onnxruntime cannot load {self.folder / 'model.onnx'}: "
                                   f"{str(e).splitlines()[0][:600]}",
                                   "the file is corrupt or incomplete; re-run `edgeprune export`"
                                   ) from e
        _release_free_heap()
        _drop_mapped_weight_pages(self.folder)
        # only what this load made resident (the pre-packed weights), not the whole process
        self.huge_page_bytes = collapse_resident(before) if collapse else 0
        names = {i.name for i in self.sess.get_inputs()}
        self.fused = "seqlens_k" in names
        self.kv = KVSpec.from_session(self.sess)
        self.output_names = [o.name for o in self.sess.get_outputs()]
        graph_limit = _graph_max_length(self.sess)
        limit = int(self.meta.get("max_length") or graph_limit or 2048)
        if graph_limit is not None and limit > graph_limit:
            raise RuntimeLoadError(f"edgeprune.json says max_length={limit} but the graph's "
                                   f"rotary tables hold {graph_limit} positions",
                                   f"restore the folder's edgeprune.json (max_length {graph_limit}), "
                                   "or re-export with `--max-length`")
        if max_length is not None and int(max_length) > limit:
            raise GenerationError(f"max_length={max_length} exceeds the export's {limit}",
                                  f"use max_length <= {limit} or re-export with a larger "
                                  "--max-length")
        self.max_length = int(max_length or limit)
        self.export_max_length = limit
        logits_dim = {o.name: o.shape for o in self.sess.get_outputs()}.get("logits", [None])[-1]
        self.vocab_size = int(self.meta.get("vocab_size") or logits_dim or 0)
        if isinstance(logits_dim, int) and self.vocab_size != logits_dim:
            raise RuntimeLoadError(f"edgeprune.json says vocab_size={self.vocab_size} but the "
                                   f"graph's logits have {logits_dim}",
                                   "restore the folder's edgeprune.json, or re-run `edgeprune export`")
        if self.vocab_size < 1:
            raise RuntimeLoadError("the vocabulary size is unknown (no vocab_size in "
                                   "edgeprune.json, no static logits shape)",
                                   "re-run `edgeprune export`")
        eos = self.meta.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = sorted(set(eos) | set(self.tokenizer.eos_token_ids))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else
                                (self.eos_token_ids[0] if self.eos_token_ids else 0))
        self._caches: dict[int, SharedKVCache] = {}
        self._lock = threading.Lock()
        self._stream_thread: Optional[int] = None   # thread of a suspended stream(), if any
        self._closed = False

    def _session_options(self) -> "ort.SessionOptions":
        """The onnxruntime options every session over this folder uses (subclasses that
        build a second session, e.g. with an overridden initializer, start from these)."""
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads is not None:
            so.intra_op_num_threads = int(self.threads)
            so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Plain int4 graphs: ORT fuses DequantizeLinear+MatMul into MatMulNBits; keep the
        # export's accuracy_level (4 = int8 activations) for that fusion too.
        acc = (self.meta.get("quantization") or {}).get("accuracy_level",
                                                         self.meta.get("qdq_accuracy_level"))
        if acc is not None:
            so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(int(acc)))
        return so

    def _check_context(self, st, feed) -> Optional[np.ndarray]:
        """Context-overflow policy before a decode step: raises (``"error"``), or
        re-prefills and returns the new logits (``"sliding_window"``); ``None`` when the
        step fits."""
        if int(st["lens"].max()) + 1 > self.max_length:
            if self.context_policy != "sliding_window":
                raise GenerationError(f"the context is full (max_length={self.max_length})",
                                      "use context_policy='sliding_window' or a larger max_length")
            return self._overflow(st, feed)
        return None

    # ------------------------------------------------------------------ info
    @property
    def weights_bytes(self) -> int:
        """Bytes of the model file(s) on disk (``model.onnx`` + external data)."""
        return sum(p.stat().st_size for p in self.folder.iterdir()
                   if p.name.startswith("model.onnx") and p.is_file())

    def kv_cache_bytes(self, length: int, batch: int = 1) -> dict:
        """``{"k": bytes, "v": bytes}`` for ``length`` cached tokens, from the graph's
        actual past-key/value input shapes (a LeanK graph with fewer key channels
        reports less)."""
        return self.kv.bytes(int(length), int(batch))

    # ---------------------------------------------------------------- inputs
    def _encode(self, prompt: Prompt, chat: bool) -> tuple[list[list[int]], bool]:
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            # one conversation: [{"role": ..., "content": ...}, ...] through the chat template
            prompt = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            chat = False
        if isinstance(prompt, str):
            prompts, batched = [prompt], False
        elif isinstance(prompt, np.ndarray):
            prompts = prompt.tolist() if prompt.ndim == 2 else [prompt.tolist()]
            batched = prompt.ndim == 2
        elif isinstance(prompt, (list, tuple)) and len(prompt) > 0 and \
                all(isinstance(t, (int, np.integer)) for t in prompt):
            prompts, batched = [list(prompt)], False
        elif isinstance(prompt, (list, tuple)) and len(prompt) > 0:
            prompts, batched = list(prompt), True
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            raise GenerationError("the prompt is empty", "pass a non-empty string or token ids")
        else:
            raise GenerationError(f"a prompt must be a string, token ids or a list of them, "
                                  f"got {type(prompt).__name__}",
                                  "pass e.g. 'Hello' or [1, 2, 3]")
        out = []
        for row, p in enumerate(prompts):
            if isinstance(p, str):
                if chat:
                    p = self.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                           add_generation_prompt=True)
                ids = self.tokenizer.encode(p, add_special_tokens=False) if p else []
            elif isinstance(p, (list, tuple, np.ndarray)) and all(
                    isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
                if chat:
                    raise GenerationError("chat=True renders the chat template around a text prompt; "
                                          "token ids would be used as they are",
                                          "pass the text, or token ids already templated with chat=False")
                ids = [int(t) for t in p]
            else:
                raise GenerationError(f"prompt row {row} is neither a string nor integer token ids "
                                      f"({type(p).__name__})",
                                      "pass strings, or lists of int token ids from this "
                                      "folder's tokenizer")
            if not ids:
                raise GenerationError("the prompt is empty" + (f" (row {row})" if batched else ""),
                                      "pass a non-empty string or token ids")
            self._check_token_range(min(ids), max(ids))
            if len(ids) > self.max_length:
                if self.context_policy == "sliding_window":
                    ids = ids[-max(1, self.max_length // 2):]   # the window an overflow keeps
                else:
                    raise GenerationError(f"the prompt has {len(ids)} tokens, more than the "
                                          f"context max_length={self.max_length}",
                                          "shorten the prompt, load with a larger max_length, or "
                                          "use context_policy='sliding_window' (keeps its last "
                                          "max_length // 2 tokens)")
            out.append(ids)
        return out, batched

    # ---------------------------------------------------------------- logits
    def logits(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None
               ) -> np.ndarray:
        """Prefill-only logits of every position: ``float32 [B, S, vocab]``.

        Args:
            input_ids: ``int64 [B, S]``.
            attention_mask: ``int64 [B, S]``, 1 on real tokens; padding must be on the
                left (as in HF). Padded positions return zeros.

        Raises:
            GenerationError: ``S`` exceeds ``max_length`` or a row has no real token.
        """
        self._check_open()
        ids, mask = self._logits_inputs(input_ids, attention_mask)
        B, S = ids.shape
        lens = mask.sum(1)
        self._acquire()
        try:
            _check_memory(sum(self.kv.bytes(max(S, 1), B).values()) + B * S * self.vocab_size * 4,
                          f"the KV cache and logits of {B} row(s) x {S} tokens",
                          "score fewer rows or shorter windows at once")
            if not self.fused:
                pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
                cache = ConcatKVCache(self.kv, B, self.device)
                out = np.require(self._run_plain(ids, mask, pos, S, cache), np.float32, ["C", "W"])
                out[mask == 0] = 0.0        # in place: float32, no second [B, S, vocab] array
                return out
            rows = [ids[b][mask[b] == 1] for b in range(B)]
            packed = np.full((B, S), self.pad_token_id, np.int64)
            for b, r in enumerate(rows):
                packed[b, :len(r)] = r
            cache = SharedKVCache(self.kv, B, max(S, 1), self.device)
            out = self._run_fused(packed, (lens - 1).astype(np.int32), S, S, cache)
            del cache
            out = np.require(out, np.float32, ["C", "W"])
            for b in range(B):      # rows right-aligned in place: one row's copy at a time
                n = int(lens[b])
                if n < S:
                    out[b, S - n:] = out[b, :n].copy()
                    out[b, :S - n] = 0.0
            return out
        finally:
            self._release()

    def _check_token_range(self, lo, hi) -> None:
        """Raises :class:`GenerationError` unless token ids ``lo..hi`` lie in ``[0, vocab)``."""
        if lo < 0 or hi >= self.vocab_size:
            raise GenerationError(f"token id out of range [0, {self.vocab_size}): min {int(lo)}, "
                                  f"max {int(hi)}", "encode the text with this folder's tokenizer")

    def _logits_inputs(self, input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [B, S], mask int64 [B, S])`` checked for :meth:`logits`: integer
        ids in ``[0, vocab)``, ``S <= max_length``, a 0/1 mask of the same shape, padded
        on the left only, with a real token in every row.

        Raises:
            GenerationError: naming the problem and the fix.
        """
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise GenerationError(f"input_ids must be integer token ids [batch, seq] (or [seq]), got "
                                  f"{ids.dtype} {tuple(np.shape(input_ids))}",
                                  "pass e.g. np.array([[1, 2, 3]])")
        self._check_token_range(ids.min(), ids.max())
        ids = ids.astype(np.int64)
        if ids.shape[1] > self.max_length:
            raise GenerationError(f"{ids.shape[1]} tokens exceed max_length={self.max_length}",
                                  "evaluate shorter windows or load with a larger max_length")
        if attention_mask is None:
            return ids, np.ones_like(ids)
        mask = np.asarray(attention_mask)
        if mask.ndim == 1:
            mask = mask[None]
        if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
            raise GenerationError(f"attention_mask must be 0/1 of the ids' shape {ids.shape}, got "
                                  f"{mask.dtype} {tuple(mask.shape)}",
                                  "pass 1 on real tokens and 0 on (left) padding")
        mask = mask.astype(np.int64)
        if (mask.sum(1) == 0).any():
            raise GenerationError("a row of attention_mask has no real token", "drop empty rows")
        if (np.diff(mask, axis=1) < 0).any():
            raise GenerationError("attention_mask has padding after a real token (right or "
                                  "inner padding)", "pad on the left, as for generation")
        return ids, mask

    def _acquire(self) -> None:
        """Take the session lock: waits for another thread's call, raises when a
        suspended ``stream()`` of this very thread holds it (waiting would never end),
        or when the session was closed meanwhile."""
        if not self._lock.acquire(blocking=self._stream_thread != threading.get_ident()):
            raise GenerationError("a stream() on this session is still open in this thread",
                                  "exhaust it or call its .close() first (or use a second session)")
        if self._closed:
            self._release()
            raise GenerationError("the session is closed", "load the folder again")

    def _run_fused(self, ids, seqlens_k, total, keep, cache: SharedKVCache) -> np.ndarray:
        bd = self.sess.io_binding()
        bd.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        bd.bind_cpu_input("seqlens_k", np.ascontiguousarray(seqlens_k, dtype=np.int32))
        bd.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        bd.bind_cpu_input("num_logits_to_keep", np.array(keep, np.int64))
        cache.bind(bd)
        bd.bind_output("logits", "cpu")          # bound last: the last output (binding order)
        self.sess.run_with_iobinding(bd)
        return bd.get_outputs()[-1].numpy()

    def _run_plain(self, ids, mask, pos, keep, cache: ConcatKVCache) -> np.ndarray:
        bd = self.sess.io_binding()
        bd.bind_cpu_input("input_ids", np.ascontiguousarray(ids))
        bd.bind_cpu_input("attention_mask", np.ascontiguousarray(mask))
        bd.bind_cpu_input("position_ids", np.ascontiguousarray(pos))
        bd.bind_cpu_input("num_logits_to_keep", np.array(keep, np.int64))
        cache.bind(bd)
        bd.bind_output("logits", "cpu")          # bound last: the last output (binding order)
        self.sess.run_with_iobinding(bd)
        outs = bd.get_outputs()
        cache.update(outs[:-1])
        return outs[-1].numpy()

    # -------------------------------------------------------------- generate
    def generate(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 stop: Optional[list] = None, seed: Optional[int] = None,
                 chat: bool = False, prompt_lookup_num_tokens: int = 0,
                 max_matching_ngram_size: int = 2) -> GenerationResult:
        """Generate continuations.

        Args:
            prompt: a string, token ids, or a batch of either (rows may differ in length;
                padding is invisible).
            max_new_tokens: tokens to generate per row (>= 1).
            temperature, top_k, top_p, repetition_penalty, seed: sampling
                (``runtime.sampling.Sampler``; temperature 0 = greedy).
            stop: strings that end a row (the text is cut before them).
            chat: render string prompts with the folder's chat template first.
            prompt_lookup_num_tokens: ``> 0`` turns on prompt-lookup speculative decoding
                (:mod:`runtime.lookup`; batch 1, fused graphs): up to this many tokens
                drafted from an earlier occurrence of the last ``max_matching_ngram_size``
                tokens and scored in one pass (the length adapts: two more after a fully
                confirmed draft, one fewer after a rejection, none while the measured
                cost of a draft token outweighs its chance of being confirmed:
                :class:`runtime.lookup.DraftController`). Every token is still drawn from the
                model's distribution at its position with the same sampler (same seed,
                same draws in the same order), so the output is the one without lookup
                wherever the one-token and the multi-token passes give the same logits
                (exact for fp32 graphs; int8-activation int4 graphs round activations
                differently in the two passes, so a near-tie can resolve differently).
            max_matching_ngram_size: longest suffix n-gram prompt lookup matches (``>= 1``).

        Returns:
            :class:`GenerationResult`.

        Raises:
            GenerationError: empty prompt, prompt (+ ``max_new_tokens`` under the
                ``"error"`` policy) longer than ``max_length``, bad sampling arguments.
        """
        res = None
        for res, _ in self._iter(prompt, max_new_tokens, temperature, top_k, top_p,
                                 repetition_penalty, stop, seed, chat,
                                 lookup=(prompt_lookup_num_tokens, max_matching_ngram_size))[0]:
            pass
        return res

    def stream(self, prompt: Union[str, Sequence[int]], max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               repetition_penalty: float = 1.0, stop: Optional[list] = None,
               seed: Optional[int] = None, chat: bool = False,
               prompt_lookup_num_tokens: int = 0,
               max_matching_ngram_size: int = 2) -> Iterator[str]:
        """Yield text pieces as they are generated (one prompt, or one conversation as a
        list of ``{"role", "content"}`` messages). Same tokens as :meth:`generate` for the
        same arguments and seed. Arguments are checked at the call (same errors as
        :meth:`generate`); the session serves nothing else in this thread until the
        iterator is exhausted or closed.

        Raises:
            GenerationError: a batch (use :meth:`generate`), or as :meth:`generate`.
        """
        if isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) and \
                not isinstance(prompt[0], (int, np.integer, dict)):
            raise GenerationError("stream() takes one prompt", "use generate() for a batch")
        gen, stop = self._iter(prompt, max_new_tokens, temperature, top_k, top_p,
                               repetition_penalty, stop, seed, chat, streaming=True,
                               lookup=(prompt_lookup_num_tokens, max_matching_ngram_size))
        return self._stream_text(gen, stop)

    def _stream_text(self, gen, stop: list[str]) -> Iterator[str]:
        dec = self.tokenizer.incremental_decoder()
        emitted, n = "", 0
        hold = max((len(s) for s in stop), default=1) - 1
        for res, final in gen:
            ids = res.token_ids[0]
            for t in ids[n:]:
                dec.push(t)
            n = len(ids)
            if final:
                dec.flush()
            text = dec.text
            if stop:
                cut = min((text.find(s) for s in stop if s and s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
                elif not final and hold:
                    text = text[:max(len(emitted), len(text) - hold)]
            if len(text) > len(emitted) and text.startswith(emitted):
                yield text[len(emitted):]
                emitted = text

    def _check_room(self, lens: list[int], max_new_tokens: int) -> int:
        """Tokens a row's cache must hold; raises when that exceeds ``max_length`` under
        the ``"error"`` policy."""
        # the last new token is sampled, never fed back: prompt + max_new_tokens - 1 cached
        need = max(lens) + max_new_tokens - 1
        if need > self.max_length and self.context_policy == "error":
            raise GenerationError(
                f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context max_length={self.max_length}",
                "lower max_new_tokens, shorten the prompt, "
                + (f"load with a larger max_length (up to the export's {self.export_max_length}), "
                   if self.max_length < self.export_max_length else
                   "re-export with a larger `edgeprune export --max-length`, ")
                + "or use context_policy='sliding_window'")
        return need

    def _check_open(self) -> None:
        if self._closed:
            raise GenerationError("the session is closed", "load the folder again")

    def _iter(self, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
              stop, seed, chat, streaming=False, lookup=(0, 2)):
        self._check_open()
        lookup = check_lookup_args(*lookup)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a positive integer, got "
                                  f"{max_new_tokens!r}", "pass e.g. max_new_tokens=128")
        sampler = Sampler(temperature, top_k, top_p, repetition_penalty, seed)
        prompts, batched = self._encode(prompt, chat)
        need = self._check_room([len(p) for p in prompts], int(max_new_tokens))
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, (list, tuple))
                                 or not all(isinstance(x, str) for x in stop)):
            raise GenerationError(f"stop must be a string or a list of strings, got {stop!r}",
                                  "pass e.g. stop=['\\n\\n']")
        stop = [x for x in (stop or []) if x]
        if lookup[0]:
            self._check_lookup(len(prompts))
        # arguments are checked now (an error at the call, not at the first next())
        return self._locked(prompts, int(max_new_tokens), sampler, stop, streaming, need,
                            lookup), stop

    def _check_lookup(self, batch: int) -> None:
        """Prompt lookup needs a fused graph of this class (a multi-token pass over the
        shared KV buffers) and one row."""
        if not (self.fused and self.supports_prompt_lookup):
            raise GenerationError(f"prompt lookup needs a fused GroupQueryAttention export "
                                  f"served by runtime.Session; this is a "
                                  f"{'fused' if self.fused else 'plain'} graph served by "
                                  f"{type(self).__name__}",
                                  "pass prompt_lookup_num_tokens=0, or re-export with "
                                  "`edgeprune export --graph fused` (no LeanK / COUNTDOWN)")
        if batch != 1:
            raise GenerationError(f"prompt lookup decodes one row at a time, got a batch of {batch}",
                                  "generate the rows one by one, or pass prompt_lookup_num_tokens=0")

    def _locked(self, prompts, max_new, sampler, stop, streaming, need, lookup=(0, 2)):
        me = threading.get_ident()
        self._acquire()
        try:
            if streaming:
                self._stream_thread = me
            yield from self._loop(prompts, max_new, sampler, stop, streaming, need, lookup)
        finally:
            if streaming:
                self._stream_thread = None
            self._release()

    def _loop(self, prompts, max_new, sampler, stop, streaming, need=None, lookup=(0, 2)):
        B = len(prompts)
        # prompt lookup: tokens already chosen (and, but for the last, already cached) by
        # a verification pass, emitted one per step below before the next forward pass
        queued: list[int] = []
        drafted = accepted = 0
        ctrl = DraftController(lookup[0]) if lookup[0] else None
        guess = None          # a gated-off draft's first token, checked against the next choice
        eos = set(self.eos_token_ids)
        gen: list[list[int]] = [[] for _ in range(B)]
        seen = [list(p) for p in prompts]                       # for repetition penalty
        done = [False] * B
        reasons = ["length"] * B
        texts = [""] * B
        step_ms: list[float] = []
        t0 = time.perf_counter()
        state = self._prefill(prompts, need)
        logits = state["logits"]
        t_prefill = time.perf_counter() - t0
        ttft = None
        t_dec0 = t_last = None    # decode time: from the first token to the last one kept
        for step in range(max_new):
            ts = time.perf_counter()
            if queued:
                # a confirmed draft needs no forward pass, but a closed session stops here too
                self._check_not_closed_mid_generation()
                nxt = [queued.pop(0)]
            else:
                nxt = sampler(logits, seen if sampler.repetition_penalty != 1.0 else None)
                if guess is not None:
                    ctrl.observe_guess(int(nxt[0]) == guess)
                    guess = None
            for b in range(B):
                if done[b]:
                    continue
                t = int(nxt[b])
                if t in eos:
                    done[b], reasons[b] = True, "eos"
                    continue
                gen[b].append(t)
                seen[b].append(t)
                t_last = time.perf_counter()
                if stop:
                    texts[b] = self.tokenizer.decode(gen[b])
                    if stop:
                        cut = min((texts[b].find(s) for s in stop if s in texts[b]), default=-1)
                        if cut >= 0:
                            texts[b] = texts[b][:cut]
                            done[b], reasons[b] = True, "stop"
            if ttft is None:
                ttft = time.perf_counter() - t0
                t_dec0 = t_last = time.perf_counter()
            if streaming:
                yield self._result(prompts, gen, texts, ttft, t_prefill, (t_dec0, t_last), step_ms,
                                   reasons, drafted, accepted), False
            if all(done) or step == max_new - 1:
                break
            if queued:          # confirmed by the last verification pass: no forward pass
                step_ms.append((time.perf_counter() - ts) * 1e3)
                continue
            feed = np.array([gen[b][-1] if gen[b] else self.pad_token_id for b in range(B)],
                            np.int64)
            draft = None
            if ctrl is not None:
                # at most the tokens still to generate after the fed one, and what the cache holds
                room = min(max_new - step - 2, state["cache"].max_length - int(state["lens"][0]) - 1)
                k = min(ctrl.next_len(), room)
                draft = find_draft(np.asarray(seen[0], np.int64), lookup[1], max(k, 1 if room > 0 else 0))
                if k == 0 and len(draft):         # gated off: remember the guess, step plainly
                    guess, draft = int(draft[0]), draft[:0]
            tf = time.perf_counter()
            if draft is not None and len(draft):
                queued = self._verify(state, int(feed[0]), draft, sampler, seen[0])
                drafted += len(draft)
                accepted += len(queued) - 1
                ctrl.observe_pass(len(draft), len(queued) - 1, time.perf_counter() - tf)
            else:
                logits = self._decode_step(state, feed)
                if ctrl is not None:
                    ctrl.observe_step(time.perf_counter() - tf)
            step_ms.append((time.perf_counter() - ts) * 1e3)
        if not stop:
            texts = [self.tokenizer.decode(g) for g in gen]
        yield self._result(prompts, gen, texts, ttft, t_prefill, (t_dec0, t_last), step_ms,
                           reasons, drafted, accepted), True

    def _verify(self, st, fed: int, draft: np.ndarray, sampler: Sampler,
                seen: list[int]) -> list[int]:
        """One speculative pass (batch 1, fused graph): the fed token and the ``k`` draft
        tokens go through the graph at once (``1 + k`` positions written to the shared KV
        buffers, ``1 + k`` logits rows kept); the sampler then draws position by position
        (the repetition penalty seeing the tokens before each), keeping draft tokens while
        its draw equals them (Leviathan et al. 2023 with a one-hot draft). The cache stays
        valid up to the fed token and the kept drafts; the rows written past them are
        never attended (``seqlens_k``) and are overwritten by the next pass.

        Args:
            st: the decode state of :meth:`_prefill`.
            fed: the token to feed (the last one generated, not yet cached).
            draft: ``[k]`` int64 draft ids, ``k >= 1``, fitting in the cache.
            sampler: the generation's sampler (its seeded draws are consumed in order).
            seen: the row's ids so far, ``fed`` included (for the repetition penalty).

        Returns:
            The tokens chosen, ``1 <= n <= k + 1``: the first ``n - 1`` are the confirmed
            drafts (cached), the last is the model's own next token (not cached yet).
        """
        self._check_not_closed_mid_generation()
        k = len(draft)
        lens = st["lens"]
        ids = np.concatenate([[fed], draft]).astype(np.int64)[None, :]
        logits = self._run_fused(ids, np.array([lens[0] + k], np.int32), int(lens[0]) + k + 1,
                                 k + 1, st["cache"])[0]
        penalty = sampler.repetition_penalty != 1.0
        chosen: list[int] = []
        for i in range(k + 1):
            t = int(sampler(logits[i:i + 1], [seen + chosen] if penalty else None)[0])
            chosen.append(t)
            if i == k or t != int(draft[i]):
                break
        # cached now: the fed token and the confirmed drafts (all chosen but the last)
        st["tokens"][0].extend([fed] + chosen[:-1])
        lens += len(chosen)
        return chosen

    def _result(self, prompts, gen, texts, ttft, t_prefill, t_dec, step_ms, reasons,
                drafted=0, accepted=0):
        # the pass that produced an end-of-sequence token (dropped) is not decode time
        dec_s = t_dec[1] - t_dec[0] if t_dec[0] is not None else 0.0
        n_dec = max(len(g) for g in gen) - 1 if gen else 0
        return GenerationResult(
            texts=list(texts), token_ids=[list(g) for g in gen],
            prompt_tokens=[len(p) for p in prompts], ttft_ms=(ttft or 0.0) * 1e3,
            prefill_tok_s=sum(len(p) for p in prompts) / max(t_prefill, 1e-9),
            decode_tok_s=(n_dec / dec_s) if (dec_s > 0 and n_dec > 0) else 0.0,
            step_ms=list(step_ms), finish_reasons=list(reasons), draft_tokens=drafted,
            accepted_draft_tokens=accepted)

    # ----------------------------------------------------- fused prefill/decode
    def _cache(self, B: int, need: Optional[int] = None) -> SharedKVCache:
        """The preallocated KV buffers for batch ``B``: the whole ``max_length`` when that
        takes at most :data:`FULL_KV_BYTES` (or under the sliding-window policy, or when
        ``need`` is unknown), else ``need`` tokens per row (prompt + ``max_new_tokens``)
        rounded up to a multiple of :data:`KV_CHUNK`, capped at ``max_length``. Reused by
        later calls that fit; decode steps never reallocate them.

        Raises:
            GenerationError: the buffers would not fit in the memory available now.
        """
        cap = self.max_length
        full = sum(self.kv.bytes(self.max_length, B).values())
        if need is not None and self.context_policy == "error" and full > FULL_KV_BYTES:
            cap = min(self.max_length, -(-int(need) // KV_CHUNK) * KV_CHUNK)
        c = self._caches.get(B)
        if c is None or c.max_length < cap:
            self._caches.clear()   # keep at most one set of buffers resident
            _check_memory(sum(self.kv.bytes(cap, B).values()),
                          f"the KV cache for {B} row(s) x {cap} tokens",
                          "generate fewer rows at once, lower max_new_tokens, or load with a "
                          "smaller max_length")
            c = self._caches[B] = SharedKVCache(self.kv, B, cap, self.device)
        return c

    def _prefill(self, prompts, need: Optional[int] = None) -> dict:
        B = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int64)
        S = int(lens.max())
        if not self.fused:
            ids = np.full((B, S), self.pad_token_id, np.int64)
            mask = np.zeros((B, S), np.int64)
            for b, p in enumerate(prompts):
                ids[b, S - len(p):] = p
                mask[b, S - len(p):] = 1
            pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
            cache = ConcatKVCache(self.kv, B, self.device)
            logits = self._run_plain(ids, mask, pos, 1, cache)[:, -1]
            return {"logits": logits, "cache": cache, "mask": mask, "pos": pos[:, -1:].copy(),
                    "lens": lens.copy(), "tokens": [list(p) for p in prompts]}
        cache = self._cache(B, need)
        ids = np.full((B, S), self.pad_token_id, np.int64)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = p
        # rows are right-padded (GroupQueryAttention's prompt layout): the graph keeps the
        # last `keep` positions so that every row's last real token is among them
        keep = int(S - lens.min() + 1)
        kept_bytes = B * keep * self.vocab_size * 4
        if B > 1 and kept_bytes > PREFILL_LOGITS_BYTES and self.in_place_io:
            # rows of very different lengths: prefill each row alone into its row of the
            # buffers (keeps one position per row, not B x keep x vocab floats)
            logits = np.stack([self._run_fused(ids[b:b + 1, :int(lens[b])], np.array([lens[b] - 1], np.int32),
                                               int(lens[b]), 1, cache.row(b))[0, -1] for b in range(B)])
        else:
            if kept_bytes > PREFILL_LOGITS_BYTES:       # small ones need no /proc read
                _check_memory(kept_bytes, f"the prefill logits ({B} row(s) x {keep} positions x "
                              f"{self.vocab_size} vocab)", "generate prompts of similar length "
                              "together, or fewer rows at once")
            out = self._run_fused(ids, (lens - 1).astype(np.int32), S, keep, cache)
            idx = (lens - 1) - (S - keep)
            logits = out[np.arange(B), idx]
        # Decode-step state: preallocated inputs read in place by onnxruntime.
        st = {"cache": cache, "lens": lens.copy(), "tokens": [list(p) for p in prompts]}
        st["ids"] = np.zeros((B, 1), np.int64)
        st["seqlens"] = np.zeros((B,), np.int32)
        st["total"] = np.zeros((), np.int32)
        st["keep"] = np.ones((), np.int64)
        st["logits_buf"] = np.zeros((B, 1, self.vocab_size), np.float32)
        bd = self.sess.io_binding()
        cache.bind(bd)
        if self.in_place_io:
            for name, arr in (("input_ids", st["ids"]), ("seqlens_k", st["seqlens"]),
                              ("total_sequence_length", st["total"]),
                              ("num_logits_to_keep", st["keep"])):
                bd.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
            bd.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(st["logits_buf"]))
        else:
            bd.bind_output("logits", "cpu")      # bound last: the last output (binding order)
        st["binding"] = bd
        st["logits"] = logits
        return st

    def _overflow(self, st, feed) -> Optional[np.ndarray]:
        """Sliding-window policy: the rows whose cache is full keep their last
        max_length//2 tokens, the others all of theirs (so a row's tokens do not depend on
        its neighbours), and the batch is re-prefilled."""
        keep_n = max(1, self.max_length // 2)
        rows = [(t + [int(f)])[-keep_n:] if len(t) + 1 > self.max_length else t + [int(f)]
                for t, f in zip(st["tokens"], feed)]
        new = self._prefill(rows)
        st.clear()
        st.update(new)
        return new["logits"]

    def _check_not_closed_mid_generation(self) -> None:
        """Every decode step (subclasses' too) stops a generation that close() ended."""
        if self._closed:
            raise GenerationError("the session was closed during generation", "load the folder again")

    def _decode_step(self, st, feed: np.ndarray) -> np.ndarray:
        self._check_not_closed_mid_generation()
        over = self._check_context(st, feed)
        if over is not None:
            return over
        lens = st["lens"]
        for b, f in enumerate(feed):
            st["tokens"][b].append(int(f))
        if not self.fused:
            mask = np.concatenate([st["mask"], np.ones((len(feed), 1), np.int64)], 1)
            st["mask"] = mask
            st["pos"] = st["pos"] + 1
            lens += 1
            return self._run_plain(feed[:, None], mask, st["pos"], 1, st["cache"])[:, -1]
        st["ids"][:, 0] = feed
        st["seqlens"][:] = lens            # new total per row minus one
        lens += 1
        st["total"][()] = int(lens.max())
        bd = st["binding"]
        if not self.in_place_io:
            bd.bind_cpu_input("input_ids", st["ids"])
            bd.bind_cpu_input("seqlens_k", st["seqlens"])
            bd.bind_cpu_input("total_sequence_length", st["total"])
            bd.bind_cpu_input("num_logits_to_keep", st["keep"])
            self.sess.run_with_iobinding(bd)
            return bd.get_outputs()[-1].numpy()[:, -1]
        _run_bound(self.sess, bd)
        return st["logits_buf"][:, 0]

    # ---------------------------------------------------------------- close
    def close(self) -> None:
        """Release the onnxruntime session and the KV buffers. Calls after it (also a
        stream opened before it, or a call waiting in another thread) raise
        ``GenerationError``; a call running in another thread stops at its next decode
        step (a prefill already running finishes first) and the resources are released
        when it lets go of the session."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            self._release()

    def _release(self) -> None:
        """Let go of the session lock; the last holder after :meth:`close` frees the
        onnxruntime session and the KV buffers (never under a running call)."""
        if self._closed:
            self._free()
        self._lock.release()
        # close() may have set the flag after the check above and found the lock held:
        # look again now that it is free (whoever gets the lock frees; freeing is idempotent)
        if self._closed and self.sess is not None and self._lock.acquire(blocking=False):
            try:
                self._free()
            finally:
                self._lock.release()

    def _free(self) -> None:
        self._caches.clear()
        self.sess = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


#: The ``model.onnx`` metadata key under which the exporter records how many positions its
#: graph supports (the rows of its rotary tables); ``edgeprune.json`` may not promise more.
GRAPH_MAX_LENGTH_KEY = "edgeprune.max_length"


def _graph_max_length(sess) -> Optional[int]:
    """The positions the loaded graph supports, from its own metadata
    (:data:`GRAPH_MAX_LENGTH_KEY`); ``None`` for exports that predate the record."""
    v = sess.get_modelmeta().custom_metadata_map.get(GRAPH_MAX_LENGTH_KEY)
    try:
        return int(v) if v is not None and int(v) >= 1 else None
    except ValueError:
        return None


def _check_meta(meta: dict) -> None:
    """Types of the ``edgeprune.json`` fields the runtime reads (a hand-edited or damaged
    file gives one clear error here, not a TypeError deep in a later call).

    Raises:
        ValueError: naming the field.
    """
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool)

    for k in ("max_length", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "hidden_size"):
        if k in meta and meta[k] is not None and not (whole(meta[k]) and meta[k] >= 1):
            raise ValueError(f"field {k!r} = {meta[k]!r} is not a positive integer")
    eos = meta.get("eos_token_id")
    if eos is not None and not (whole(eos) or (isinstance(eos, list) and all(whole(e) for e in eos))):
        raise ValueError(f"field 'eos_token_id' = {eos!r} is not a token id or a list of them")
    for k in ("quantization", "sparsity", "rope", "leank", "countdown", "kv_layout"):
        if meta.get(k) is not None and not isinstance(meta[k], dict):
            raise ValueError(f"field {k!r} = {meta[k]!r} is not an object")
    for k, acc in (("quantization.accuracy_level", (meta.get("quantization") or {}).get("accuracy_level")),
                   ("qdq_accuracy_level", meta.get("qdq_accuracy_level"))):
        if acc is not None and not (whole(acc) and 0 <= acc <= 4):
            raise ValueError(f"field {k!r} = {acc!r} is not 0-4")


#: Above this many bytes of kept prefill logits (``B x (longest - shortest + 1) x vocab``
#: floats) a CPU batch is prefilled one row at a time (one 600-token row beside three
#: 1-token rows of SmolLM2 kept 461 MiB of logits).
PREFILL_LOGITS_BYTES = 64 << 20

#: KV buffers are sized in steps of this many tokens (reuse across calls of similar length).
KV_CHUNK = 256
#: Up to this many bytes the KV buffers span the whole ``max_length`` (batch 1 of SmolLM2
#: up to ~2,900 tokens): their untouched pages cost no memory (4 KiB pages, below numpy's
#: 4 MiB huge-page threshold), and one session alternating 256- and 2,048-token buffers
#: decoded ~2 % faster with the long ones (49.5 vs 50.7 tok/s at 1 thread, 64.6 vs 66.4
#: at 2; 12 rounds each, within this machine's noise). Larger caches (long contexts,
#: wide batches) are sized per call: there numpy's huge-page advice makes every touched
#: head slice a 2 MiB page (426 MiB for one row of an 8,192-token export, 22 GB for 64).
FULL_KV_BYTES = 128 << 20


def _check_memory(nbytes: int, what: str, fix: str) -> None:
    """Raise :class:`GenerationError` when ``nbytes`` exceed 90 % of the memory the OS
    reports available now (``MemAvailable`` in ``/proc/meminfo``; no check where it is
    absent; the rest is headroom for activations), instead of letting the OOM killer end
    the process."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if nbytes > 0.9 * avail:
        raise GenerationError(f"{what} needs {nbytes / 2**20:.0f} MiB, more than the "
                              f"{avail / 2**20:.0f} MiB available", fix)


def _release_free_heap() -> None:
    """Return heap freed by the session build (graph transforms, prepacking) to the OS
    (glibc ``malloc_trim``), so the generation peak RSS does not sit on top of it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _run_bound(sess, bd) -> None:
    """``sess.run_with_iobinding(bd)`` for a binding whose outputs are all preallocated
    CPU buffers (the decode step), without the Python wrapper's per-call WebGPU
    graph-capture bookkeeping (it calls exactly the same bound ``run_with_iobinding``);
    falls back to the public call if onnxruntime's internals differ."""
    try:
        inner, binding = sess._sess, bd._iobinding
    except AttributeError:
        sess.run_with_iobinding(bd)
        return
    inner.run_with_iobinding(binding, None)


def _small_page_cache(path: Path, ranges: Optional[list] = None) -> bool:
    """Put the row-read tables of the weight file in the page cache as 4 KiB pages
    before onnxruntime maps it.

    After the session build, the runtime drops the mapped weight pages
    (:func:`_drop_mapped_weight_pages`); the embedding table shared with the q8
    ``lm_head`` is then read a row per token through that private mapping. When the
    file sits in the page cache as 2 MiB folios (Linux readahead makes them on
    filesystems with large-folio support), each such row read maps a whole 2 MiB folio:
    SmolLM2-135M int4 held 20 MiB of the 28 MiB table resident after 128 tokens (peak
    RSS 224 MiB instead of 214). Evicting the clean, unmapped page-cache pages
    (``POSIX_FADV_DONTNEED``) and reading them back with readahead off
    (``POSIX_FADV_RANDOM``) leaves single pages, so a row costs a page. Never changes
    data: pages mapped or dirty elsewhere are not evicted.

    Args:
        path: ``model.onnx.data``.
        ranges: ``[[offset, length], ...]`` bytes to treat, the exporter's
            ``row_read_ranges`` in ``edgeprune.json`` (the ``Gather`` tables: 29 of 94 MB
            for SmolLM2-135M int4); ``None`` (exports without the field) = the whole
            file (one sequential read, 0.19 s for 94 MB here).

    Returns:
        True when done; False where unsupported (not Linux, no file, an OS error).
    """
    if not hasattr(os, "posix_fadvise") or not path.is_file():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if ranges is None:
            spans = [(0, size)]
        else:
            page = 4096
            spans = []
            for off, length in ranges:
                a = max(0, int(off)) // page * page
                b = min(size, -(-(int(off) + int(length)) // page) * page)
                if b > a:
                    spans.append((a, b))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)      # the whole fd: no readahead
        chunk = 1 << 16
        for a, b in spans:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
            pos = a
            while pos < b:
                n = len(os.pread(fd, min(chunk, b - pos), pos))
                if n == 0:
                    break
                pos += n
        return True
    except (OSError, TypeError, ValueError):
        return False
    finally:
        os.close(fd)


def _drop_mapped_weight_pages(folder: Path) -> int:
    """Drop the resident pages of this folder's memory-mapped weight file.

    onnxruntime memory-maps page-aligned external initializers (``model.onnx.data``,
    private mappings). Building the session reads them all (pre-packing ``MatMulNBits``
    into its own buffers), which leaves the whole file resident, although afterwards
    only the initializers that are not pre-packed are read, and sparsely: the embedding
    table (shared with the quantized ``lm_head``) is read one row per token.
    ``madvise(MADV_DONTNEED)`` hands those pages back to the page cache; a later read
    faults the page in again from the file. Only mappings without a single
    copy-on-write page (``Anonymous: 0`` in ``/proc/self/smaps``: nothing this process
    wrote) are advised, so no data can be lost. ``Private_Dirty`` alone is not such a
    page: a file written moments ago (a fresh export, a copy) still has dirty page-cache
    pages, which ``smaps`` counts as dirty in every mapping of them; skipping those
    mappings left ~25 MiB more resident (peak RSS 240 vs 215 MiB for SmolLM2-135M int4).
    llama.cpp's mmap'd weights keep the same kind of footprint: only the pages in use
    are resident.

    Returns:
        Bytes of mappings advised (0 where unsupported: not Linux, no mapping).
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        done = 0
        for m in _weight_mappings(folder):
            a, b = m["range"]
            if m["Anonymous"] == 0 and libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), 4) == 0:
                done += b - a                                   # 4 = MADV_DONTNEED
        return done
    except (OSError, AttributeError, ValueError):
        return 0


def _weight_mappings(folder: Path) -> list[dict]:
    """This process's mappings of ``folder``'s ``model.onnx*`` files, from
    ``/proc/self/smaps``: ``[{"range": (start, end), "Rss": bytes, "Anonymous": bytes}]``
    (``Anonymous``: copy-on-write pages this process wrote).

    Raises:
        OSError: no ``/proc/self/smaps`` (not Linux).
    """
    root = os.path.realpath(folder) + os.sep
    maps, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:
                path = head[5].strip() if len(head) > 5 else ""
                cur = None
                if path.startswith(root) and os.path.basename(path).startswith("model.onnx"):
                    a, b = (int(x, 16) for x in head[0].split("-"))
                    cur = {"range": (a, b), "Rss": 0, "Anonymous": 0}
                    maps.append(cur)
            elif cur is not None and head[0] in ("Rss:", "Anonymous:"):
                cur[head[0][:-1]] += int(head[1]) * 1024
    return maps


def load(folder, device: str = "cpu", threads: Optional[int] = None,
         max_length: Optional[int] = None, context_policy: str = "error",
         huge_pages: bool = True) -> Session:
    """Load an export folder: ``runtime.load(folder, device="cpu", threads=2)``.

    See :class:`Session` for the arguments and raised errors.
    """
    try:   # variant exports (LeanK, COUNTDOWN...) run through their registered sessions
        meta = json.loads((Path(folder) / "edgeprune.json").read_text())
    except (OSError, ValueError, TypeError):
        meta = {}   # Session reports missing/corrupt metadata / a non-path with a clear error
    cls = session_class(meta if isinstance(meta, dict) else {}, Session)
    return cls(folder, device=device, threads=threads, max_length=max_length,
               context_policy=context_policy, huge_pages=huge_pages)


__all__ = ["load", "Session", "GenerationResult"]
