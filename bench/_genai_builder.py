"""onnxruntime-genai's model builder, with one config fix for Gemma 3 (issue 22).

Runs inside ``.venv-ortgenai`` (``compare_runtimes.py`` calls it with the builder's own
arguments: ``-i HF_DIR -o OUT -p int4 -e cpu -c CACHE``). onnxruntime-genai 0.18's
``Gemma3Model`` reads the pre-5.x config fields ``rope_local_base_freq`` and a flat
``rope_parameters["rope_type"]``; transformers 5.x's ``Gemma3TextConfig`` keeps one
``rope_parameters`` entry per layer type (``full_attention``, ``sliding_attention``) and
drops ``rope_local_base_freq``, so the unpatched builder stops with
``KeyError: 'rope_type'``. The shim gives the loaded config the fields the builder reads,
with the values of the nested entries (global base for ``rope_theta``, local base for
``rope_local_base_freq``); the weights and every other field are the builder's own reading.
Nothing of this repository is imported here.
"""

from __future__ import annotations

import runpy
import sys


def builder_fields(config):
    """Give a transformers 5.x ``Gemma3TextConfig`` the fields onnxruntime-genai 0.18's
    ``Gemma3Model`` reads (in place; any other config is returned unchanged).

    ``rope_parameters`` becomes the global layers' flat entry (with ``rope_type``),
    ``rope_theta`` its base and ``rope_local_base_freq`` the sliding layers' base.

    Returns:
        ``config``.
    """
    rp = getattr(config, "rope_parameters", None)
    if (getattr(config, "model_type", "") == "gemma3_text" and isinstance(rp, dict)
            and "full_attention" in rp and "sliding_attention" in rp):
        glob, loc = rp["full_attention"], rp["sliding_attention"]
        config.rope_parameters = {**glob, "rope_type": glob.get("rope_type", "default")}
        config.rope_theta = glob["rope_theta"]
        config.rope_local_base_freq = loc["rope_theta"]
    return config


def _patch() -> None:
    import transformers

    orig = transformers.AutoConfig.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        return builder_fields(orig(cls, *args, **kwargs))

    transformers.AutoConfig.from_pretrained = classmethod(from_pretrained)


if __name__ == "__main__":
    _patch()
    sys.argv[0] = "onnxruntime_genai.models.builder"
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
