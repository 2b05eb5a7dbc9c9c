"""Adding a graph variant takes one class per stage and its registration line, nothing else.

The variant here, ``logit_scale``, multiplies the logits by a number (a temperature of
``1 / scale``): its compress-side spec, its exporter mixin and its runtime session are all
defined and registered in this file, and the test shows the whole path works: the spec
file round trip, ``export_onnx(..., variants=[spec])`` recording it in ``edgeprune.json``,
``runtime.load`` returning the registered session, logits equal to the spec's PyTorch
reference.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

import edgeprune_exporters as exporters
import edgeprune_runtime as runtime
from edgeprune.variants import VARIANTS, VariantSpec, load_spec, register_variant, save_spec
from edgeprune_exporters.variants import EXPORT_VARIANTS, VariantMixin, register_export_variant
from edgeprune_runtime.session import Session
from edgeprune_runtime.variants import SESSIONS, register_session, variant_records
from tiny import byte_tokenizer, rand_ids


# ------------------------------------------------------------------ compress stage
@register_variant
@dataclass
class LogitScale(VariantSpec):
    """Logits multiplied by ``scale``."""

    name: ClassVar[str] = "logit_scale"
    scale: float = 1.0

    def to_dict(self) -> dict:
        return {"scale": self.scale}

    @classmethod
    def from_dict(cls, d, arrays=None) -> "LogitScale":
        return cls(scale=float(d["scale"]))

    @classmethod
    def calibrate(cls, model, calib_ids, *, temperature: float = 1.0) -> "LogitScale":
        return cls(scale=1.0 / temperature)

    @contextlib.contextmanager
    def reference(self, model):
        hook = model.lm_head.register_forward_hook(lambda mod, args, out: out * self.scale)
        try:
            yield model
        finally:
            hook.remove()


# -------------------------------------------------------------------- export stage
@register_export_variant("logit_scale")
class LogitScaleMixin(VariantMixin):
    """``build_lm_head`` hook: the projected logits times the spec's scale."""

    def __init__(self, model, spec, opts):
        super().__init__(model, spec, opts)
        self.logit_scale = float(opts.variants["logit_scale"]["scale"])
        self.logits_match_model = False          # the graph is the scaled model

    def build_lm_head(self, h: str) -> str:
        logits = super().build_lm_head(h)
        return self.g.mul(logits, self.g.const(self.logit_scale, self.fdtype), name="logit_scale")

    def variant_record(self) -> dict:
        return {"scale": self.logit_scale}


# ----------------------------------------------------------------------- run stage
@register_session("logit_scale")
class LogitScaleSession(Session):
    """Exposes the export's scale."""

    @property
    def logit_scale(self) -> float:
        return float(variant_records(self.meta)["logit_scale"]["scale"])


def test_a_variant_plugs_into_all_three_stages(tiny_llama, tmp_path):
    spec = LogitScale.calibrate(tiny_llama, None, temperature=4.0)
    path = save_spec(spec, tmp_path / "scale.json")
    assert json.loads(path.read_text()) == {"edgeprune_variant": "logit_scale", "scale": 0.25}
    assert load_spec(path) == spec

    res = exporters.export_onnx(tiny_llama, byte_tokenizer(), tmp_path / "onnx",
                                variants=[load_spec(path)], max_length=64)
    meta = json.loads((res.folder / "edgeprune.json").read_text())
    assert meta["variants"] == {"logit_scale": {"scale": 0.25}}

    ids = rand_ids(12, seed=3)
    with runtime.load(res.folder) as s:
        assert type(s) is LogitScaleSession and s.logit_scale == 0.25
        got = s.logits(ids)
    with torch.no_grad(), spec.reference(tiny_llama):
        ref = tiny_llama(torch.from_numpy(ids)).logits.numpy()
    dense = tiny_llama(torch.from_numpy(ids)).logits.detach().numpy()
    assert np.abs(got - ref).max() < 1e-4 and np.abs(got - dense).max() > 1e-2

    # everything the variant needed is in this file
    for registry, cls in ((VARIANTS, LogitScale), (EXPORT_VARIANTS, LogitScaleMixin),
                          (SESSIONS, LogitScaleSession)):
        assert registry["logit_scale"] is cls and cls.__module__ == __name__
