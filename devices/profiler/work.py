"""Static work per token of an exported graph: bytes read and operations, from its initializers.

Reads ``model.onnx`` with ``onnx`` (imported on use) without its external data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import numpy as np

from edgeprune_runtime.errors import RuntimeLoadError


def model_work(folder: Union[str, Path]) -> dict[str, Any]:
    """Bytes read and operations per token of an exported graph, from its initializers.

    Each weight initializer is attributed to the operator that consumes it:
    ``MatMulNBits`` (packed int4/int8 codes + scales + zeros; ``2*K*N`` ops),
    ``MatMul``/``Gemm`` with a constant ``[K, N]`` weight (``2*K*N`` ops),
    ``Gather`` (embedding table: one row read per token, no ops), everything else
    (norms, rotary caches, biases) read in full. Attention adds, per token and per
    cached position, ``4 * num_heads * head_dim`` ops per layer (QK^T and AV).

    Returns:
        ``{"weight_bytes_per_token", "weight_ops_per_token", "embedding_bytes",
        "file_bytes", "attn_ops_per_position", "compute", "graph_nodes"}``; ``compute``
        is ``"int8"`` when the linears run MatMulNBits at accuracy level 4 (int8
        activations), else ``"fp32"``; ``graph_nodes``: operators one run executes.
        ``If`` subgraphs count: their weights by the branch that reads more bytes (an
        upper bound), their operators by the longer branch.

    Raises:
        RuntimeLoadError: no readable ``model.onnx``.
    """
    import onnx

    folder = Path(folder)
    path = folder / "model.onnx"
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001
        raise RuntimeLoadError(f"cannot read {path}: {e}", "pass an export folder written by `edgeprune export`") from e
    g = m.graph
    sizes, shapes = _initializer_sizes(g)
    nodes = _executed_nodes(g, sizes, shapes)
    t = _tally(nodes, sizes, shapes)
    weight_bytes, ops, embed, int8 = t["weight_bytes"], t["ops"], t["embed"], t["int8"]
    meta = {}
    try:
        meta = json.loads((folder / "edgeprune.json").read_text())
    except (OSError, ValueError):
        pass
    heads = int(meta.get("num_heads") or 0)
    hd = int(meta.get("head_dim") or 0)
    layers = int(meta.get("num_layers") or 0)
    file_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx") and p.is_file())
    quant = meta.get("quantization") or {}
    if quant.get("accuracy_level") == 4:
        int8 = True
    return {"weight_bytes_per_token": int(weight_bytes), "weight_ops_per_token": int(ops),
            "embedding_bytes": int(embed), "file_bytes": int(file_bytes),
            "attn_ops_per_position": int(4 * heads * hd * layers),
            "compute": "int8" if int8 else "fp32", "graph_nodes": _node_count(g)}


def _node_count(g) -> int:
    """Operators one run of ``g`` executes, taking each ``If``'s longer branch (a
    COUNTDOWN decode step runs its filtered branch, the longer one)."""
    n = 0
    for node in g.node:
        subs = [_node_count(a.g) for a in node.attribute if a.type == a.GRAPH]
        n += 1 + ((max(subs) if node.op_type == "If" else sum(subs)) if subs else 0)
    return n


def _initializer_sizes(g) -> tuple[dict, dict]:
    """Bytes and dims of every initializer of ``g`` and of its subgraphs, by name."""
    sizes: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    stack = [g]
    while stack:
        graph = stack.pop()
        stack.extend(a.g for n in graph.node for a in n.attribute if a.type == a.GRAPH)
        for t in graph.initializer:
            n = int(np.prod(t.dims)) if len(t.dims) else 1
            item = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2, 12: 4, 13: 8, 21: 1, 22: 1}.get(t.data_type, 4)
            if t.data_type in (21, 22):  # uint4 / int4: two per byte
                sizes[t.name] = (n + 1) // 2
            else:
                sizes[t.name] = n * item
            shapes[t.name] = list(t.dims)
    return sizes, shapes


def _tally(nodes: list, sizes: dict, shapes: dict) -> dict:
    """Weight bytes read and weight ops of one decode step running ``nodes`` (see
    :func:`model_work`): ``{"weight_bytes", "ops", "embed", "int8"}``."""
    import onnx

    consumers: dict[str, list] = {}
    for node in nodes:
        for i, name in enumerate(node.input):
            if name in sizes:
                consumers.setdefault(name, []).append((node, i))
    # Constant-folded graphs may wrap weights in DequantizeLinear / Transpose; follow one hop.
    produced_by_const_op = {}
    for node in nodes:
        if node.op_type in ("DequantizeLinear", "Transpose", "Cast", "Reshape") and node.input and node.input[0] in sizes:
            produced_by_const_op[node.output[0]] = node.input[0]
    weight_bytes = 0
    ops = 0
    embed = 0
    int8 = False
    seen_nbits = set()
    for node in nodes:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            K, N = int(attrs.get("K", 0)), int(attrs.get("N", 0))
            ops += 2 * K * N
            if int(attrs.get("accuracy_level", 0)) == 4:
                int8 = True
            for name in node.input[1:]:
                if name in sizes and name not in seen_nbits:
                    seen_nbits.add(name)
                    weight_bytes += sizes[name]
        elif node.op_type in ("MatMul", "Gemm", "MatMulInteger"):
            for name in node.input[:2]:
                src = produced_by_const_op.get(name, name)
                if src in sizes and len(shapes.get(src, [])) == 2:
                    K, N = shapes[src]
                    if node.op_type == "Gemm":
                        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                        if attrs.get("transB", 0):
                            K, N = N, K
                    ops += 2 * K * N
    counted = set(seen_nbits)
    for name, users in consumers.items():
        if name in counted:
            continue
        kinds = {n.op_type for n, _ in users}
        if kinds <= {"Gather", "GatherBlockQuantized"} and len(shapes.get(name, [])) >= 2:
            rows = shapes[name][0] or 1
            row_bytes = sizes[name] // rows
            embed += sizes[name]
            weight_bytes += row_bytes
        else:
            weight_bytes += sizes[name]
        counted.add(name)
    for name in produced_by_const_op.values():
        if name not in counted:
            weight_bytes += sizes[name]
            counted.add(name)
    return {"weight_bytes": weight_bytes, "ops": ops, "embed": embed, "int8": int8}


def _executed_nodes(g, sizes: dict, shapes: dict) -> list:
    """The nodes a run of graph ``g`` executes: its own, and for each ``If`` the nodes of
    the branch that reads more weight bytes (a COUNTDOWN graph's dense MLP rather than its
    filtered decode branch: an upper bound; what the filter saves is
    ``runtime.countdown``'s to report); ``Loop`` / ``Scan`` bodies once."""
    nodes = []
    for node in g.node:
        nodes.append(node)
        walked = [_executed_nodes(a.g, sizes, shapes) for a in node.attribute if a.type == a.GRAPH]
        if node.op_type == "If" and walked:
            walked = [max(walked, key=lambda w: _tally(w, sizes, shapes)["weight_bytes"])]
        for sub in walked:
            nodes.extend(sub)
    return nodes


__all__ = ["model_work"]
