"""ONNX exporters: a compressed (or dense) HF decoder -> a folder the runtime loads.

Public API: :func:`export_onnx` -> :class:`ExportResult`. The graph is built from the
weights with ``onnx.helper`` (``exporters.decoder``); int4 weights are packed from the
quantizer's own integer codes (``exporters.int4``); 2:4 sparsity is verified, recorded
and optionally stored in a compact form (``exporters.sparse24``).

This package must not import ``edgeprune`` (dependencies flow edgeprune -> exporters ->
runtime); quantized weights are duck-typed ``QuantizedWeight``-like objects.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from runtime.errors import ExportError, UnsupportedArchitectureError
from runtime.session import GRAPH_MAX_LENGTH_KEY

from .decoder import BUILDERS, BuildOptions, DecoderSpec, accuracy_level_for, name_ends_with
from .folder import (atomic_folder, check_disk, check_out_dir, row_read_ranges, save_external,
                     save_tokenizer, write_json)

FORMAT_VERSION = 1
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
        par = (f"parity on {p.get('window_tokens')} tokens: max|Δlogit| "
               f"{p.get('max_abs_logit_diff', float('nan')):.2e}, top-1 "
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
                + self._narrow_codes_note())

    def _narrow_codes_note(self) -> str:
        cb = [b for b in ((self.metadata.get("quantization") or {}).get("code_bits") or []) if b < 4]
        return (f"; {'/'.join(map(str, cb))}-bit codes stored exactly as 4-bit MatMulNBits "
                "(4-bit memory and speed)") if cb else ""


def _source_dirs(model, provenance: Optional[dict]) -> list[Path]:
    out = []
    for cand in (getattr(getattr(model, "config", None), "_name_or_path", None),
                 (provenance or {}).get("checkpoint"), (provenance or {}).get("source")):
        if cand and Path(str(cand)).exists():       # folders and single files (.gguf)
            out.append(Path(str(cand)))
    return out


def check_export_args(precision: str = "int4", group_size: int = 64, accuracy_level: int = 4,
                      max_length: Optional[int] = None) -> None:
    """Check :func:`export_onnx`'s numeric options before any work (the CLI calls it
    before loading the model or calibrating).

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


def export_onnx(model, tokenizer, out_dir, *, precision: str = "fp32",
                quantized: Optional[dict] = None, masks: Optional[dict] = None,
                sparsity: Optional[dict] = None, sparse_24: bool = False,
                compact_24: bool = False, graph: str = "fused", lm_head: Optional[str] = None,
                accuracy_level: int = 4, accuracy_levels: Optional[dict] = None,
                group_size: int = 64, max_length: Optional[int] = None,
                provenance: Optional[dict] = None, overwrite: bool = False,
                validate: bool = True, external_data: Optional[bool] = None,
                parity_tokens: int = 64, leank=None, leank_sink: Optional[int] = None,
                leank_window: Optional[int] = None) -> ExportResult:
    """Export an HF llama/qwen2 decoder to an ONNX folder with a KV cache.

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
        compact_24: store 2:4 linears as non-zero values + 2-bit positions (expanded by
            ONNX Runtime's constant folding at load; see ``exporters.sparse24``).
        graph: ``fused`` (ORT contrib ops, shared KV buffer) | ``plain`` (standard ops).
        lm_head: ``q8`` (default for int4 exports) | ``fp`` (default otherwise) | ``int4``.
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
        leank: a LeanK key-channel mask (``edgeprune.leank.LeanKMask`` or its ``to_dict()``):
            the graph's key cache keeps only the kept channels in its middle part, with
            full-key sink/window caches (see ``exporters.leank``; LeanK, EMNLP 2025).
        leank_sink, leank_window: tokens kept with full keys (defaults 64 / 448).

    Returns:
        :class:`ExportResult`.

    Raises:
        ExportError: bad options, output path inside the input folder or existing,
            insufficient disk, a failed validation; nothing half-written is left.
        UnsupportedArchitectureError: not a llama/qwen2 decoder or a non-Linear layer.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    quantized = dict(quantized or {})
    if lm_head is None:   # 8-bit head for int4 and compact 2:4 exports (small-model quality)
        lm_head = "q8" if (precision == "int4" or compact_24) else "fp"
    if lm_head not in ("fp", "q8", "int4"):
        raise ExportError(f"lm_head='{lm_head}' is unknown", "use fp, q8 or int4")
    if compact_24 and not sparse_24:
        sparse_24 = True
    dequantized = bool(quantized) and precision != "int4"
    if dequantized:        # a float graph: the model already holds the dequantized weights
        quantized = {}
    check_export_args(precision, group_size, accuracy_level, max_length)
    accuracy_levels = {str(k): int(v) for k, v in (accuracy_levels or {}).items()}
    for k, v in accuracy_levels.items():
        if v not in (0, 1, 2, 3, 4) or not k:
            raise ExportError(f"accuracy level override {k!r}={v} is invalid",
                              "use a layer-name suffix and a level 0-4, e.g. down_proj=0")
    if lm_head == "q8" and graph == "fused" and \
            accuracy_level_for("lm_head", accuracy_level, accuracy_levels) < 4:
        import warnings
        warnings.warn("an 8-bit lm_head with accuracy_level < 4 decodes very slowly in "
                      "onnxruntime 1.32 (no fp32-compute 8-bit MatMulNBits kernel, measured "
                      "~1.5 tok/s on SmolLM2): use accuracy_level=4 or lm_head='fp'",
                      stacklevel=2)
    check_out_dir(out_dir, _source_dirs(model, provenance), overwrite)
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        raise ExportError(f"a tokenizer is required, got {type(tokenizer).__name__} (the runtime "
                          "reads tokenizer.json from the export folder)",
                          "pass the model's Hugging Face tokenizer, e.g. "
                          "AutoTokenizer.from_pretrained(model_folder)")
    spec = DecoderSpec.from_model(model)
    if spec.exact_positions is not None:
        limit, why = spec.exact_positions
        if max_length is not None and max_length > limit:
            raise UnsupportedArchitectureError(
                f"max_length={max_length}: {why}, which the exported graph cannot follow",
                f"export with max_length <= {limit} (--max-length {limit})")
        if max_length is None and spec.max_position_embeddings > limit:
            import warnings
            warnings.warn(f"max_length set to {limit}, not the config's "
                          f"{min(spec.max_position_embeddings, 8192)}: {why}", stacklevel=2)
            max_length = limit
    if max_length is None:
        max_length = min(spec.max_position_embeddings, 8192)
    elif max_length > spec.max_position_embeddings:
        import warnings
        warnings.warn(f"max_length={max_length} exceeds the model's trained context "
                      f"(max_position_embeddings={spec.max_position_embeddings}): tokens past "
                      "it get untrained positions", stacklevel=2)
    opts = BuildOptions(precision=precision, graph=graph, lm_head=lm_head,
                        accuracy_level=accuracy_level, accuracy_levels=accuracy_levels,
                        max_length=int(max_length),
                        group_size=group_size, quantized=quantized, compact_24=compact_24)
    sparse_info = None
    if sparse_24:
        from .sparse24 import check_24
        sparse_info = check_24(model)
    builder_cls = BUILDERS[spec.architecture]
    if leank is not None:
        from .leank import DEFAULT_SINK, DEFAULT_WINDOW, check_mask, leank_builder
        # defaults: the regime the mask was trained for (in its meta), else the deployment one
        trained = (leank.get("meta") if isinstance(leank, dict) else getattr(leank, "meta", None)) or {}
        if leank_sink is None:
            leank_sink = int(trained.get("train_sink", DEFAULT_SINK))
        if leank_window is None:
            leank_window = int(trained.get("train_window", DEFAULT_WINDOW))
        leank = check_mask(leank, spec, leank_sink, leank_window)
        if leank_sink + leank_window >= int(max_length):
            raise ExportError(f"LeanK sink + window = {leank_sink} + {leank_window} tokens cover "
                              f"the whole context (max_length={max_length}): no key would be pruned",
                              f"use --leank-sink / --leank-window summing to less than {max_length}, "
                              "or a larger --max-length")
        builder_cls = leank_builder(builder_cls)
    builder = builder_cls(model, spec, opts)
    if leank is not None:
        builder.leank_mask, builder.leank_sink, builder.leank_window = \
            leank, int(leank_sink), int(leank_window)
    if compact_24:
        from .sparse24 import enable_compact
        enable_compact(builder)
    proto = builder.build()
    # the graph's own record of what its shapes allow (the rotary tables hold max_length
    # positions): the runtime refuses an edgeprune.json that promises more
    onnx.helper.set_model_props(proto, {GRAPH_MAX_LENGTH_KEY: str(int(max_length))})
    t_build = time.perf_counter()
    for k in accuracy_levels:           # a typo would otherwise change nothing, silently
        if not any(name_ends_with(n, k) for n in builder.accuracy_names):
            if not builder.accuracy_names:
                raise ExportError(f"accuracy level override {k!r}: this export has no MatMulNBits "
                                  f"node (precision {precision}, graph {graph})",
                                  "drop --accuracy-level-for, or export int4 with --graph fused")
            shown = sorted({n.rsplit(".", 1)[-1] for n in builder.accuracy_names})
            raise ExportError(f"accuracy level override {k!r} matches no MatMulNBits node of "
                              f"this export (nodes are named like {sorted(builder.accuracy_names)[0]})",
                              "use a node-name suffix such as " + ", ".join(shown[:6]))
    weight_bytes = builder.g.weight_bytes()
    check_disk(out_dir.parent, weight_bytes)
    # external data: when asked, above 2 GB, or (auto) for int4 exports: onnxruntime
    # memory-maps page-aligned external initializers, which lowers the peak RSS at load
    if external_data is None:
        external_data = precision == "int4"
    external = external_data or weight_bytes > EXTERNAL_DATA_THRESHOLD

    ints = {k: v for k, v in builder.quant_summary.items()
            if v.startswith("int") and k != "lm_head"}
    bits = sorted({int(v.split()[0][3:]) for v in ints.values()})
    metadata = {
        "format_version": FORMAT_VERSION,
        "architecture": spec.architecture,
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size, "max_length": int(max_length),
        "max_position_embeddings": spec.max_position_embeddings,
        "rope": {"theta": spec.rope_theta, "scaling": spec.rope_scaling,
                 "attention_scaling": spec.attention_scaling},
        "rms_norm_eps": spec.rms_norm_eps, "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": getattr(model.config, "bos_token_id", None),
        "eos_token_id": getattr(model.config, "eos_token_id", None),
        "pad_token_id": getattr(model.config, "pad_token_id", None),
        "precision": precision, "graph": graph,
        "quantization": None if not ints else {
            "bits": bits[0] if len(bits) == 1 else bits,
            "group_size": group_size if not quantized else
            sorted({int(getattr(q, "group_size", 0)) for q in quantized.values()}),
            "sym": sorted({bool(getattr(q, "sym", False)) for q in quantized.values()})
            if quantized else False,
            "source": "checkpoint codes" if quantized else f"rtn asym g{group_size}",
            # the quantizer's own widths: 2/3-bit codes ride exactly in 4-bit MatMulNBits
            "code_bits": sorted({int(getattr(q, "bits", 4)) for q in quantized.values()})
            if quantized else [4],
            "accuracy_level": accuracy_level, "accuracy_levels": accuracy_levels or None,
            "lm_head": builder.quant_summary.get("lm_head"),
            "layers": len(ints),
        },
        "lm_head": lm_head,
        # plain graphs' DequantizeLinear + MatMul pairs become MatMulNBits inside
        # onnxruntime at the session's level (its default is 4: int8 activations); the
        # runtime sets this one (a quantized head on float layers recorded none before)
        "qdq_accuracy_level": accuracy_level if any(n.op_type == "DequantizeLinear"
                                                    for n in proto.graph.node) else None,
        "weights": "dequantized from the checkpoint's int codes" if dequantized else None,
        "sparsity": sparse_info or (sparsity if sparsity else None),
        "sparse_24_speedup_claimed": False,
        "compact_24": bool(compact_24),
        "kv_layout": {"format": "BNSH",
                      "buffer": "shared past/present [batch, kv_heads, max_length, head_dim]"
                      if graph == "fused" else "concat: present = past ++ new",
                      "dtype": "float16" if precision == "fp16" else "float32",
                      **builder.io_metadata()},
        "leank": None,
        "countdown": None,
        "provenance": provenance or {},
    }
    if leank is not None:
        from .leank import leank_metadata
        metadata["leank"] = leank_metadata(leank, leank_sink, leank_window)
        metadata["kv_layout"]["buffer"] = ("leank: pruned middle (concat) + full sink/window "
                                           "caches; see leank.layout")
    genai = {"model": {"type": spec.architecture, "context_length": int(max_length),
                       "vocab_size": spec.vocab_size,
                       "bos_token_id": metadata["bos_token_id"],
                       "eos_token_id": metadata["eos_token_id"],
                       "pad_token_id": metadata["pad_token_id"],
                       "decoder": {"filename": "model.onnx", "head_size": spec.head_dim,
                                   "hidden_size": spec.hidden_size,
                                   "num_attention_heads": spec.num_heads,
                                   "num_key_value_heads": spec.num_kv_heads,
                                   "num_hidden_layers": spec.num_layers}},
             "search": {"do_sample": False, "max_length": int(max_length), "temperature": 1.0,
                        "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0,
                        "past_present_share_buffer": graph == "fused" and leank is None}}
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        for k in ("temperature", "top_k", "top_p", "repetition_penalty", "do_sample"):
            v = getattr(gen_cfg, k, None)
            if v is not None:
                genai["search"][k] = v

    parity = {}
    timings = {"build_s": round(t_build - t0, 3)}
    # fp16 values, or int8 activations in a MatMulNBits node (or in onnxruntime's fusion
    # of a plain graph's DequantizeLinear + MatMul): logits then differ by rounding noise
    approximate = precision == "fp16" or compact_24 or any(
        (n.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i >= 2 for a in n.attribute))
        for n in proto.graph.node) or (metadata["qdq_accuracy_level"] or 0) >= 2
    with atomic_folder(out_dir, overwrite=overwrite) as tmp:
        ts = time.perf_counter()
        mpath = tmp / "model.onnx"
        if external:
            placed = save_external(proto, mpath, "model.onnx.data")
            metadata["row_read_ranges"] = row_read_ranges(proto, placed)
            metadata["data_bytes"] = (tmp / "model.onnx.data").stat().st_size
        else:
            onnx.save_model(proto, str(mpath))
        del proto
        save_tokenizer(tokenizer, tmp)
        write_json(tmp / "genai_config.json", genai)
        write_json(tmp / "edgeprune.json", metadata)
        timings["save_s"] = round(time.perf_counter() - ts, 3)
        if validate:
            from .validate import check_graph, check_parity, parity as run_parity
            tv = time.perf_counter()
            parity.update(check_graph(mpath))
            ptok = min(parity_tokens, int(max_length))
            if leank is not None and leank_sink + leank_window > 0:
                # within sink + window nothing is pruned: the graph must equal the dense model
                # (the pruned path is tested against edgeprune.leank.apply_reference)
                ptok = min(ptok, leank_sink + leank_window)
            parity.update(run_parity(model, tmp, seqlen=ptok,
                                     int_weights=builder.int_weights,
                                     tokenizer=tokenizer))
            if getattr(builder, "logits_match_model", True):
                check_parity(parity, approximate)
            timings["validate_s"] = round(time.perf_counter() - tv, 3)
            metadata["validation"] = parity
            write_json(tmp / "edgeprune.json", metadata)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    timings["total_s"] = round(time.perf_counter() - t0, 3)
    return ExportResult(folder=out_dir, files=files, parity=parity, timings=timings,
                        metadata=metadata)


__all__ = ["export_onnx", "check_export_args", "ExportResult", "DecoderSpec", "BuildOptions", "BUILDERS"]
