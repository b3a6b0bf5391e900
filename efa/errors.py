"""The errors of the efa backend's own logic (verbs and device failures are the BackendError family of
``transportd.errors``, which ``transportd.backends.verbs_common`` raises for ib and efa alike)."""

from __future__ import annotations

__all__ = ["ProtocolViolation"]


class ProtocolViolation(ValueError):
    """The peer's immediates or records contradict the counting protocol (a bug or a corrupted record)."""
