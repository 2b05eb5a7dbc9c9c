"""The one exception hierarchy of edgeprune.

It lives in ``runtime`` because dependencies flow one way
(``edgeprune`` -> ``exporters`` -> ``runtime``): the runtime is the lowest layer and
must import without torch, so every package can share these classes.
``edgeprune.errors`` re-exports them.

Every error carries a one-line ``message`` naming the problem and a ``hint`` naming
the fix; ``str(err)`` joins both so the CLI prints one clear line.
"""

from __future__ import annotations


class EdgePruneError(Exception):
    """Base class of every error edgeprune raises on purpose.

    Args:
        message: what is wrong, in one sentence.
        hint: what the user should do about it (optional).
    """

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:  # noqa: D105
        return f"{self.message} (fix: {self.hint})" if self.hint else self.message


class ConfigError(EdgePruneError, ValueError):
    """An option or setting is out of range or inconsistent (sparsity, bits, group_size...)."""


class ModelLoadError(EdgePruneError):
    """A model source is missing, corrupt, or cannot be reached (offline hub id)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one edgeprune can compress or export."""


class CalibrationError(EdgePruneError):
    """Calibration or evaluation text is missing, unreadable or too short."""


class EvaluationError(EdgePruneError):
    """A model's outputs cannot be scored (non-finite logits)."""


class CompressionError(EdgePruneError):
    """A compression method could not run on a layer (and no fallback applied)."""


class CheckpointError(EdgePruneError):
    """A checkpoint folder is incomplete, inconsistent, or would overwrite another run."""


class ExportError(EdgePruneError):
    """An ONNX export could not be built, validated or written."""


class RuntimeLoadError(EdgePruneError):
    """An exported folder cannot be loaded by the runtime (missing/corrupt files)."""


class GenerationError(EdgePruneError):
    """Bad generation input: empty prompt, prompt longer than the context, bad sampling args."""


class DeviceError(EdgePruneError):
    """An unknown device profile, or a run that exceeds the profile's memory budget."""


__all__ = [
    "EdgePruneError",
    "EvaluationError",
    "ConfigError",
    "ModelLoadError",
    "UnsupportedArchitectureError",
    "CalibrationError",
    "CompressionError",
    "CheckpointError",
    "ExportError",
    "RuntimeLoadError",
    "GenerationError",
    "DeviceError",
]
