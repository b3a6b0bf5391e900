"""Protection domains (pyverbs.pd). Keys of an MR work only with QPs of the same PD, as on hardware.

``PD(ctx, handle=h)`` imports the PD whose handle is ``h`` in ``ctx``'s context (``ibv_import_pd``): over an
imported context, the exporter's PD (``softverbs._export``); over the context itself, another name for its
own PD. An imported PD and the PD it names are one PD: keys of one serve QPs of the other. Closing an
imported PD (or ``unimport``) leaves the PD itself alone.
"""

from __future__ import annotations

import errno
import weakref
from typing import Any

from ._dropped import SoftResource
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

__all__ = ["PD"]


class _PDIdentity:
    """What QPs and MRs compare to tell PDs apart: one per PD, shared by every import of it (a token, not the
    PD itself, so a PD refers to nothing that refers back and goes as soon as its last reference does)."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self, handle: int) -> None:
        self.handle = handle


class PD(SoftResource):
    """A protection domain on a Context; closing it closes its MRs, AHs and QPs."""

    _kind = "pd"  # what softverbs._export looks for among a context's objects
    __slots__ = ("_ctx", "_dev", "_children", "_closed", "_handle", "_imported", "_gone", "_ident")

    def __init__(self, creator: Any, **kwargs: Any) -> None:
        super().__init__()
        from .device import Context

        self._closed = True
        if not isinstance(creator, Context):
            raise PyverbsUserError(f"Cannot create PD from {type(creator)}")
        self._ctx = creator
        self._dev = creator._dev
        self._children: weakref.WeakSet[Any] = weakref.WeakSet()
        self._gone = False
        handle = kwargs.get("handle")
        if handle is None:
            self._imported = False
            self._handle = next(creator._handles)
            self._ident: Any = _PDIdentity(self._handle)
        else:
            self._imported = True
            self._handle = int(handle)
            self._ident = self._import(creator, int(handle))
            if creator._link is not None:  # told when the exporter closes it
                creator._imports["pd"].setdefault(self._handle, []).append(self)
        self._closed = False
        creator._children.add(self)

    @staticmethod
    def _import(ctx: Any, handle: int) -> Any:
        """ibv_import_pd: the identity shared by every import of ``handle`` in ``ctx``'s context."""
        if ctx._closed:
            raise PyverbsRDMAError("Failed to import PD", errno.EINVAL)
        link = ctx._link
        if link is None:  # the context's own PD, by another name
            for child in list(ctx._children):
                if isinstance(child, PD) and not child._closed and not child._imported and child._handle == handle:
                    return child._ident
            raise PyverbsRDMAError("Failed to import PD", errno.EINVAL)
        from ._export import LinkError

        try:
            link.call("pd", handle=handle)
        except LinkError as exc:
            raise PyverbsRDMAError("Failed to import PD", exc.errno) from None
        exporter = ctx._exporter() if ctx._exporter is not None else None
        if exporter is not None:  # in the exporter's process: the exporter's PD itself
            return PD._import(exporter, handle)
        for pd in ctx._imports["pd"].get(handle, ()):
            return pd._ident
        return _PDIdentity(handle)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        for child in list(self._children):
            child.close()
        self._closed = True
        group = self._ctx._imports["pd"].get(self._handle) if self._imported else None
        if group is not None and self in group:
            group.remove(self)
        export = self._ctx._export
        if not self._imported and export is not None:
            export.gone("pd", self._handle)

    def unimport(self) -> None:
        """ibv_unimport_pd: forget an imported PD without deallocating it (a PD made here: closes it)."""
        self.close()

    @property
    def handle(self) -> int:
        """The PD's handle in its context (what ``PD(ctx, handle=...)`` imports)."""
        return self._handle
