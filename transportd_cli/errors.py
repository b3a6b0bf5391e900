"""Errors the command-line programs raise themselves (the daemon's and the library's are in their packages)."""

from __future__ import annotations

__all__ = ["ReplayError"]


class ReplayError(RuntimeError):
    """The replay could not be set up or did not finish (not: the outcomes differed)."""
