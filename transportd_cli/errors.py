"""Errors the command-line programs raise themselves (the daemon's and the library's are in their packages)."""

from __future__ import annotations

__all__ = ["ReplayError", "Stopped"]


class ReplayError(RuntimeError):
    """The replay could not be set up or did not finish (not: the outcomes differed)."""


class Stopped(Exception):
    """SIGTERM to a command that runs until Ctrl-C (``transportd localcluster``): stop as Ctrl-C does."""
