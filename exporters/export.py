"""``export_onnx``: an HF decoder (+ int codes, + graph variants) -> an export folder.

The steps, one function each: check the options (:func:`check_export_args`,
:func:`_check_inputs`, :func:`_context_length`), compose and run the builder
(:func:`make_builder`: ``BUILDERS[model_type]`` + the variant mixins), describe the graph
(``exporters.metadata``), write and validate the folder (:func:`_write_folder`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import onnx

from edgeprune_runtime.errors import ExportError, UnsupportedArchitectureError
from edgeprune_runtime.session import GRAPH_MAX_LENGTH_KEY

from .decoder import BuildOptions, accuracy_level_for, name_ends_with
from .families import BUILDERS
from .folder import (atomic_folder, check_disk, check_out_dir, row_read_ranges, save_external,
                     save_tokenizer, write_json)
from .int4 import DEFAULT_GROUP_SIZE
from .genai import GENAI_GRAPH, genai_config, genai_graph, hf_config
from .metadata import export_metadata
from .spec import DecoderSpec
from .variants import EXPORT_VARIANTS, compose_builder, variant_entries

EXTERNAL_DATA_THRESHOLD = 2 * 1024 ** 3 - (64 << 20)


@dataclass
class ExportResult:
    """What :func:`export_onnx` wrote.

    Attributes:
        folder: the export folder.
        files: ``{file name: bytes}``.
        parity: validation summary (checker, shape inference, max |Δlogit|, top-1).
        timings: seconds per stage (``build_s``, ``save_s``, ``validate_s``, ``total_s``).
        metadata: the ``edgeprune.json`` content.
    """

    folder: Path
    files: dict = field(default_factory=dict)
    parity: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    @property
    def model_bytes(self) -> int:
        """Bytes of ``model.onnx`` plus its external data."""
        return sum(v for k, v in self.files.items() if k.startswith("model.onnx"))

    def summary(self) -> str:
        """One human-readable paragraph for the CLI."""
        p = self.parity
        why = p.get("not_checked_because")
        par = ((f"logits against the given model on {p.get('window_tokens')} tokens (not a parity check: "
                f"{why}): " if why else f"parity on {p.get('window_tokens')} tokens: ")
               + f"max|Δlogit| {p.get('max_abs_logit_diff', float('nan')):.2e}, top-1 "
               f"{100 * p.get('top1_agreement', float('nan')):.2f}%") if "top1_agreement" in p \
            else "parity not run"
        head = ""
        if "lm_head_int4_ppl_cost" in p:
            c = p["lm_head_int4_ppl_cost"]
            head = (f"; int4 lm_head costs {c['cost_pct']:+.2f}% perplexity on the validation "
                    f"window ({c['window_ppl_int8_head']:.2f} with an 8-bit head -> "
                    f"{c['window_ppl_int4_head']:.2f})")
        return (f"exported {self.folder} ({self.model_bytes / 2**20:.1f} MiB model, "
                f"{self.metadata.get('precision')}, graph {self.metadata.get('graph')}); "
                f"onnx checker {p.get('onnx_checker', 'skipped')}, shape inference "
                f"{p.get('shape_inference', 'skipped')}; {par}{head}"
                + (f"; weights {self.metadata['weights']}" if self.metadata.get("weights") else "")
                + self._narrow_codes_note()
                + (f"; onnxruntime-genai and Optimum load {GENAI_GRAPH}"
                   if (self.metadata.get("genai") or {}).get("graph") else ""))

    def _narrow_codes_note(self) -> str:
        cb = [b for b in ((self.metadata.get("quantization") or {}).get("code_bits") or []) if b < 4]
        return (f"; {'/'.join(map(str, cb))}-bit codes stored exactly as 4-bit MatMulNBits "
                "(4-bit memory and speed)") if cb else ""


def check_export_args(precision: str = "int4", group_size: int = DEFAULT_GROUP_SIZE,
                      accuracy_level: int = 4, max_length: Optional[int] = None) -> None:
    """Check :func:`export_onnx`'s numeric options before any work (the CLI calls it
    before loading the model).

    Raises:
        ExportError: ``accuracy_level`` not 0-4; ``group_size`` not a power of two >= 16
            (int4 exports: ``MatMulNBits`` block sizes); ``max_length`` < 1.
    """
    if isinstance(accuracy_level, bool) or accuracy_level not in (0, 1, 2, 3, 4):
        raise ExportError(f"accuracy_level={accuracy_level!r} is invalid",
                          "use 4 (int8 activations, fast on CPU) or 0 (fp32 compute); 1-3 "
                          "are onnxruntime's fp32/fp16/bf16 compute types")
    if precision == "int4":
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16 \
                or group_size & (group_size - 1):
            raise ExportError(f"group_size={group_size!r} cannot be a MatMulNBits block",
                              "use a power of two >= 16, e.g. 32, 64 or 128")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 1):
        raise ExportError(f"max_length={max_length!r} is not a positive number of tokens",
                          "pass e.g. max_length=2048, or leave it out for the model's context")


def _source_dirs(model, provenance: Optional[dict]) -> list[Path]:
    out = []
    for cand in (getattr(getattr(model, "config", None), "_name_or_path", None),
                 (provenance or {}).get("checkpoint"), (provenance or {}).get("source")):
        if cand and Path(str(cand)).exists():       # folders and single files (.gguf)
            out.append(Path(str(cand)))
    return out


def _check_levels(accuracy_levels: Optional[dict]) -> dict:
    levels = {str(k): int(v) for k, v in (accuracy_levels or {}).items()}
    for k, v in levels.items():
        if v not in (0, 1, 2, 3, 4) or not k:
            raise ExportError(f"accuracy level override {k!r}={v} is invalid",
                              "use a layer-name suffix and a level 0-4, e.g. down_proj=0")
    return levels


def _check_inputs(model, tokenizer, out_dir: Path, provenance: Optional[dict],
                  overwrite: bool) -> None:
    check_out_dir(out_dir, _source_dirs(model, provenance), overwrite)
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        raise ExportError(f"a tokenizer is required, got {type(tokenizer).__name__} (the runtime "
                          "reads tokenizer.json from the export folder)",
                          "pass the model's Hugging Face tokenizer, e.g. "
                          "AutoTokenizer.from_pretrained(model_folder)")


def _context_length(spec: DecoderSpec, max_length: Optional[int]) -> int:
    """The tokens the graph covers: ``max_length``, else the config's context (capped at
    8192 and at the positions the static graph follows exactly)."""
    if spec.exact_positions is not None:
        limit, why = spec.exact_positions
        if max_length is not None and max_length > limit:
            raise UnsupportedArchitectureError(
                f"max_length={max_length}: {why}, which the exported graph cannot follow",
                f"export with max_length <= {limit} (--max-length {limit})")
        if max_length is None and spec.max_position_embeddings > limit:
            warnings.warn(f"max_length set to {limit}, not the config's "
                          f"{min(spec.max_position_embeddings, 8192)}: {why}", stacklevel=3)
            max_length = limit
    if max_length is None:
        return min(spec.max_position_embeddings, 8192)
    if max_length > spec.max_position_embeddings:
        warnings.warn(f"max_length={max_length} exceeds the model's trained context "
                      f"(max_position_embeddings={spec.max_position_embeddings}): tokens past "
                      "it get untrained positions", stacklevel=3)
    return int(max_length)


def make_builder(model, spec: DecoderSpec, opts: BuildOptions):
    """The decoder builder of ``model``: ``BUILDERS[architecture]`` with the mixins of
    ``opts.variants`` (in order), constructed (each mixin validates its spec here).

    Raises:
        ExportError: a variant's spec does not fit the model or the options.
    """
    cls = compose_builder(BUILDERS[spec.architecture], list(opts.variants))
    return cls(model, spec, opts)


def _check_level_overrides(builder) -> None:
    """Every ``accuracy_levels`` suffix must match a ``MatMulNBits`` node (a typo would
    otherwise change nothing, silently)."""
    names = builder.accuracy_names
    for k in builder.opts.accuracy_levels:
        if any(name_ends_with(n, k) for n in names):
            continue
        if not names:
            raise ExportError(f"accuracy level override {k!r}: this export has no MatMulNBits "
                              f"node (precision {builder.opts.precision}, graph {builder.opts.graph})",
                              "drop --accuracy-level-for, or export int4 with --graph fused")
        shown = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ExportError(f"accuracy level override {k!r} matches no MatMulNBits node of "
                          f"this export (nodes are named like {sorted(names)[0]})",
                          "use a node-name suffix such as " + ", ".join(shown[:6]))


def _warn_slow_head(opts: BuildOptions) -> None:
    if opts.lm_head == "q8" and opts.graph == "fused" and \
            accuracy_level_for("lm_head", opts.accuracy_level, opts.accuracy_levels) < 4:
        warnings.warn("an 8-bit lm_head with accuracy_level < 4 decodes very slowly in "
                      "onnxruntime 1.32 (no fp32-compute 8-bit MatMulNBits kernel, measured "
                      "~1.5 tok/s on SmolLM2): use accuracy_level=4 or lm_head='fp'",
                      stacklevel=3)


def _approximate(builder, proto, metadata: dict) -> bool:
    """Whether the logits match the torch model only up to rounding: fp16 values, or int8
    activations in a ``MatMulNBits`` node (or in onnxruntime's fusion of a plain graph's
    ``DequantizeLinear`` + ``MatMul``)."""
    return builder.approximate_logits or any(
        n.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i >= 2
                                           for a in n.attribute)
        for n in proto.graph.node) or (metadata["qdq_accuracy_level"] or 0) >= 2


def _write_folder(tmp: Path, proto, tokenizer, metadata: dict, genai: Optional[dict],
                  config: Optional[dict], external: bool, fused: bool) -> None:
    """``model.onnx`` (+ page-aligned ``model.onnx.data``), tokenizer, ``edgeprune.json``,
    ``config.json`` (Optimum) and, given ``genai``, onnxruntime-genai's graph reading the
    same data and its ``genai_config.json`` (``exporters.genai``)."""
    mpath = tmp / "model.onnx"
    if external:
        placed = save_external(proto, mpath, "model.onnx.data")
        metadata["row_read_ranges"] = row_read_ranges(proto, placed)
        metadata["data_bytes"] = (tmp / "model.onnx.data").stat().st_size
    else:
        onnx.save_model(proto, str(mpath))
    if genai is not None:
        onnx.save_model(genai_graph(proto, fused), str(tmp / GENAI_GRAPH))
    save_tokenizer(tokenizer, tmp)
    if genai is not None:
        write_json(tmp / "genai_config.json", genai)
    if config is not None:
        write_json(tmp / "config.json", config)
    write_json(tmp / "edgeprune.json", metadata)


def _genai_record(builder, genai: bool, external_data: Optional[bool]) -> dict:
    """``edgeprune.json``'s ``genai`` record: the graph onnxruntime-genai runs (and Optimum
    loads with ``file_name``), its config and the inputs it feeds; or why there is none."""
    why = "not asked (genai=False)" if not genai else \
        "onnxruntime-genai cannot feed this graph's caches" if not builder.genai_loadable else \
        "external_data=False: a second graph would copy the weights" if external_data is False \
        else None
    if why:
        return {"graph": None, "config": None, "why": why}
    return {"graph": GENAI_GRAPH, "config": "genai_config.json", "weights": "model.onnx.data",
            "inputs": ["input_ids", "attention_mask"] + ([] if builder.fused else ["position_ids"])
            + ["past_key_values.%d.key", "past_key_values.%d.value"],
            "logits": "every position [batch, sequence, vocab]"}


def _validate(tmp: Path, model, tokenizer, builder, parity_tokens: int, approximate: bool) -> dict:
    """``onnx.checker``, shape inference and the logits of one window against ``model``."""
    from .validate import check_graph, check_parity, parity as run_parity
    parity = dict(check_graph(tmp / "model.onnx"))
    ptok = builder.parity_tokens(min(parity_tokens, int(builder.opts.max_length)))
    parity.update(run_parity(model, tmp, seqlen=ptok, int_weights=builder.int_weights,
                             tokenizer=tokenizer))
    if builder.logits_match_model:
        check_parity(parity, approximate)
    else:
        parity["not_checked_because"] = builder.logits_differ_because
    return parity


def export_onnx(model, tokenizer, out_dir, *, precision: str = "fp32",
                quantized: Optional[dict] = None, masks: Optional[dict] = None,
                sparsity: Optional[dict] = None, sparse_24: bool = False,
                variants: Optional[list] = None, graph: str = "fused",
                lm_head: Optional[str] = None, embedding: Optional[str] = None,
                local_kv: Optional[str] = None, accuracy_level: int = 4,
                accuracy_levels: Optional[dict] = None, group_size: int = DEFAULT_GROUP_SIZE,
                max_length: Optional[int] = None, provenance: Optional[dict] = None,
                overwrite: bool = False, validate: bool = True,
                external_data: Optional[bool] = None, parity_tokens: int = 64,
                genai: bool = True) -> ExportResult:
    """Export an HF llama/qwen2/gemma3 decoder to an ONNX folder with a KV cache.

    Args:
        model: transformers ``*ForCausalLM`` whose weights are the dense equivalent of the
            checkpoint (fake-quantized / masked), fp32, eval mode.
        tokenizer: its HF (fast) tokenizer, saved into the folder (``chat_template`` kept).
        out_dir: output folder (written atomically: temp dir in the same parent, renamed).
        precision: ``fp32`` | ``fp16`` | ``int4``. ``int4`` uses ``quantized`` codes where
            given, and RTN (asym, ``group_size``) for linears absent from it.
        quantized: ``{"model.layers.0.self_attn.q_proj": QuantizedWeight-like}`` (codes
            uint8 [out,in], scales f32 [out,n_groups], zeros uint8, bits, group_size, sym,
            g_idx) packed as-is into ``MatMulNBits`` (GPTQ, Frantar et al. 2023; AWQ, Lin
            et al. 2024). Used by ``int4`` exports only: with ``fp32``/``fp16`` the graph
            holds the model's (dequantized) float weights, recorded as
            ``"weights": "dequantized from the checkpoint's int codes"``.
        masks, sparsity: pruning info recorded in metadata (``{"pattern": "2:4", ...}``).
        sparse_24: assert and record the exact 2:4 pattern of every linear.
        variants: graph variants applied in order (``exporters.variants``): registered
            names (``"compact24"``: 2:4 linears stored as non-zero values + 2-bit
            positions, see ``exporters.sparse24``), compress-side specs
            (``edgeprune.leank.LeanKMask``: a key cache of LeanK's kept channels, LeanK,
            EMNLP 2025; ``edgeprune.countdown.CountdownSpec``: a sparse decode MLP,
            COUNTDOWN, EMNLP 2025; or any ``edgeprune.variants.load_spec`` result), or
            ``(item, options)`` pairs whose options dict updates the spec
            (``(spec, {"graph_mode": "sparse"})``, ``("leank", mask_dict)``). Each is
            recorded in ``edgeprune.json`` under ``"variants"``.
        graph: ``fused`` (ORT contrib ops, shared KV buffer) | ``plain`` (standard ops).
        lm_head: ``q8`` (default for int4 and compact 2:4 exports) | ``fp`` (default
            otherwise) | ``int4``. The family's measured policy is recorded in
            ``edgeprune.json`` ``head``.
        embedding: an untied embedding table: ``fp`` | ``q8`` | ``int4`` (rows gathered
            and dequantized); ``None``: the family's default (qwen2 int4 exports with a
            quantized head: ``int4``; else ``fp``). A tied table follows the head.
        local_kv: cache of sliding-window layers (Gemma 3): ``full`` (every layer spans
            the context) | ``ring`` (only the window; fused graphs then need the runtime's
            ``runtime.kv_cache.RingKVCache``); ``None``: ``ring`` on plain graphs, ``full``
            on fused ones.
        accuracy_level: ``MatMulNBits`` compute type (4 = int8 activations, fastest on CPU;
            0 = fp32 compute).
        accuracy_levels: per-linear overrides ``{name suffix: level}``, e.g.
            ``{"down_proj": 0}``: on SmolLM2-135M the int8 activations of ``down_proj``
            (SiLU(gate)*up, with outliers) carry most of level 4's perplexity cost; see the
            README for the measured trade-off.
        group_size: RTN group size for linears quantized here: a power of two >= 16
            (``MatMulNBits`` block sizes); 64 by default, like the CLI's ``--group-size``.
        max_length: context length in tokens the rotary caches and KV buffers cover
            (>= 1; default: the config's ``max_position_embeddings``, capped at 8192).
        provenance: free-form dict stored in ``edgeprune.json``.
        overwrite: replace an existing ``out_dir``.
        validate: run ``onnx.checker``, shape inference and one-window parity.
        external_data: store weights in ``model.onnx.data`` (forced above 2 GB; ``None``
            = auto: on for int4 exports; tensors are page-aligned in the data file so
            onnxruntime memory-maps them, lowering the peak RSS at load).
        parity_tokens: window length of the parity check.
        genai: also write ``genai_model.onnx`` and ``genai_config.json``, the graph and
            config onnxruntime-genai runs (``exporters.genai``: it feeds
            ``attention_mask``, not our ``seqlens_k``); it reads the weights of
            ``model.onnx.data`` (so float exports then keep their weights there too,
            unless ``external_data=False``, which writes no second graph). Skipped for
            graphs that tool cannot feed (LeanK, sliding-window rings); ``model.onnx``
            is the same either way. ``config.json`` (the model's HF config, for Optimum)
            is always written.

    Returns:
        :class:`ExportResult`.

    Raises:
        ExportError: bad options or variant specs, output path inside the input folder or
            existing, insufficient disk, a failed validation; nothing half-written is left.
        UnsupportedArchitectureError: not a llama/qwen2/gemma3 decoder or a non-Linear layer.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    entries = variant_entries(variants)
    if lm_head is not None and lm_head not in ("fp", "q8", "int4"):
        raise ExportError(f"lm_head='{lm_head}' is unknown", "use fp, q8 or int4")
    quantized = dict(quantized or {})
    dequantized = bool(quantized) and precision != "int4"
    if dequantized:        # a float graph: the model already holds the dequantized weights
        quantized = {}
    check_export_args(precision, group_size, accuracy_level, max_length)
    levels = _check_levels(accuracy_levels)
    _check_inputs(model, tokenizer, out_dir, provenance, overwrite)
    spec = DecoderSpec.from_model(model)
    opts = BuildOptions(precision=precision, graph=graph, lm_head=lm_head, embedding=embedding,
                        local_kv=local_kv,
                        accuracy_level=accuracy_level, accuracy_levels=levels,
                        max_length=_context_length(spec, max_length), group_size=group_size,
                        quantized=quantized, variants=dict(entries))
    builder = make_builder(model, spec, opts)
    _warn_slow_head(opts)
    if sparse_24 and builder.sparsity_info is None:
        from .sparse24 import check_24
        builder.sparsity_info = check_24(model)
    proto = builder.build()
    # the graph's own record of what its shapes allow (the rotary tables hold max_length
    # positions): the runtime refuses an edgeprune.json that promises more
    onnx.helper.set_model_props(proto, {GRAPH_MAX_LENGTH_KEY: str(opts.max_length)})
    t_build = time.perf_counter()
    _check_level_overrides(builder)
    weight_bytes = builder.g.weight_bytes()
    check_disk(out_dir.parent, weight_bytes)
    # external data: when asked, above 2 GB, or (auto) for int4 exports and whenever
    # onnxruntime-genai's graph is written (it reads the same file); onnxruntime
    # memory-maps page-aligned external initializers, which lowers the peak RSS at load
    genai_record = _genai_record(builder, genai, external_data)
    external = (precision == "int4" or genai_record["graph"] is not None
                if external_data is None else external_data) or weight_bytes > EXTERNAL_DATA_THRESHOLD
    records = {name: EXPORT_VARIANTS[name].variant_record(builder) for name, _ in entries}
    metadata = export_metadata(model, builder, proto, quantized=quantized, group_size=group_size,
                               dequantized=dequantized, sparsity=sparsity, variants=records,
                               provenance=provenance)
    metadata["genai"] = genai_record
    genai_cfg = genai_config(model, builder, metadata, tokenizer) if genai_record["graph"] else None
    approximate = _approximate(builder, proto, metadata)
    timings = {"build_s": round(t_build - t0, 3)}
    parity: dict = {}
    with atomic_folder(out_dir, overwrite=overwrite) as tmp:
        ts = time.perf_counter()
        _write_folder(tmp, proto, tokenizer, metadata, genai_cfg, hf_config(model), external,
                      builder.fused)
        del proto
        timings["save_s"] = round(time.perf_counter() - ts, 3)
        if validate:
            tv = time.perf_counter()
            parity = _validate(tmp, model, tokenizer, builder, parity_tokens, approximate)
            timings["validate_s"] = round(time.perf_counter() - tv, 3)
            metadata["validation"] = parity
            write_json(tmp / "edgeprune.json", metadata)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    timings["total_s"] = round(time.perf_counter() - t0, 3)
    return ExportResult(folder=out_dir, files=files, parity=parity, timings=timings,
                        metadata=metadata)


__all__ = ["export_onnx", "check_export_args", "make_builder", "ExportResult",
           "EXTERNAL_DATA_THRESHOLD"]
