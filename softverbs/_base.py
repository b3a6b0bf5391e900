"""Common base for the mirrored classes: pyverbs' PyverbsObject/PyverbsCM behaviour (close, context manager)."""

from __future__ import annotations

import logging
from typing import Any


class SoftObject:
    """Like PyverbsObject: carries a logger whose level can be set (looked up on first use: an SGE or a WR is
    made per post, and ``logging.getLogger`` takes a lock)."""

    __slots__ = ("__weakref__",)

    @property
    def _logger(self) -> logging.Logger:
        return logging.getLogger(type(self).__name__)

    def set_log_level(self, val: int) -> None:
        self._logger.setLevel(val)


class SoftCM(SoftObject):
    """Like PyverbsCM: an object that owns a resource and closes it on `with` exit."""

    __slots__ = ()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        self.close()

    def close(self) -> None:  # overridden by every resource
        pass
