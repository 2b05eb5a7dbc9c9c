"""Builder primitives for ONNX graphs written node by node with ``onnx.helper``.

:class:`GraphBuilder` keeps the node list, initializers, graph inputs/outputs and a
name counter, and offers one method per operator family used by the decoder builder
(``matmul``, ``add``, ``reshape``...). Nothing here knows about transformers: the
decoder builder (``exporters.decoder``) turns a model into calls on this class.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21          # standard ONNX opset (blocked int4 DequantizeLinear exists since 21)
MS_DOMAIN = "com.microsoft"

_NP2ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def onnx_dtype(dtype) -> int:
    """The ``TensorProto`` element type of a numpy dtype."""
    return _NP2ONNX[np.dtype(dtype)]


class GraphBuilder:
    """Accumulates an ONNX graph.

    Args:
        name: graph name.
        float_dtype: ``np.float32`` or ``np.float16``: the activation dtype, used for
            constants created by :meth:`const`.
    """

    def __init__(self, name: str = "decoder", float_dtype=np.float32):
        self.name = name
        self.float_dtype = np.dtype(float_dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self._counter = 0
        self.uses_ms_domain = False

    # ----------------------------------------------------------------- naming
    def unique(self, base: str) -> str:
        """A tensor/node name not used yet, derived from ``base``."""
        name = base
        while name in self._names:
            self._counter += 1
            name = f"{base}_{self._counter}"
        self._names.add(name)
        return name

    # ------------------------------------------------------------ graph i/o
    def input(self, name: str, elem_type: int, shape: Sequence) -> str:
        """Declare a graph input; ``shape`` entries are ints or symbolic strings."""
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence) -> str:
        """Declare a graph output (the tensor ``name`` must be produced by a node)."""
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def initializer(self, name: str, array: np.ndarray) -> str:
        """Add a weight; returns its (unique) name."""
        name = self.unique(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def initializer_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of the initializer ``name``, or ``None`` when ``name`` is not one
        (a node's output, a graph input)."""
        for t in reversed(self.initializers):
            if t.name == name:
                return tuple(int(d) for d in t.dims)
        return None

    def scales(self, name: str, array: np.ndarray, dtype) -> str:
        """A quantized weight's scales as a tensor of the graph's float ``dtype``.

        Stored in float16 behind a ``Cast`` when ``dtype`` is float32 and every value is a
        float16 value (the quantizers round their scales so: ``edgeprune.quantize.round_scale``):
        lossless, 16 instead of 32 scale bits per group in the file (a 64-wide group: 4.31
        instead of 4.56 bits per int4 weight), and onnxruntime folds the ``Cast`` into a
        float32 initializer when it builds the session, so the compute is unchanged.
        Otherwise stored as ``dtype``. Returns the name to wire into the consumer.
        """
        from .int4 import fp16_exact

        arr = np.ascontiguousarray(array, np.float32)
        if np.dtype(dtype) == np.float32 and fp16_exact(arr):
            h = self.initializer(name + "_fp16", arr.astype(np.float16))
            return self.node("Cast", [h], name=name + "/to_float", to=TensorProto.FLOAT)
        return self.initializer(name, arr.astype(dtype))

    def const(self, values, dtype=np.int64, name: str = "const") -> str:
        """A small constant initializer, de-duplicated by value."""
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer(f"{name}_{arr.dtype.name}", arr)
        return self._consts[key]

    # ----------------------------------------------------------------- nodes
    def node(self, op: str, inputs: Iterable[str], n_out: int = 1, name: str | None = None,
             domain: str = "", outputs: Sequence[str] | None = None, **attrs):
        """Append one node. Returns its output name (or a list when ``n_out > 1``)."""
        base = name or op.lower()
        if outputs is None:
            outputs = [self.unique(f"{base}/out{i}" if n_out > 1 else f"{base}/out")
                       for i in range(n_out)]
        else:
            for o in outputs:
                if o:
                    self._names.add(o)
        if domain == MS_DOMAIN:
            self.uses_ms_domain = True
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs),
                                           name=self.unique(f"{base}/{op}"), domain=domain,
                                           **attrs))
        return list(outputs) if n_out > 1 else outputs[0]

    # Convenience wrappers (standard ONNX ops).
    def matmul(self, a, b, name=None):
        return self.node("MatMul", [a, b], name=name)

    def add(self, a, b, name=None):
        return self.node("Add", [a, b], name=name)

    def sub(self, a, b, name=None):
        return self.node("Sub", [a, b], name=name)

    def mul(self, a, b, name=None):
        return self.node("Mul", [a, b], name=name)

    def div(self, a, b, name=None):
        return self.node("Div", [a, b], name=name)

    def cast(self, x, to: int, name=None):
        return self.node("Cast", [x], name=name, to=to)

    def reshape(self, x, shape: Sequence[int] | str, name=None):
        s = shape if isinstance(shape, str) else self.const(list(shape))
        return self.node("Reshape", [x, s], name=name)

    def transpose(self, x, perm: Sequence[int], name=None):
        return self.node("Transpose", [x], name=name, perm=list(perm))

    def unsqueeze(self, x, axes: Sequence[int], name=None):
        return self.node("Unsqueeze", [x, self.const(list(axes))], name=name)

    def squeeze(self, x, axes: Sequence[int], name=None):
        return self.node("Squeeze", [x, self.const(list(axes))], name=name)

    def gather(self, data, idx, axis=0, name=None):
        return self.node("Gather", [data, idx], name=name, axis=axis)

    def slice(self, x, starts, ends, axes, name=None):
        """``Slice``; each of starts/ends may be a list of ints or a tensor name."""
        s = starts if isinstance(starts, str) else self.const(list(starts))
        e = ends if isinstance(ends, str) else self.const(list(ends))
        return self.node("Slice", [x, s, e, self.const(list(axes))], name=name)

    def concat(self, xs, axis, name=None):
        return self.node("Concat", list(xs), name=name, axis=axis)

    def shape(self, x, start=None, end=None, name=None):
        return self.node("Shape", [x], name=name, start=start, end=end)

    def split(self, x, sizes: Sequence[int], axis=-1, name=None):
        return self.node("Split", [x, self.const(list(sizes))], n_out=len(sizes), name=name,
                         axis=axis)

    # ----------------------------------------------------------------- model
    def model(self, producer: str = "edgeprune.exporters") -> onnx.ModelProto:
        """The finished ``ModelProto`` (opset 21 + ``com.microsoft`` when used)."""
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                  self.initializers)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.uses_ms_domain:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        m = helper.make_model(graph, opset_imports=opsets, producer_name=producer)
        m.ir_version = 10
        return m

    def weight_bytes(self) -> int:
        """Total bytes of all initializers."""
        return sum(len(t.raw_data) if t.HasField("raw_data") else
                   numpy_helper.to_array(t).nbytes for t in self.initializers)


__all__ = ["GraphBuilder", "OPSET", "MS_DOMAIN", "onnx_dtype"]
