"""KV caches for exported decoders, sized from the graph's own input shapes.

Two layouts (``edgeprune.json`` ``kv_layout``):

* :class:`SharedKVCache` (fused graphs): one preallocated buffer
  ``[batch, kv_heads, max_length, key_head_dim]`` per layer for keys (and
  ``head_dim`` for values), bound with IOBinding as both ``past_key_values.*`` input
  and ``present.*`` output of ``GroupQueryAttention``: decode steps write the new
  token's K/V in place; nothing is reallocated or copied.
* :class:`ConcatKVCache` (plain graphs): ``present = concat(past, new)``; the present
  OrtValues of one step are bound as the next step's past (no copy through numpy;
  ONNX Runtime allocates the longer tensors each step).

Shapes come from the graph inputs: a LeanK graph whose key caches keep fewer channels
gets smaller key buffers automatically.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ORT2NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@dataclass
class KVSpec:
    """Per-layer cache geometry read from the session's inputs.

    Attributes:
        num_layers: number of layers with a cache.
        kv_heads: ``[layers]`` KV heads per layer (keys and values).
        key_dims: ``[layers]`` channels per key head.
        value_dims: ``[layers]`` channels per value head.
        dtype: numpy dtype of the cache.
    """

    num_layers: int
    kv_heads: list
    key_dims: list
    value_dims: list
    dtype: type

    @classmethod
    def from_session(cls, sess: ort.InferenceSession) -> "KVSpec":
        found: dict[tuple[int, str], tuple] = {}
        dtype = np.float32
        for inp in sess.get_inputs():
            m = _PAST.match(inp.name)
            if m:
                found[(int(m.group(1)), m.group(2))] = tuple(inp.shape)
                dtype = _ORT2NP.get(inp.type, np.float32)
        n = 1 + max((k[0] for k in found), default=-1)
        heads, kd, vd = [], [], []
        for i in range(n):
            ks, vs = found[(i, "key")], found[(i, "value")]
            heads.append(int(ks[1]))
            kd.append(int(ks[3]))
            vd.append(int(vs[3]))
        return cls(n, heads, kd, vd, dtype)

    def bytes(self, length: int, batch: int = 1) -> dict:
        """``{"k": bytes, "v": bytes}`` of a cache holding ``length`` tokens per row."""
        item = np.dtype(self.dtype).itemsize
        k = sum(h * d for h, d in zip(self.kv_heads, self.key_dims)) * length * batch * item
        v = sum(h * d for h, d in zip(self.kv_heads, self.value_dims)) * length * batch * item
        return {"k": int(k), "v": int(v)}


class SharedKVCache:
    """Preallocated ``[batch, kv_heads, max_length, dim]`` buffers (fused graphs).

    Args:
        spec: :class:`KVSpec`.
        batch: rows.
        max_length: tokens per row.
        device: ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, spec: KVSpec, batch: int, max_length: int, device: str = "cpu"):
        self.spec, self.batch, self.max_length, self.device = spec, batch, max_length, device
        self.arrays: list[np.ndarray] = []
        self.values: list[tuple[ort.OrtValue, ort.OrtValue]] = []
        for i in range(spec.num_layers):
            pair = []
            for dim in (spec.key_dims[i], spec.value_dims[i]):
                shape = (batch, spec.kv_heads[i], max_length, dim)
                if device == "cpu":
                    arr = np.zeros(shape, dtype=spec.dtype)
                    self.arrays.append(arr)
                    pair.append(ort.OrtValue.ortvalue_from_numpy(arr))
                else:
                    pair.append(ort.OrtValue.ortvalue_from_shape_and_type(shape, spec.dtype,
                                                                          device, 0))
            self.values.append(tuple(pair))

    @property
    def nbytes(self) -> int:
        return sum(self.spec.bytes(self.max_length, self.batch).values())

    def row(self, b: int) -> "SharedKVCache":
        """Row ``b`` of these buffers as a batch-1 cache over the same memory (CPU only:
        a row of a C-ordered ``[batch, ...]`` array is contiguous), for prefilling the
        rows of a batch one at a time."""
        if self.device != "cpu":
            raise ValueError("row views need CPU buffers")
        view = SharedKVCache.__new__(SharedKVCache)
        view.spec, view.batch, view.max_length, view.device = self.spec, 1, self.max_length, "cpu"
        view.arrays = [a[b:b + 1] for a in self.arrays]
        view.values = [tuple(ort.OrtValue.ortvalue_from_numpy(a) for a in view.arrays[2 * i:2 * i + 2])
                       for i in range(self.spec.num_layers)]
        return view

    def bind(self, binding: ort.IOBinding) -> None:
        """Bind every layer's buffer as both past input and present output."""
        for i, (k, v) in enumerate(self.values):
            binding.bind_ortvalue_input(f"past_key_values.{i}.key", k)
            binding.bind_ortvalue_input(f"past_key_values.{i}.value", v)
            binding.bind_ortvalue_output(f"present.{i}.key", k)
            binding.bind_ortvalue_output(f"present.{i}.value", v)


class ConcatKVCache:
    """Growing cache of plain graphs: the step's present tensors become the next past."""

    def __init__(self, spec: KVSpec, batch: int, device: str = "cpu"):
        self.spec, self.batch, self.device = spec, batch, device
        self.values = []
        for i in range(spec.num_layers):
            self.values.append(tuple(
                ort.OrtValue.ortvalue_from_numpy(
                    np.zeros((batch, spec.kv_heads[i], 0, d), spec.dtype), device, 0)
                for d in (spec.key_dims[i], spec.value_dims[i])))

    def bind(self, binding: ort.IOBinding) -> None:
        for i, (k, v) in enumerate(self.values):
            binding.bind_ortvalue_input(f"past_key_values.{i}.key", k)
            binding.bind_ortvalue_input(f"past_key_values.{i}.value", v)
            binding.bind_output(f"present.{i}.key", self.device)
            binding.bind_output(f"present.{i}.value", self.device)

    def update(self, outputs: list) -> None:
        """Take the present OrtValues of a finished run as the new past: ``outputs`` are
        the binding's outputs in the order :meth:`bind` bound them (onnxruntime returns
        bound outputs in binding order, not in the graph's output order)."""
        if len(outputs) != 2 * self.spec.num_layers:
            raise ValueError(f"expected {2 * self.spec.num_layers} present tensors, got {len(outputs)}")
        self.values = [(outputs[2 * i], outputs[2 * i + 1]) for i in range(self.spec.num_layers)]


__all__ = ["KVSpec", "SharedKVCache", "ConcatKVCache"]
