"""The finite-activations check after compression: a compressed model whose activations or
logits stop being finite (a float16 model overflowing past 65504, a weight the rounding
made huge) fails the run, naming the layer where the values stopped being finite, instead
of being saved as a checkpoint that only produces NaN.

:class:`FiniteWatch` follows the calibration windows through the compressed blocks: the
engine already runs every compressed block on them (its outputs feed the next block), so
the check costs one forward of the last block plus the final norm and head on one window.
A window whose values were not finite *before* a block (a NaN embedding, a token the
statistics already excluded) is not held against that block: only windows finite at the
block's input and not at its output are, and one of them is run again with hooks on
every submodule to find the first module whose output is not finite.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .blocks import run_block
from .errors import CompressionError


def finite_rows(batches) -> list[torch.Tensor]:
    """Per batch ``bool [b]``: the rows whose hidden states are finite at every real
    token (``batches``: :func:`edgeprune.blocks.capture_block_inputs`'s lists)."""
    return [(torch.isfinite(h).all(-1) | ~m).all(-1) for h, _, m in batches]


def first_non_finite(module: nn.Module, prefix: str, run, row: int) -> Optional[str]:
    """The name (``prefix`` + submodule path) of the first submodule of ``module``, in the
    order outputs are produced, whose output is not finite in batch row ``row`` while
    ``run()`` executes; ``None`` when every output stays finite (the values then stop
    being finite between modules, e.g. in a residual addition)."""
    found: list[str] = []

    def hook(name):
        def fn(mod, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if not found and isinstance(out, torch.Tensor) and out.is_floating_point() and \
                    out.dim() >= 1 and out.shape[0] > row and not bool(torch.isfinite(out[row]).all()):
                found.append(name)
        return fn

    handles = [m.register_forward_hook(hook(f"{prefix}.{n}" if n else prefix))
               for n, m in module.named_modules()]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


class FiniteWatch:
    """Tracks which calibration windows are still finite as they go through the compressed
    blocks (see the module docstring).

    Args:
        batches: the engine's block inputs (``[[hidden, kwargs, tokmask], ...]``).
        dtype: the model's dtype (named in the error: float16 overflows first).
    """

    def __init__(self, batches, dtype: torch.dtype):
        self.finite = finite_rows(batches)
        self.total = sum(int(f.numel()) for f in self.finite)
        self.dtype = dtype

    def run(self, block: nn.Module, name: str, batches) -> None:
        """:func:`~edgeprune.blocks.run_block` one batch at a time, each output checked
        against the rows that were finite at the block's input.

        Raises:
            CompressionError: a window finite at the block's input is not at its output,
                naming the first submodule whose output is not finite.
        """
        for j, b in enumerate(batches):
            inp = b[0]
            run_block(block, [b])
            now = finite_rows([b])[0]
            broken = self.finite[j] & ~now
            self.finite[j] = self.finite[j] & now
            if bool(broken.any()):
                r = int(broken.nonzero()[0])
                where = first_non_finite(block, name, lambda: block(inp, **b[1]), r) or \
                    f"the output of {name}"
                raise self._error(where, int(broken.sum()))

    def check_logits(self, model: nn.Module, prefix: str, batches) -> None:
        """The final norm and head on one window that is finite after the last block.

        Raises:
            CompressionError: naming the norm or the head where the values stop being finite.
        """
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        try:
            norm = model.get_submodule(prefix.rsplit(".", 1)[0] + ".norm")
        except AttributeError:
            norm = None
        hit = next(((j, int(f.nonzero()[0])) for j, f in enumerate(self.finite) if bool(f.any())), None)
        if head is None or hit is None:
            return
        j, r = hit
        h = batches[j][0][r:r + 1]
        with torch.no_grad():
            for mod, label in ((norm, "the final norm"), (head, "lm_head")):
                if mod is None:
                    continue
                w = next(mod.parameters())
                h = mod(h.to(device=w.device, dtype=w.dtype))
                if not bool(torch.isfinite(h).all()):
                    raise self._error(f"{label}", 1, logits=True)

    def _error(self, where: str, n: int, logits: bool = False) -> CompressionError:
        half = self.dtype == torch.float16
        what = "logits" if logits else "activations"
        leaf = where.rsplit(".", 1)[-1]
        leave = (f"leave {leaf} out of the recipe (ignore = ['{leaf}'])" if leaf.endswith("_proj")
                 else "leave that block's layers out of the recipe (ignore = [...])")
        return CompressionError(
            f"after compression the model's {what} stop being finite at {where} ({n} of "
            f"{self.total} calibration windows)" + ("; float16 overflows past 65504" if half else ""),
            ("compress the model in float32 or bfloat16 (load it with dtype=torch.float32), or "
             if half else "") + leave)


__all__ = ["FiniteWatch", "finite_rows", "first_non_finite"]
