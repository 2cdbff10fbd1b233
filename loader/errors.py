"""The loader's exception types, in one place (importable without torch or CUDA)."""
from __future__ import annotations

from .cuda_versions import DriverTooOld  # noqa: F401  (re-exported)
from .manifest import ArtifactError, ArtifactIntegrityError, ManifestError  # noqa: F401  (re-exported)


class InvalidArgument(ValueError):
    """A tensor argument breaks a rule of the operator; the message names it, the value and the rule."""


class UnsupportedProblem(ValueError):
    """No built variant can serve this call; the message says why, for each candidate."""


class DeviceMismatch(RuntimeError):
    """A variant was built for another GPU architecture (or needs more than the device has)."""


class LaunchRefused(RuntimeError):
    """The DSL's own host code flagged this launch as invalid (its printf error path)."""


class CaptureError(RuntimeError):
    """A kernel would have to be loaded while a CUDA graph is being captured."""


class TorchMissing(ImportError):
    """An operator was called but torch is not installed."""


class NoCuda(DeviceMismatch):
    """torch has no CUDA (a CPU-only build, or no GPU visible): kernels cannot be loaded or launched."""


class ArtifactsNotFound(ArtifactError):
    """`load()` with no path found no artifacts; the message lists every place it searched."""


class IncompatibleArtifacts(ManifestError):
    """An installed artifact package was built for a loader version range this loader is outside of."""


__all__ = ["InvalidArgument", "UnsupportedProblem", "DeviceMismatch", "LaunchRefused", "CaptureError",
           "TorchMissing", "NoCuda", "DriverTooOld", "ArtifactsNotFound", "IncompatibleArtifacts", "ArtifactError",
           "ArtifactIntegrityError", "ManifestError"]
