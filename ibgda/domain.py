"""The daemon's side of client-owned IBGDA queues: one rank's import domain on its rail.

A domain is a device context of its own on the rail's NIC (a DevX context on a ConnectX), a PD in it, the
rank's regions registered on that PD, and a scratch page (atomics' old values and ordering reads land
there). Its command descriptor goes to the rank's client, which imports the context, the PD and the MRs
by handle (``ibv_import_device`` / ``_pd`` / ``_mr``) and builds its queue pairs in its own process on
that PD: the UAR is then the client's to map, and the keys in its WQEs are the domain's.

Why a context per rank and not the rail's own: whoever holds a context's command descriptor can reach
every object in it (import any PD or MR by handle, destroy it). The rail's context holds every job's
memory and the proxy's queue pairs; a rank's domain holds only that rank's regions. On a ConnectX it also
ends cleanly: the kernel frees a context's objects (the client's DevX QP, CQ, UMEMs and UAR included)
when the last process holding its descriptor closes it, so a client killed with SIGKILL leaves nothing
once the daemon closes the domain. The cost: the rank's regions are registered twice on the NIC, on the
rail's PD for the proxy path and here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from transportd.backends.verbs_common import access_flags, translate_verbs_errors

__all__ = ["SCRATCH_BYTES", "SCRATCH_SLOT", "ImportDomain"]

log = logging.getLogger(__name__)

SCRATCH_BYTES = 4096
SCRATCH_SLOT = 64  # one 64-byte line per queue pair (queues past 64 share lines: nobody reads them)


class ImportDomain:
    """One rank's domain (module doc). ``v``: the rail's verbs modules; ``device``, ``port``, ``gid_index``:
    the rail's. Use :meth:`register` for each region, :meth:`grant` and :meth:`command_fd` for the client."""

    def __init__(self, v: Any, device: str, *, port: int = 1, gid_index: int = 0) -> None:
        self.v, self.device, self.port, self.gid_index = v, device, port, gid_index
        self.nic = "soft" if v.name == "soft" else "mlx5"
        self.ctx: Any = None
        self.pd: Any = None
        self.mrs: dict[str, Any] = {}
        self.regions: dict[str, dict[str, int]] = {}
        try:
            with translate_verbs_errors(f"opening an IBGDA domain on {device}", v):
                self.ctx = self._open_context()
                self.port_attr = self.ctx.query_port(port)
                self.gid = self.ctx.query_gid(port, gid_index)
                self.pd = v.pd.PD(self.ctx)
            self.scratch = np.zeros(SCRATCH_BYTES // 8, dtype=np.uint64)
            self.scratch_key = self.register("scratch", int(self.scratch.ctypes.data), SCRATCH_BYTES)
        except BaseException:
            self.close()
            raise

    def _open_context(self) -> Any:
        if self.nic == "soft":
            return self.v.device.Context(name=self.device)
        # a ConnectX: the client makes DevX objects on the imported context, so it must be a DevX context
        try:
            from pyverbs.providers.mlx5 import mlx5_enums as dve
            from pyverbs.providers.mlx5.mlx5dv import Mlx5Context, Mlx5DVContextAttr
        except ImportError as exc:
            raise ValueError(f"IBGDA channels need pyverbs with the mlx5 provider ({exc})") from None
        attr = Mlx5DVContextAttr(dve.mlx5dv_context_attr_flags.MLX5DV_CONTEXT_FLAGS_DEVX)
        try:
            return Mlx5Context(attr, self.device)
        except Exception as exc:
            raise ValueError(f"IBGDA channels need a ConnectX with DevX: {self.device} cannot open a DevX "
                             f"context ({exc})") from None

    def register(self, key: str, addr: int, length: int, accessor: Any = None) -> dict[str, int]:
        """Register a region of the rank on the domain's PD (local access: WQEs read from it, reads and
        atomics land in it); returns its addr, length, lkey and handle (what the client imports)."""
        if key in self.regions:
            return self.regions[key]
        extra = {} if accessor is None else {"soft_accessor": accessor}
        with translate_verbs_errors(f"registering {length} bytes at {addr:#x} in an IBGDA domain", self.v):
            mr = self.v.mr.MR(self.pd, length, access_flags(self.v), address=addr, **extra)
        self.mrs[key] = mr
        self.regions[key] = {"addr": addr, "length": length, "lkey": int(mr.lkey), "handle": int(mr.handle)}
        return self.regions[key]

    def grant(self) -> dict[str, Any]:
        """What the client needs to import the domain and address its queue pairs (besides the descriptor)."""
        pa = self.port_attr
        return {"nic": self.nic, "verbs": self.v.name, "device": self.device, "port": self.port,
                "gid_index": self.gid_index, "lid": int(pa.lid), "gid": str(self.gid.gid),
                "mtu": int(pa.active_mtu), "pd_handle": int(self.pd.handle), "scratch": dict(self.scratch_key)}

    def command_fd(self) -> int:
        """A copy of the context's command descriptor (the caller owns it)."""
        return os.dup(self.ctx.cmd_fd)

    def close(self) -> None:
        """MRs, the PD, the context. On a ConnectX the PD may still carry a killed client's DevX objects
        (EBUSY): it is then dropped unclosed, and the kernel frees it with them once no process holds the
        context's descriptor."""
        for mr in self.mrs.values():
            mr.close()
        self.mrs.clear()
        if self.pd is not None:
            try:
                self.pd.close()
            except Exception as exc:  # pyverbs: ibv_dealloc_pd refused while the client's objects use it
                log.info("IBGDA domain on %s: PD left to the kernel (%s)", self.device, exc)
            self.pd = None
        if self.ctx is not None:
            # pyverbs' Context.close takes each child out of its sets before closing it and stops at the first
            # that refuses (that PD again): the next attempt goes past it to ibv_close_device
            for attempt in range(4):
                try:
                    self.ctx.close()
                    break
                except Exception as exc:
                    if attempt == 3:
                        log.warning("IBGDA domain on %s: closing the context failed: %s", self.device, exc)
            self.ctx = None
