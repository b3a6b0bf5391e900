"""The client's side of an IBGDA domain (``ibgda.domain``): the imported context and PD, and the queue pairs
the client builds there in its own process.

The daemon grants a rank its domain: the context's command descriptor (over the descriptor socket), the
PD's handle, the port's address and a scratch page. :class:`ImportedDomain` imports them and makes one
queue pair per peer with :meth:`ImportedDomain.queue`:

- over softverbs (``nic = "soft"``), an :class:`ibgda.soft_mlx5.SoftMlx5Queue` on the imported PD: this
  process plays the ConnectX (a thread executes the WQEs), and the regions' MRs are imported by handle so
  their keys resolve here;
- on a ConnectX (``nic = "mlx5"``), an :class:`ibgda.host_mlx5.Mlx5Queue` whose DevX CQ, QP, UMEMs and UAR
  are made on the imported context (:mod:`ibgda.devx`); WQEs carry the domain's lkeys as they are.

Where queue memory lives: pinned host memory of this process (one page-aligned mapping per queue pair:
send queue, CQ, doorbell records), mapped into the GPU with ``cuMemHostRegister``. GPU memory for the
queues (a UMEM over a dma-buf of ``cuMemAlloc``'d memory, where the NIC allows) is not built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ibgda.domain import SCRATCH_BYTES, SCRATCH_SLOT
from ibgda.errors import Mlx5QueueError

__all__ = ["ImportedDomain"]


class ImportedDomain:
    """A domain the daemon granted this process (module doc). ``grant``: the channel reply's ``domain``;
    ``fd``: its command descriptor, owned by this object from here on."""

    def __init__(self, grant: Mapping[str, Any], fd: int) -> None:
        self.grant = dict(grant)
        self.nic = str(grant["nic"])
        self.rail: Any = None
        self.devx: Any = None
        self._slots = 0
        self._mr_handles: set[int] = set()
        port, gid_index, pd = int(grant["port"]), int(grant["gid_index"]), int(grant["pd_handle"])
        if self.nic == "soft":
            from transportd.backends.verbs_common import Rail

            self.rail = Rail.imported(str(grant["verbs"]), fd, pd, port=port, gid_index=gid_index)
        elif self.nic == "mlx5":
            from ibgda.devx import DevxContext

            self.devx = DevxContext.imported(fd, pd)
        else:
            raise Mlx5QueueError(f"unknown IBGDA NIC kind {self.nic!r} in the daemon's grant")
        self.scratch = dict(grant["scratch"])
        self.import_mr(int(self.scratch["handle"]), int(self.scratch["addr"]))

    def import_mr(self, handle: int, address: int) -> None:
        """Make the domain's MR ``handle`` usable by this process's queue pairs. Over softverbs that is an
        import (the soft NIC here resolves its keys); a ConnectX needs nothing: the keys are the PD's."""
        if self.rail is not None and handle not in self._mr_handles:
            self.rail.import_mr(handle, address)
            self._mr_handles.add(handle)

    def queue(self, wqe_cnt: int) -> Any:
        """A new queue pair of ``wqe_cnt`` WQEs in this process (not yet connected)."""
        if self.rail is not None:
            from ibgda.soft_mlx5 import SoftMlx5Queue

            return SoftMlx5Queue(rail=self.rail, wqe_cnt=wqe_cnt)
        from ibgda.host_mlx5 import Mlx5Queue

        g = self.grant
        return Mlx5Queue(devx=self.devx, wqe_cnt=wqe_cnt, port=int(g["port"]), gid_index=int(g["gid_index"]),
                         port_info={"lid": int(g["lid"]), "gid": str(g["gid"]), "mtu": int(g["mtu"])},
                         map_to_gpu=False)

    def scratch_slot(self) -> tuple[int, int]:
        """(address, lkey) of the next queue pair's 64 bytes of the scratch page."""
        slot = self._slots % (SCRATCH_BYTES // SCRATCH_SLOT)
        self._slots += 1
        return int(self.scratch["addr"]) + slot * SCRATCH_SLOT, int(self.scratch["lkey"])

    def close(self) -> None:
        """Close the imported objects (the queue pairs made here must be closed first)."""
        if self.rail is not None:
            self.rail.close()
            self.rail = None
        if self.devx is not None:
            self.devx.close()
            self.devx = None
