"""What an export folder says about itself: ``edgeprune.json`` and ``genai_config.json``.

``edgeprune.json`` is the runtime's description of the graph (shapes, precision, KV
layout, quantization, the applied graph variants under ``"variants"``, provenance);
``genai_config.json`` follows onnxruntime-genai's schema so that tool can run the folder.
"""

from __future__ import annotations

from typing import Optional

FORMAT_VERSION = 1


def _quantization(builder, quantized: dict, group_size: int) -> Optional[dict]:
    """The ``quantization`` record: int linears (the head apart), their widths and source."""
    opts = builder.opts
    ints = {k: v for k, v in builder.quant_summary.items()
            if v.startswith("int") and k != "lm_head"}
    if not ints:
        return None
    bits = sorted({int(v.split()[0][3:]) for v in ints.values()})
    return {
        "bits": bits[0] if len(bits) == 1 else bits,
        "group_size": group_size if not quantized else
        sorted({int(getattr(q, "group_size", 0)) for q in quantized.values()}),
        "sym": sorted({bool(getattr(q, "sym", False)) for q in quantized.values()})
        if quantized else False,
        "source": "checkpoint codes" if quantized else f"rtn asym g{group_size}",
        # the quantizer's own widths: 2/3-bit codes ride exactly in 4-bit MatMulNBits
        "code_bits": sorted({int(getattr(q, "bits", 4)) for q in quantized.values()})
        if quantized else [4],
        "accuracy_level": opts.accuracy_level, "accuracy_levels": opts.accuracy_levels or None,
        "lm_head": builder.quant_summary.get("lm_head"),
        "layers": len(ints),
    }


def export_metadata(model, builder, proto, *, quantized: dict, group_size: int,
                    dequantized: bool, sparsity: Optional[dict], variants: dict,
                    provenance: Optional[dict]) -> dict:
    """The ``edgeprune.json`` content of an export (before validation adds its figures).

    Args:
        model: the exported transformers model (token ids of its config).
        builder: the :class:`~exporters.decoder.DecoderBuilder` after ``build()``.
        proto: the built ``onnx.ModelProto``.
        quantized: the int codes packed as they are (empty for float graphs).
        group_size: RTN group size of linears quantized at export.
        dequantized: a float graph of a quantized checkpoint's dequantized weights.
        sparsity: the caller's pruning record (a verified pattern takes precedence).
        variants: ``{name: record}`` of the applied graph variants.
        provenance: free-form dict.
    """
    spec, opts = builder.spec, builder.opts
    cfg = model.config
    return {
        "format_version": FORMAT_VERSION,
        "architecture": spec.architecture,
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size, "max_length": int(opts.max_length),
        "max_position_embeddings": spec.max_position_embeddings,
        "rope": {"theta": spec.rope_theta, "scaling": spec.rope_scaling,
                 "attention_scaling": spec.attention_scaling},
        "rms_norm_eps": spec.rms_norm_eps, "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": getattr(cfg, "bos_token_id", None),
        "eos_token_id": getattr(cfg, "eos_token_id", None),
        "pad_token_id": getattr(cfg, "pad_token_id", None),
        "precision": opts.precision, "graph": opts.graph,
        "quantization": _quantization(builder, quantized, group_size),
        "lm_head": opts.lm_head,
        "head": builder.head_record(),
        # plain graphs' DequantizeLinear + MatMul pairs become MatMulNBits inside
        # onnxruntime at the session's level (its default is 4: int8 activations); the
        # runtime sets this one (a quantized head on float layers recorded none before)
        "qdq_accuracy_level": opts.accuracy_level if any(n.op_type == "DequantizeLinear"
                                                         for n in proto.graph.node) else None,
        "weights": "dequantized from the checkpoint's int codes" if dequantized else None,
        "sparsity": builder.sparsity_info or (sparsity if sparsity else None),
        "sparse_24_speedup_claimed": False,
        "kv_layout": {"format": "BNSH",
                      "buffer": "shared past/present [batch, kv_heads, max_length, head_dim]"
                      if builder.fused else "concat: present = past ++ new",
                      "dtype": "float16" if opts.precision == "fp16" else "float32",
                      **builder.io_metadata()},
        "variants": variants,
        "provenance": provenance or {},
    }


def genai_config(model, builder, metadata: dict) -> dict:
    """``genai_config.json`` (onnxruntime-genai's schema): the decoder's shapes and the
    search defaults, the model's own generation config taking precedence."""
    spec, max_length = builder.spec, int(builder.opts.max_length)
    genai = {"model": {"type": spec.architecture, "context_length": max_length,
                       "vocab_size": spec.vocab_size,
                       "bos_token_id": metadata["bos_token_id"],
                       "eos_token_id": metadata["eos_token_id"],
                       "pad_token_id": metadata["pad_token_id"],
                       "decoder": {"filename": "model.onnx", "head_size": spec.head_dim,
                                   "hidden_size": spec.hidden_size,
                                   "num_attention_heads": spec.num_heads,
                                   "num_key_value_heads": spec.num_kv_heads,
                                   "num_hidden_layers": spec.num_layers}},
             "search": {"do_sample": False, "max_length": max_length, "temperature": 1.0,
                        "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0,
                        "past_present_share_buffer": builder.shares_kv_buffer}}
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        for k in ("temperature", "top_k", "top_p", "repetition_penalty", "do_sample"):
            v = getattr(gen_cfg, k, None)
            if v is not None:
                genai["search"][k] = v
    return genai


__all__ = ["export_metadata", "genai_config", "FORMAT_VERSION"]
