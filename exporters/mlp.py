"""The gated MLP of the decoder graph: ``down(act(gate(h)) * up(h))``.

:class:`MlpMixin` is the part of :class:`~exporters.decoder.DecoderBuilder` that builds
each layer's MLP with gate and up fused into one projection; the gate's activation is
the hook :meth:`MlpMixin.mlp_activation` (SiLU: SwiGLU, Shazeer 2020, in llama/qwen2;
a family overrides it, e.g. Gemma's GELU-tanh GeGLU).
"""

from __future__ import annotations


class MlpMixin:
    """MLP of :class:`~exporters.decoder.DecoderBuilder` (reads ``self.g``, ``self.spec``)."""

    def mlp_activation(self, gate: str, name: str) -> str:
        """The gate's activation, ``silu(x) = x * sigmoid(x)`` (one ``Sigmoid`` + ``Mul``)."""
        g = self.g
        return g.mul(gate, g.node("Sigmoid", [gate]), name=name + "/silu")

    def build_mlp(self, i: int, layer, h: str) -> str:
        """Gated MLP ``down(act(gate(h)) * up(h))`` of layer ``i`` on ``h [B,S,H]`` ->
        ``[B,S,H]`` (gate/up fused into one projection, then split)."""
        g, s = self.g, self.spec
        pre = f"model.layers.{i}.mlp"
        name = f"layers.{i}.mlp"
        gu = self.linear(h, [f"{pre}.gate_proj", f"{pre}.up_proj"], name + ".gate_up_proj")
        gate, up = g.split(gu, [s.intermediate_size, s.intermediate_size], axis=-1,
                           name=name + "/split")
        act = self.mlp_activation(gate, name)
        return self.linear(g.mul(act, up, name=name + "/gated"), [f"{pre}.down_proj"],
                           name + ".down_proj")


__all__ = ["MlpMixin"]
