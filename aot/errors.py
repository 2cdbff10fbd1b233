"""Errors of the build side a user can cause; each message names the value and the rule."""
from __future__ import annotations


class BuildError(RuntimeError):
    """The build cannot produce a complete, valid artifact set; the message says which variant and why."""


class PlanError(BuildError):
    """The config asks for something no build can deliver (no valid variant, or a coverage gap)."""


class NeedsConfirmation(BuildError):
    """The build is far larger than usual; pass ``yes=True`` (``--yes``) to run it."""


class MergeError(BuildError):
    """Shard outputs cannot be merged into one artifact set (the message names the folders and why)."""
