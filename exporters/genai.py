"""What other runtimes need of an export: onnxruntime-genai's graph and
``genai_config.json``, and the Hugging Face ``config.json`` (Optimum's ``ORTModelForCausalLM``).

onnxruntime-genai (0.18) feeds a decoder what its ``genai_config.json`` maps:
``input_ids``, ``attention_mask int64 [B, total_sequence_length]`` (1 on every token in
the cache after this step), ``position_ids`` only when the graph has that input, the
caches ``past_key_values.%d.key`` / ``.value``, and reads ``logits [B, S, vocab]`` and
``present.%d.*``. It never feeds our runtime's ``seqlens_k``, ``total_sequence_length``
or ``num_logits_to_keep`` (an unfed input reaches the kernels as missing: ``Missing
Input: seqlens_k``), and onnxruntime's IOBinding refuses inputs that have a default
(overridable initializers), which our runtime's in-place decode loop binds: so one graph
cannot serve both feeds. :func:`genai_graph` writes a second graph, ``genai_model.onnx``,
that reads the same weights (the same ``model.onnx.data``, ~140 KB of nodes for
SmolLM2-135M) and computes what ours is fed, as onnxruntime-genai's own builder does
(``builders/base.py: make_attention_mask_reformatting_for_gqa``)::

    seqlens_k             = Cast<int32>(ReduceSum(attention_mask, axis 1) - 1)     [B]
    total_sequence_length = Cast<int32>(Shape(attention_mask)[1])                  []
    num_logits_to_keep    = 0   (every position: Hugging Face's logits_to_keep=0)

Plain graphs already take ``attention_mask`` and ``position_ids``: only
``num_logits_to_keep`` becomes the constant. Our ``model.onnx`` is unchanged.

Graphs onnxruntime-genai cannot run get neither file
(:attr:`~exporters.decoder.DecoderBuilder.genai_loadable`: LeanK's split caches, a
sliding-window ring).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: the second graph's file (beside ``model.onnx``, reading ``model.onnx.data``)
GENAI_GRAPH = "genai_model.onnx"
SEQLENS_K, TOTAL = "seqlens_k", "total_sequence_length"
KEEP, MASK = "num_logits_to_keep", "attention_mask"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name,
                            value=numpy_helper.from_array(np.asarray(value, np.int64)))


def _mask_nodes() -> list:
    """Nodes computing ``seqlens_k`` and ``total_sequence_length`` from ``attention_mask``."""
    n, p = helper.make_node, "genai/"
    return [
        _const(p + "axis1", [1]), _const(p + "one", 1),
        n("ReduceSum", [MASK, p + "axis1"], [p + "mask_sum"], name=p + "mask_sum", keepdims=0),
        n("Sub", [p + "mask_sum", p + "one"], [p + "mask_last"], name=p + "mask_last"),
        n("Cast", [p + "mask_last"], [SEQLENS_K], name=p + SEQLENS_K, to=TensorProto.INT32),
        n("Shape", [MASK], [p + "mask_width"], name=p + "mask_width", start=1, end=2),
        n("Squeeze", [p + "mask_width"], [p + "total"], name=p + "total"),
        n("Cast", [p + "total"], [TOTAL], name=p + TOTAL, to=TensorProto.INT32),
    ]


def genai_graph(proto: onnx.ModelProto, fused: bool) -> onnx.ModelProto:
    """The graph onnxruntime-genai runs: a copy of ``proto`` taking its feed (module
    docstring). Save ``proto`` with external data first, so the copy reads the same file.

    Args:
        proto: the built decoder (inputs ``input_ids``, ``num_logits_to_keep``, the caches
            and ``seqlens_k`` + ``total_sequence_length`` (fused) or ``attention_mask`` +
            ``position_ids`` (plain)); not changed.
        fused: a ``GroupQueryAttention`` graph (``seqlens_k`` inputs).

    Returns:
        The new ``onnx.ModelProto``: inputs ``input_ids``, ``attention_mask``
        (+ ``position_ids`` when plain), the caches; ``logits [B, S, vocab]``.
    """
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    g = out.graph
    drop = {KEEP} | ({SEQLENS_K, TOTAL} if fused else set())
    inputs = [i for i in g.input if i.name not in drop]
    if fused:
        at = [i.name for i in inputs].index("input_ids") + 1
        inputs.insert(at, helper.make_tensor_value_info(
            MASK, TensorProto.INT64, ["batch_size", "total_sequence_length"]))
    del g.input[:]
    g.input.extend(inputs)
    nodes = [_const(KEEP, 0)] + (_mask_nodes() if fused else []) + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    for o in g.output:
        if o.name == "logits":
            o.type.tensor_type.shape.dim[1].dim_param = "sequence_length"
    return out


def stop_token_ids(model, tokenizer, metadata: dict) -> list[int]:
    """The ids that end a generation, as our runtime stops (``runtime.session``): the
    config's ``eos_token_id``, the tokenizer's ``eos_token`` and the generation config's."""
    out: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for e in (metadata.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None),
              getattr(gen_cfg, "eos_token_id", None)):
        for i in ([e] if isinstance(e, int) else list(e or [])):
            if int(i) not in out:
                out.append(int(i))
    return out


def genai_config(model, builder, metadata: dict, tokenizer=None) -> dict:
    """``genai_config.json`` (onnxruntime-genai's schema) of :func:`genai_graph`: the
    decoder's file, shapes, input/output names and the search defaults, the model's own
    generation config taking precedence.

    Args:
        model: the exported transformers model (its ``generation_config``).
        builder: the :class:`~exporters.decoder.DecoderBuilder` after ``build()``.
        metadata: the export's ``edgeprune.json`` content (token ids).
        tokenizer: the exported HF tokenizer (its ``eos_token`` also ends a generation).
    """
    spec, max_length = builder.spec, int(builder.opts.max_length)
    inputs = {"input_ids": "input_ids", "attention_mask": MASK,
              "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE}
    if not builder.fused:
        inputs["position_ids"] = "position_ids"
    eos = stop_token_ids(model, tokenizer, metadata)
    ids = {"bos_token_id": metadata["bos_token_id"], "eos_token_id": eos,
           # onnxruntime-genai refuses a null id: no pad token pads with the (first) eos
           "pad_token_id": metadata["pad_token_id"] if metadata["pad_token_id"] is not None
           else eos[0] if eos else None}
    if len(eos) < 2:
        ids["eos_token_id"] = eos[0] if eos else None
    genai = {"model": {"type": spec.architecture, "context_length": max_length,
                       "vocab_size": spec.vocab_size,
                       **{k: v for k, v in ids.items() if v is not None},
                       "decoder": {"session_options": {"log_id": "onnxruntime-genai",
                                                       "provider_options": []},
                                   "filename": GENAI_GRAPH, "head_size": spec.head_dim,
                                   "hidden_size": spec.hidden_size,
                                   "num_attention_heads": spec.num_heads,
                                   "num_key_value_heads": spec.num_kv_heads,
                                   "num_hidden_layers": spec.num_layers,
                                   "inputs": inputs,
                                   "outputs": {"logits": "logits",
                                               "present_key_names": PRESENT_KEY,
                                               "present_value_names": PRESENT_VALUE}}},
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


def hf_config(model) -> Optional[dict]:
    """``config.json``: the Hugging Face config of the exported model, as Optimum's
    ``ORTModelForCausalLM`` reads it (``use_cache`` on; no ``quantization_config``: the
    graph holds its weights as exported, whatever the checkpoint was). ``None`` when the
    model has no transformers config."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    out = cfg.to_dict()
    for k in ("quantization_config", "_name_or_path"):
        out.pop(k, None)
    out["use_cache"] = True
    return out


__all__ = ["genai_graph", "genai_config", "hf_config", "stop_token_ids", "GENAI_GRAPH"]
