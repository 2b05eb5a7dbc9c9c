"""KV caches for exported decoders, sized from the graph's own input shapes.

Two layouts (``edgeprune.json`` ``kv_layout``):

* :class:`SharedKVCache` (fused graphs): one preallocated buffer
  ``[batch, kv_heads, max_length, key_head_dim]`` per layer for keys (and
  ``head_dim`` for values), bound with IOBinding as both ``past_key_values.*`` input
  and ``present.*`` output of ``GroupQueryAttention``: decode steps write the new
  token's K/V in place; nothing is reallocated or copied.
* :class:`ConcatKVCache` (plain graphs): ``present = concat(past, new)``; the present
  OrtValues of one step are bound as the next step's past (no copy through numpy;
  ONNX Runtime allocates the longer tensors each step). A plain graph's ring layers
  (``kv_layout.sliding_window.cache == "ring"``) return only their last ``window``
  positions as ``present``, so the same class holds them.
* :class:`RingKVCache` (fused graphs with ring layers, ``exporters.attention``): the
  sliding-window layers keep a ring ``[batch, kv_heads, window, dim]`` whose slot
  ``p mod window`` holds position ``p``; the graph returns the pass's new rows
  ``[batch, kv_heads, S, dim]`` and :meth:`RingKVCache.commit` writes the rows the
  caller keeps into their slots. The other layers use shared buffers as above.

Shapes come from the graph inputs: a LeanK graph whose key caches keep fewer channels
gets smaller key buffers automatically, a fused ring layer's static window is read from
its past input's length axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnxruntime as ort

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ORT2NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}


@dataclass
class KVSpec:
    """Per-layer cache geometry read from the session's inputs.

    Attributes:
        num_layers: number of layers with a cache.
        kv_heads: ``[layers]`` KV heads per layer (keys and values).
        key_dims: ``[layers]`` channels per key head.
        value_dims: ``[layers]`` channels per value head.
        dtype: numpy dtype of the cache.
        windows: ``[layers]`` positions a layer keeps at most (a sliding-window layer with
            a ring or windowed cache), ``None`` for the layers that keep every position;
            ``None`` altogether when no layer is windowed.
    """

    num_layers: int
    kv_heads: list
    key_dims: list
    value_dims: list
    dtype: type
    windows: Optional[list] = None

    @classmethod
    def from_session(cls, sess: ort.InferenceSession, windows: Optional[dict] = None) -> "KVSpec":
        """Read the geometry from the session's ``past_key_values.*`` inputs.

        Args:
            windows: ``{layer: window}`` of layers whose cache keeps only a window
                (``edgeprune.json`` ``kv_layout.sliding_window``: its ``layers`` and
                ``window`` when its ``cache`` is ``"ring"``); a static length axis (a
                fused graph's ring) is read as one too.
        """
        found: dict[tuple[int, str], tuple] = {}
        dtype = np.float32
        for inp in sess.get_inputs():
            m = _PAST.match(inp.name)
            if m:
                found[(int(m.group(1)), m.group(2))] = tuple(inp.shape)
                dtype = _ORT2NP.get(inp.type, np.float32)
        n = 1 + max((k[0] for k in found), default=-1)
        heads, kd, vd, win = [], [], [], []
        for i in range(n):
            ks, vs = found[(i, "key")], found[(i, "value")]
            heads.append(int(ks[1]))
            kd.append(int(ks[3]))
            vd.append(int(vs[3]))
            w = (windows or {}).get(i)
            win.append(int(w) if w else int(ks[2]) if isinstance(ks[2], int) else None)
        return cls(n, heads, kd, vd, dtype, win if any(w for w in win) else None)

    def layer_length(self, i: int, length: int) -> int:
        """Positions layer ``i`` holds when a row has ``length`` tokens."""
        w = self.windows[i] if self.windows else None
        return min(length, w) if w else length

    def bytes(self, length: int, batch: int = 1) -> dict:
        """``{"k": bytes, "v": bytes}`` of a cache holding ``length`` tokens per row
        (a windowed layer: at most its window)."""
        item = np.dtype(self.dtype).itemsize
        lens = [self.layer_length(i, length) for i in range(self.num_layers)]
        k = sum(h * d * n for h, d, n in zip(self.kv_heads, self.key_dims, lens)) * batch * item
        v = sum(h * d * n for h, d, n in zip(self.kv_heads, self.value_dims, lens)) * batch * item
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


class RingKVCache:
    """KV cache of a fused graph whose sliding-window layers keep a ring (CPU).

    Global layers: one ``[batch, kv_heads, max_length, dim]`` buffer per tensor, bound as
    both past and present (as :class:`SharedKVCache`). Ring layer ``i`` (``spec.windows[i]
    = W``): ``ring[i]`` ``[batch, kv_heads, W, dim]`` bound as ``past_key_values.i.*``; the
    graph's ``present.i.*`` are the pass's new rows ``[batch, kv_heads, S, dim]`` (keys
    after rotary), bound to buffers of this class. After each pass the caller says which
    rows it keeps (:meth:`commit`): row ``s`` of row ``b`` is position ``past[b] + s`` and
    goes to slot ``(past[b] + s) mod W``; only the last ``W`` kept rows matter.

    The graph reads the positions from ``seqlens_k`` / ``total_sequence_length``, as for
    ``GroupQueryAttention``: a first prompt (``total_sequence_length == S``) right-padded
    with ``seqlens_k[b] = len[b] - 1``; later passes ``seqlens_k[b] = past[b] + S - 1``.
    So the caller commits, after a pass: a first prompt ``(past=0, kept=len[b])``; a decode
    step ``(past=len_before[b], kept=1)``; a prompt-lookup pass of ``1 + k`` tokens only
    the fed token and the accepted drafts (a rejected draft's row is never written, so it
    cannot overwrite a position still in the window).

    Args:
        spec: :class:`KVSpec` with ``windows`` (``KVSpec.from_session`` reads them).
        batch: rows.
        max_length: tokens per row of the global layers.
    """

    def __init__(self, spec: KVSpec, batch: int, max_length: int):
        if not spec.windows:
            raise ValueError("RingKVCache needs a graph with ring layers (KVSpec.windows)")
        self.spec, self.batch, self.max_length = spec, batch, max_length
        self.arrays: dict[tuple[int, int], np.ndarray] = {}     # (layer, 0 key / 1 value)
        for i in range(spec.num_layers):
            n = spec.windows[i] or max_length
            for t, dim in enumerate((spec.key_dims[i], spec.value_dims[i])):
                self.arrays[(i, t)] = np.zeros((batch, spec.kv_heads[i], n, dim), spec.dtype)
        self.values = {k: ort.OrtValue.ortvalue_from_numpy(a) for k, a in self.arrays.items()}
        self.new_rows: dict[tuple[int, int], np.ndarray] = {}

    @property
    def ring_layers(self) -> list:
        return [i for i, w in enumerate(self.spec.windows) if w]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def bind(self, binding: ort.IOBinding, steps: int) -> None:
        """Bind the buffers for a pass of ``steps`` new positions per row: global layers
        as past and present, ring layers' rings as past and fresh ``[batch, kv_heads,
        steps, dim]`` buffers as present (kept for :meth:`commit`)."""
        self.new_rows = {}
        for (i, t), val in self.values.items():
            which = ("key", "value")[t]
            binding.bind_ortvalue_input(f"past_key_values.{i}.{which}", val)
            if not self.spec.windows[i]:
                binding.bind_ortvalue_output(f"present.{i}.{which}", val)
                continue
            a = self.arrays[(i, t)]
            rows = np.zeros((self.batch, a.shape[1], int(steps), a.shape[3]), a.dtype)
            self.new_rows[(i, t)] = rows
            binding.bind_ortvalue_output(f"present.{i}.{which}", ort.OrtValue.ortvalue_from_numpy(rows))

    def commit(self, past, kept) -> None:
        """Write the kept new rows of the last pass into the rings.

        Args:
            past: int ``[batch]``: positions each row had cached before the pass.
            kept: int ``[batch]``: new rows each row keeps (its first ``kept[b]`` rows:
                the real tokens of a right-padded prompt, 1 for a decode step, the fed
                token plus the accepted drafts of a prompt-lookup pass).
        """
        for (i, t), rows in self.new_rows.items():
            ring, W = self.arrays[(i, t)], self.spec.windows[i]
            for b in range(self.batch):
                n = int(kept[b])
                s = np.arange(max(0, n - W), n)
                ring[b][:, (int(past[b]) + s) % W, :] = rows[b][:, s, :]

    def row(self, b: int) -> "RingKVCache":
        """Row ``b`` as a batch-1 cache over the same memory (rows prefilled one by one)."""
        view = RingKVCache.__new__(RingKVCache)
        view.spec, view.batch, view.max_length = self.spec, 1, self.max_length
        view.arrays = {k: a[b:b + 1] for k, a in self.arrays.items()}
        view.values = {k: ort.OrtValue.ortvalue_from_numpy(a) for k, a in view.arrays.items()}
        view.new_rows = {}
        return view


__all__ = ["KVSpec", "SharedKVCache", "ConcatKVCache", "RingKVCache"]
