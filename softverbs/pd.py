"""Protection domains (pyverbs.pd). Keys of an MR work only with QPs of the same PD, as on hardware."""

from __future__ import annotations

import weakref
from typing import Any

from ._base import SoftCM
from .pyverbs_error import PyverbsUserError

__all__ = ["PD"]


class PD(SoftCM):
    """A protection domain on a Context; closing it closes its MRs, AHs and QPs."""

    __slots__ = ("_ctx", "_dev", "_children", "_closed")

    def __init__(self, creator: Any, **kwargs: Any) -> None:
        super().__init__()
        from .device import Context

        if not isinstance(creator, Context):
            raise PyverbsUserError(f"Cannot create PD from {type(creator)}")
        self._ctx = creator
        self._dev = creator._dev
        self._children: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closed = False
        creator._children.add(self)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        for child in list(self._children):
            child.close()
        self._closed = True
