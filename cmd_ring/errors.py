"""The errors of cmd_ring: what the ring raises when it cannot be created, attached or used."""

from __future__ import annotations

__all__ = ["RingError", "RingFullError", "RingLayoutError", "RingNotFoundError"]


class RingError(Exception):
    """A ring could not be created, attached or used."""


class RingNotFoundError(RingError):
    """No ring file under that name."""


class RingLayoutError(RingError):
    """The file exists but is not a ring of this version, or its size disagrees with its header."""


class RingFullError(RingError):
    """No credit became free before the producer's timeout."""
