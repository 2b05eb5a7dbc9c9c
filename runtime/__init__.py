"""edgeprune's embeddable runtime: a torch-free generation engine over onnxruntime.

>>> import edgeprune_runtime as runtime
>>> with runtime.load("out/smollm2-int4", threads=2) as s:
...     print(s.generate("The capital of France is", max_new_tokens=16).text)

Imports only onnxruntime, numpy, tokenizers, jinja2 and psutil (never torch).
"""

from .errors import EdgePruneError, GenerationError, RuntimeLoadError
from .session import GenerationResult, Session, load
from . import countdown, igprune, leank  # noqa: E402,F401  (register the variant sessions)
from .variants import register_session

__all__ = ["load", "Session", "GenerationResult", "register_session", "EdgePruneError", "GenerationError",
           "RuntimeLoadError"]
