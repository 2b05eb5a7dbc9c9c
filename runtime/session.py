"""The runtime's public API and loading: an exported folder -> ``generate`` / ``stream`` / ``logits``.

Torch-free: onnxruntime, numpy, tokenizers (through ``runtime.tokenizer``) and psutil.

:func:`load` reads the folder's ``edgeprune.json``, picks the session class registered for
its graph variant (:mod:`runtime.variants`; plain exports get :class:`Session`) and builds
it. :class:`Session` checks the folder, builds the onnxruntime session (with the OS memory
care of :mod:`runtime.memory` and :mod:`runtime.hugepages` around it), checks and encodes
prompts, and hands generation to the loop it derives from
(:class:`runtime.generation.GenerationLoop`: prefill, decode steps, KV-cache sizing,
prompt-lookup verification).

Context overflow (``context_policy``):

* ``"error"`` (default): a prompt plus ``max_new_tokens`` that does not fit in
  ``max_length`` raises :class:`GenerationError` naming ``max_length`` before any work.
* ``"sliding_window"``: when a row's cache is full, its last ``max_length // 2`` tokens
  are re-prefilled from position 0 (recomputation; rotary positions restart; the other
  rows of a batch are re-prefilled whole, unchanged) and generation continues; a prompt
  longer than ``max_length`` is cut to the same window (its last ``max_length // 2``
  tokens; ``GenerationResult.prompt_tokens`` counts what was kept). Never a silent
  overwrite of the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import onnxruntime as ort

from . import memory
from .errors import GenerationError, RuntimeLoadError
from .generation import GenerationLoop, GenerationResult
from .hugepages import collapse_resident, resident_stretches
from .inputs import encode_prompts, logits_inputs
from .kv_cache import ConcatKVCache, KVSpec, SharedKVCache
from .lookup import check_lookup_args
from .sampling import Sampler
from .streaming import TextStream
from .tokenizer import Tokenizer
from .variants import session_class

Prompt = Union[str, Sequence[int], Sequence[str], Sequence[Sequence[int]]]
REQUIRED_FILES = ("model.onnx", "edgeprune.json", "tokenizer.json")


def _no_dropper():
    """No page dropping (GPU sessions copy the weights to the device)."""
    return contextlib.nullcontext()


def _providers(device: str, sparse_24: bool) -> list:
    """onnxruntime's provider list for ``device`` (``cpu`` | ``cuda`` | ``tensorrt``).

    Raises:
        RuntimeLoadError: an unknown device, or one this onnxruntime cannot run.
    """
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


class Session(GenerationLoop):
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
        profile_prefix: turn on onnxruntime's profiler: every run's nodes are traced into
            the JSON file ``<profile_prefix>_<date>.json`` that :meth:`end_profiling`
            closes and names (read it with ``edgeprune_devices.profiler.ops``). Tracing
            slows every step; use it for a breakdown, never for timings.

    Raises:
        RuntimeLoadError: missing files, corrupt ``model.onnx`` / metadata, unknown device,
            ``threads`` / ``max_length`` not positive integers.
        GenerationError: ``max_length`` above the export's, unknown ``context_policy``.
    """

    def __init__(self, folder, device: str = "cpu", threads: Optional[int] = None,
                 max_length: Optional[int] = None, context_policy: str = "error",
                 huge_pages: bool = True, profile_prefix: Optional[Union[str, os.PathLike]] = None):
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
        self.profile_prefix = None if profile_prefix is None else str(profile_prefix)
        so = self._session_options()
        data = self.folder / "model.onnx.data"
        want = self.meta.get("data_bytes")
        if isinstance(want, int) and want > 0 and not data.is_file():
            raise RuntimeLoadError(f"{data} is missing (the export wrote {want:,} bytes of weights "
                                   "there)", "copy the whole folder again, or re-run `edgeprune export`")
        have = data.stat().st_size if isinstance(want, int) and data.is_file() else want
        if have != want:
            raise RuntimeLoadError(f"{data} is truncated or altered ({have:,} bytes, the "
                                   f"export wrote {want:,}), or edgeprune.json's data_bytes "
                                   "was edited",
                                   "copy the folder again, or re-run `edgeprune export`")
        memory.small_page_cache(data, self.meta.get("row_read_ranges"))
        collapse = huge_pages and self.device == "cpu"
        before = set()
        if collapse:
            memory.release_free_heap()    # freed heap the load may reuse: not resident, so counted as new
            before = resident_stretches()
        try:
            # the mapped weights are handed back while the build pre-packs them, not after
            with memory.WeightPageDropper(self.folder) if self.device == "cpu" else _no_dropper() as dropper:
                self.sess = ort.InferenceSession(str(self.folder / "model.onnx"), so,
                                                 providers=_providers(device, sparse))
        except RuntimeLoadError:
            raise
        except Exception as e:  # noqa: BLE001  (onnxruntime raises several types)
            if not data.is_file() and "external data" in str(e).lower():   # exports without data_bytes
                raise RuntimeLoadError(f"{data} is missing (model.onnx keeps its weights there)",
                                       "copy the whole folder again, or re-run `edgeprune export`"
                                       ) from e
            raise RuntimeLoadError(f"onnxruntime cannot load {self.folder / 'model.onnx'}: "
                                   f"{str(e).splitlines()[0][:600]}",
                                   "the file is corrupt or incomplete; re-run `edgeprune export`"
                                   ) from e
        memory.release_free_heap()
        paged = getattr(dropper, "paged", {}).get(data.name)
        if paged and data.is_file():      # MADV_PAGEOUT evicted read tables: small pages again
            again = memory.overlapping_ranges(self.meta.get("row_read_ranges"), paged,
                                              data.stat().st_size)
            if again:
                memory.small_page_cache(data, again)
        memory.drop_mapped_weight_pages(self.folder)
        # only what this load made resident (the pre-packed weights), not the whole process
        self.huge_page_bytes = collapse_resident(before) if collapse else 0
        names = {i.name for i in self.sess.get_inputs()}
        self.fused = "seqlens_k" in names
        self.kv = KVSpec.from_session(self.sess)
        self.output_names = [o.name for o in self.sess.get_outputs()]
        graph_limit = _graph_max_length(self.sess)
        limit = int(self.meta.get("max_length") or graph_limit or 2048)
        if graph_limit is not None and limit != graph_limit:    # the export writes the same
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
        if self.profile_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = self.profile_prefix
        return so

    def end_profiling(self) -> Path:
        """Stop onnxruntime's profiler and return the trace file it wrote (see
        ``profile_prefix``).

        Raises:
            GenerationError: the session was not loaded with ``profile_prefix``.
        """
        if not self.profile_prefix:
            raise GenerationError("this session is not profiling",
                                  "load it with runtime.load(folder, profile_prefix='trace')")
        return Path(self.sess.end_profiling())

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
        """``(rows of token ids, batched)`` of a prompt (:func:`runtime.inputs.encode_prompts`)."""
        return encode_prompts(self.tokenizer, prompt, chat, self.vocab_size, self.max_length,
                              self.context_policy)

    # ---------------------------------------------------------------- logits
    def logits(self, input_ids: np.ndarray, attention_mask: Optional[np.ndarray] = None,
               chunk: Optional[int] = None) -> np.ndarray:
        """Prefill-only logits of every position: ``float32 [B, S, vocab]``.

        Args:
            input_ids: ``int64 [B, S]``.
            attention_mask: ``int64 [B, S]``, 1 on real tokens; padding must be on the
                left (as in HF). Padded positions return zeros.
            chunk: fused graphs: feed each row in passes of this many tokens, one row at a
                time; a later pass reads the earlier tokens from the KV cache as a decode
                step does. ``chunk=1`` scores exactly the decode path (onnxruntime's first
                pass over a float16 cache, ``exporters.kvcache``, reads its own keys and
                values unrounded; an int8 cache is read quantized by every pass). ``None``:
                one pass.

        Raises:
            GenerationError: ``S`` exceeds ``max_length``, a row has no real token, or
                ``chunk`` is not a positive integer.
        """
        self._check_open()
        ids, mask = self._logits_inputs(input_ids, attention_mask)
        B, S = ids.shape
        lens = mask.sum(1)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer))
                                  or chunk < 1):
            raise GenerationError(f"chunk={chunk!r} must be a positive integer", "pass e.g. chunk=64, or None")
        self._acquire()
        try:
            memory.check_memory(sum(self.kv.bytes(max(S, 1), B).values()) + B * S * self.vocab_size * 4,
                                f"the KV cache and logits of {B} row(s) x {S} tokens",
                                "score fewer rows or shorter windows at once")
            if chunk is not None and self.fused and chunk < S:
                return self._chunked_logits(ids, mask, int(chunk))
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

    def _chunked_logits(self, ids: np.ndarray, mask: np.ndarray, chunk: int) -> np.ndarray:
        """:meth:`logits` of a fused graph row by row in passes of ``chunk`` tokens through
        one batch-1 shared cache (left padding stays zeros)."""
        B, S = ids.shape
        out = np.zeros((B, S, self.vocab_size), np.float32)
        cache = SharedKVCache(self.kv, 1, S, self.device)
        for b in range(B):
            row = ids[b][mask[b] == 1]
            n = len(row)
            for a in range(0, n, chunk):
                e = min(n, a + chunk)
                # a first pass (total == its length) reads its own K/V; later ones the cache
                lg = self._run_fused(row[None, a:e], np.array([e - 1], np.int32), e, e - a, cache)
                out[b, S - n + a:S - n + e] = lg[0]
        return out

    def _logits_inputs(self, input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` checked for :meth:`logits` (:func:`runtime.inputs.logits_inputs`)."""
        return logits_inputs(input_ids, attention_mask, self.vocab_size, self.max_length)

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
               max_matching_ngram_size: int = 2) -> TextStream:
        """Yield text pieces as they are generated (one prompt, or one conversation as a
        list of ``{"role", "content"}`` messages). Same tokens as :meth:`generate` for the
        same arguments and seed. Arguments are checked at the call (same errors as
        :meth:`generate`); the session serves nothing else in this thread until the
        iterator is exhausted or closed. The returned :class:`runtime.streaming.TextStream`
        tells afterwards why it ended (``finish_reason``: ``"eos"``, ``"stop"``,
        ``"length"``, ``"cancelled"``) and holds the ``result`` (token counts, timings).

        Raises:
            GenerationError: a batch (use :meth:`generate`), or as :meth:`generate`.
        """
        if isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) and \
                not isinstance(prompt[0], (int, np.integer, dict)):
            raise GenerationError("stream() takes one prompt", "use generate() for a batch")
        gen, stop = self._iter(prompt, max_new_tokens, temperature, top_k, top_p,
                               repetition_penalty, stop, seed, chat, streaming=True,
                               lookup=(prompt_lookup_num_tokens, max_matching_ngram_size))
        return TextStream(gen, stop, self.tokenizer)

    def _iter(self, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty,
              stop, seed, chat, streaming=False, lookup=(0, 2)):
        """Checks the arguments of :meth:`generate` / :meth:`stream` and encodes the prompts
        now (an error at the call), then returns ``(the loop's generator, stop strings)``."""
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
        return self._naming_files(self._locked(prompts, int(max_new_tokens), sampler, stop,
                                               streaming, need, lookup)), stop

    def _naming_files(self, gen):
        """The loop ``gen``, its non-finite-logits error (the sampler's, which knows no
        folder) naming the graph that produced them and what to do."""
        try:
            yield from gen
        except GenerationError as e:
            if not e.message.startswith("logits contain"):
                raise
            raise GenerationError(f"{e.message}: the graph {self.folder / 'model.onnx'} (weights "
                                  "in model.onnx.data) produced them",
                                  "its files are damaged, or an fp16 export overflows: copy the "
                                  "folder again, or re-run `edgeprune export` (fp32 or int4)") from None

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
    if "data_bytes" in meta and meta["data_bytes"] is not None and not (
            whole(meta["data_bytes"]) and meta["data_bytes"] >= 0):
        raise ValueError(f"field 'data_bytes' = {meta['data_bytes']!r} is not a byte count")
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


def load(folder, device: str = "cpu", threads: Optional[int] = None,
         max_length: Optional[int] = None, context_policy: str = "error",
         huge_pages: bool = True, profile_prefix: Optional[Union[str, os.PathLike]] = None) -> Session:
    """Load an export folder: ``runtime.load(folder, device="cpu", threads=2)``.

    See :class:`Session` for the arguments and raised errors.
    """
    try:   # variant exports (LeanK, COUNTDOWN...) run through their registered sessions
        meta = json.loads((Path(folder) / "edgeprune.json").read_text())
    except (OSError, ValueError, TypeError):
        meta = {}   # Session reports missing/corrupt metadata / a non-path with a clear error
    cls = session_class(meta if isinstance(meta, dict) else {}, Session)
    return cls(folder, device=device, threads=threads, max_length=max_length,
               context_policy=context_policy, huge_pages=huge_pages, profile_prefix=profile_prefix)


__all__ = ["load", "Session", "GenerationResult"]
