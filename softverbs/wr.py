"""Work requests (pyverbs.wr): SGE, RecvWR and SendWR, with pyverbs' constructors and chaining."""

from __future__ import annotations

from typing import Any

from . import libibverbs_enums as e
from ._base import SoftCM
from ._memory import host_view
from .pyverbs_error import PyverbsUserError

__all__ = ["RecvWR", "SGE", "SendWR"]

_MW_OPCODES = (e.IBV_WR_LOCAL_INV, e.IBV_WR_BIND_MW, e.IBV_WR_SEND_WITH_INV)


class SGE(SoftCM):
    """A scatter/gather element: address, length, local key."""

    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        super().__init__()
        self.addr = addr
        self.length = length
        self.lkey = lkey

    def read(self, length: int, offset: int) -> bytes:
        """Bytes at the SGE's address (host memory only, like pyverbs' memcpy)."""
        return bytes(host_view(self.addr + offset, length))

    def __str__(self) -> str:
        return f"Address: {self.addr:#x}\nLength: {self.length}\nKey: {self.lkey:#x}\n"


def _sg_list(sg: Any, num_sge: int) -> list[tuple[int, int, int]]:
    if num_sge == 0:
        return []
    if sg is None:
        raise PyverbsUserError("num_sge given without an SGE list")
    return [(s.addr, s.length, s.lkey) for s in list(sg)[:num_sge]]


class RecvWR(SoftCM):
    """A receive work request; `next_wr` chains several into one post_recv."""

    __slots__ = ("wr_id", "num_sge", "_sg", "_next")

    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: Any = None, next_wr: RecvWR | None = None) -> None:
        super().__init__()
        self.wr_id = wr_id
        self.num_sge = num_sge
        self._sg = _sg_list(sg, num_sge)
        self._next = next_wr

    @property
    def next_wr(self) -> RecvWR | None:
        return self._next

    @next_wr.setter
    def next_wr(self, val: RecvWR) -> None:
        self._next = val

    def _extract(self) -> tuple[int, list[tuple[int, int, int]]]:
        return self.wr_id, self._sg[: self.num_sge]


class SendWR(SoftCM):
    """A send work request (ibv_send_wr): opcode, flags, SGEs and the RDMA / atomic / UD fields."""

    __slots__ = ("wr_id", "num_sge", "imm_data", "opcode", "send_flags", "_sg", "_next", "_rkey", "_raddr",
                 "_compare_add", "_swap", "_ah", "_rqpn", "_rqkey", "_mw_rkey")

    def __init__(self, wr_id: int = 0, opcode: int = e.IBV_WR_SEND, num_sge: int = 0, imm_data: int = 0,
                 sg: Any = None, send_flags: int = e.IBV_SEND_SIGNALED, next_wr: SendWR | None = None) -> None:
        super().__init__()
        if opcode not in _MW_OPCODES and (num_sge < 1 or sg is None):
            raise PyverbsUserError("A WR needs at least one SGE")
        self._sg = _sg_list(sg, num_sge)
        self.num_sge = num_sge
        self.wr_id = wr_id
        self._next = next_wr
        self.opcode = opcode
        self.send_flags = send_flags
        self.imm_data = imm_data
        self._rkey = self._raddr = self._compare_add = self._swap = 0
        self._ah: Any = None
        self._rqpn = self._rqkey = self._mw_rkey = 0

    @property
    def next_wr(self) -> SendWR | None:
        return self._next

    @next_wr.setter
    def next_wr(self, val: SendWR) -> None:
        self._next = val

    @property
    def sg_list(self) -> None:
        raise AttributeError("sg_list is write-only")

    @sg_list.setter
    def sg_list(self, val: Any) -> None:
        self._sg = [(val.addr, val.length, val.lkey)]

    @property
    def rkey(self) -> int:
        return self._mw_rkey

    def set_wr_ud(self, ah: Any, rqpn: int, rqkey: int) -> None:
        """Destination of a datagram (UD/SRD) WR."""
        self._ah, self._rqpn, self._rqkey = ah, rqpn, rqkey

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        """Remote key and address of an RDMA read/write."""
        self._rkey, self._raddr = rkey, addr

    def set_wr_atomic(self, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
        """Remote key/address and operands of an atomic."""
        self._rkey, self._raddr, self._compare_add, self._swap = rkey, addr, compare_add, swap

    def _extract(self) -> tuple:
        ud = None
        if self._ah is not None:
            ud = (self._ah._endpoint, self._rqpn, self._rqkey)
        return (self.wr_id, int(self.opcode), int(self.send_flags), self._sg[: self.num_sge], self.imm_data,
                self._rkey, self._raddr, self._compare_add, self._swap, ud)

    def __str__(self) -> str:
        return f"WR ID: {self.wr_id}\nNum SGE: {self.num_sge}\nOpcode: {self.opcode}\n" \
               f"Send flags: {self.send_flags}\nImm Data: {self.imm_data}\n"
