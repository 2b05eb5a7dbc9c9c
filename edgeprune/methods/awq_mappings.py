"""Where AWQ may fold its scales, per model family: a table, as llm-compressor's
``modifiers/awq/mappings.py`` keeps one (AWQ: Lin et al., MLSys 2024, Sec. 3.2).

Each :class:`AWQMapping` names an op inside a decoder block (the *smooth* op, a norm or a
linear) and the linears that read its output (the *balance* linears). AWQ multiplies the
balance linears' input columns by scales ``s`` and divides the smooth op's output by
``s`` (``W x = (W diag(s)) (diag(s)^-1 x)``), which is exact only when the smooth op's
output is linear in its weight: a llama ``RMSNorm`` (``x / rms(x) * w``) or a linear.

Gemma 3 differs in three places, all kept out of the fold:

* its norms scale by ``(1 + w)`` (``Gemma3RMSNorm``): dividing ``w`` by ``s`` does not
  divide the output by ``s``. q/k/v (after ``input_layernorm``) and gate/up (after
  ``pre_feedforward_layernorm``) are then quantized without AWQ scales (clip + RTN);
* the MLP reads ``pre_feedforward_layernorm``, not ``post_attention_layernorm`` (which
  normalizes the attention output before the residual add): llama's table names the
  wrong norm there;
* QK-norm (``q_norm`` / ``k_norm``, RMSNorm per head after ``q_proj`` / ``k_proj``) is
  invariant to a per-head scale of its input, so neither q_proj nor k_proj is ever a
  smooth op (a scale folded into their rows would be normalized away).

``v_proj -> o_proj`` (no norm on v in Gemma 3) and ``up_proj -> down_proj`` (GeGLU is
linear in ``up``) are folded as for llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: why Gemma's norms take no scale
ONE_PLUS_W = ("(1 + w) RMSNorm (Gemma3RMSNorm): dividing w by s does not divide its output "
              "by s")


@dataclass(frozen=True)
class AWQMapping:
    """One smoothing site of a decoder block (names relative to the block).

    Attributes:
        smooth: the op whose output is divided by the scales (a norm or a linear).
        balance: the linears reading that output, whose input columns are multiplied.
        kind: ``"gqa"``: ``v_proj -> o_proj`` under grouped-query attention (the scales
            are tied across the query heads of a KV head); ``None`` otherwise.
        no_fold: why the scales must not be folded into ``smooth`` (the balance linears
            then get clip + RTN only); ``None``: foldable.
    """

    smooth: str
    balance: tuple
    kind: Optional[str] = None
    no_fold: Optional[str] = None


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")

LLAMA = (
    AWQMapping("input_layernorm", _QKV),
    AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "gqa"),
    AWQMapping("post_attention_layernorm", _GATE_UP),
    AWQMapping("mlp.up_proj", ("mlp.down_proj",)),
)

GEMMA3 = (
    AWQMapping("input_layernorm", _QKV, no_fold=ONE_PLUS_W),
    AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "gqa"),
    AWQMapping("pre_feedforward_layernorm", _GATE_UP, no_fold=ONE_PLUS_W),
    AWQMapping("mlp.up_proj", ("mlp.down_proj",)),
)

#: ``model_type`` -> the block's smoothing sites (llama's for a type not listed)
AWQ_MAPPINGS = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gemma3_text": GEMMA3}


def block_model_type(block) -> Optional[str]:
    """The ``model_type`` of a transformers decoder block (from its own config, or its
    attention's), ``None`` when it has none."""
    for owner in (block, getattr(block, "self_attn", None)):
        cfg = getattr(owner, "config", None)
        if cfg is not None and getattr(cfg, "model_type", None):
            return str(cfg.model_type)
    return None


def mappings_for(block) -> tuple:
    """The :class:`AWQMapping` rows of ``block``'s family (llama's by default)."""
    return AWQ_MAPPINGS.get(block_model_type(block), LLAMA)


__all__ = ["AWQMapping", "AWQ_MAPPINGS", "LLAMA", "GEMMA3", "ONE_PLUS_W", "block_model_type",
           "mappings_for"]
