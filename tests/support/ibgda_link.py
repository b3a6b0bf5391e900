"""IBGDA over soft mlx5 queues, driven from the host (the fixtures of tests/ibgda): the device header built as a
host library (its ctypes signatures), a Python poller of a soft queue's CQ, a host-side WQE poster, a sender
-> receiver ``Link`` over two soft devices with a ``tpd::IbgdaChannel`` over host memory, and ``FlagJudge``,
a placement observer that fails a flag landing before the payload it covers."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import gpuclient
from ibgda import mlx5_layout as L
from ibgda.channel_tables import HostAlloc, build_channel
from ibgda.device_handle import QP_STATE_DTYPE, SignalMode
from ibgda.soft_mlx5 import SoftMlx5Queue
from tests.support.waiting import wait_until

IBGDA_TESTS = Path(__file__).resolve().parents[1] / "ibgda"  # host_lib.cpp, probe.cpp, the GPU kernels
GPU_KERNELS = IBGDA_TESTS / "gpu_kernels.cu"
INCLUDE = gpuclient.get_include()  # the device API's root: transportd/ibgda/ beside the proxy API
INCLUDE_DIRS = gpuclient.get_include_dirs()  # that root, then the contract's (cmd_ring.h, errors.h)
DATA_BYTES = 1 << 20
NFLAGS = 16
# a soft queue's thread does the work: look often (every 0.5 ms), for up to 20 s
SOFT_QUEUE_WAIT = {"timeout": 20.0, "interval": 0.0005}

u8, u16, u32, u64, p = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "tpd_test_build_write": (None, [p, u64, u32, u8, u64, u32, u64, u32, u32]),
    "tpd_test_build_inline8": (None, [p, u64, u32, u8, u64, u32, u64]),
    "tpd_test_build_read": (None, [p, u64, u32, u8, u64, u32, u64, u32, u32]),
    "tpd_test_build_fadd": (None, [p, u64, u32, u8, u64, u32, u64, u64, u32]),
    "tpd_test_build_nop": (None, [p, u64, u32, u8]),
    "tpd_test_ctrl_flags": (u8, [ctypes.c_int, ctypes.c_int]),
    "tpd_test_doorbell_word": (u64, [p]),
    "tpd_test_ring": (None, [p, p, u64, u64]),
    "tpd_test_cqe_ready": (ctypes.c_int, [u8, u64, u32]),
    "tpd_test_qp_progress": (None, [p]),
    "tpd_test_qp_quiet": (u32, [p]),
    "tpd_test_put": (None, [p, u32, u16, u64, u16, u64, u32]),
    "tpd_test_put_signal": (None, [p, u32, u16, u64, u16, u64, u32, u32, u64, ctypes.c_int]),
    "tpd_test_signal": (None, [p, u32, u32, u64, ctypes.c_int]),
    "tpd_test_fence": (None, [p, u32]),
    "tpd_test_quiet": (None, [p]),
    "tpd_test_wait": (u64, [p, u32, u64]),
    "tpd_test_status": (u32, [p]),
    "tpd_test_error_count": (u32, [p]),
    "tpd_test_stress": (None, [p, u32, ctypes.c_int, ctypes.c_int, u32, u32]),
    "tpd_test_post_group": (None, [p, p, u32, p]),
    "tpd_test_group_stress": (None, [p, u32, ctypes.c_int, ctypes.c_int, u32, u32, u32]),
}


def compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is required for the IBGDA layout and host-path tests (CI installs build-essential)"
    return cxx


def include_flags() -> list[str]:
    return [f"-I{d}" for d in INCLUDE_DIRS]


class HostCq:
    """The poller's side of a soft queue's CQ, in Python (what progress() does on the GPU)."""

    def __init__(self, q: SoftMlx5Queue) -> None:
        self.q = q
        self.ci = 0

    def poll(self) -> list[L.DecodedCqe]:
        out = []
        q = self.q
        while True:
            slot = (self.ci & (q.ncqes - 1)) * 64
            raw = q.cq[slot:slot + 64].tobytes()
            if not L.cqe_ready(raw[63], self.ci, q.ncqes):
                break
            out.append(L.decode_cqe(raw))
            self.ci += 1
        if out:
            q.cq_dbrec[L.CQ_SET_CI] = L.cq_dbrec_value(self.ci)
        return out


class HostPoster:
    """Post WQEs built by the header's builders (through host_lib) into a soft queue, from Python."""

    def __init__(self, lib: ctypes.CDLL, q: SoftMlx5Queue) -> None:
        self.lib, self.q = lib, q
        self.head = 0
        self.cq = HostCq(q)
        self.cqes: list[L.DecodedCqe] = []
        self.addr = q.addresses()

    def slot(self, index: int) -> int:
        return self.q.base + (index & (self.q.wqe_cnt - 1)) * L.WQE_BB

    def add(self, kind: str, *args: int, completion: bool = False, fence: bool = False) -> int:
        """Build one WQE at the next index (``args`` after index, qpn and fm_ce_se); returns its index."""
        fm = self.lib.tpd_test_ctrl_flags(int(completion), int(fence))
        index = self.head
        getattr(self.lib, f"tpd_test_build_{kind}")(self.slot(index), index, self.q.qpn, fm, *args)
        self.head += 1
        return index

    def ring(self) -> None:
        word = self.lib.tpd_test_doorbell_word(self.slot(self.head - 1))
        self.lib.tpd_test_ring(self.addr["dbrec"], self.addr["bf"], self.head, word)
        self.q.kick()

    def wait_cqes(self, n: int, timeout: float = 20.0) -> list[L.DecodedCqe]:
        def got() -> bool:
            self.cqes.extend(self.cq.poll())
            return len(self.cqes) >= n
        wait_until(got, lambda: f"{n} CQEs (have {len(self.cqes)})", timeout, SOFT_QUEUE_WAIT["interval"])
        return self.cqes


@dataclass
class Link:
    """Rank 0 (``a``, the poster) -> rank 1 (``b``) over two soft devices, with registered buffers."""

    verbs: Any
    a: SoftMlx5Queue
    b: SoftMlx5Queue
    src: np.ndarray
    dst: np.ndarray
    flags: np.ndarray
    scratch: np.ndarray
    mr_src: Any
    mr_dst: Any
    mr_flags: Any
    mr_scratch: Any
    keep: list[Any] = field(default_factory=list)

    def observe(self, fn: Callable[[int, int, int], None] | None) -> None:
        self.verbs.soft.set_placement_observer(self.b.rail.ctx, fn)

    def channel(self, mode: SignalMode = SignalMode.WRITE, *, flag_rkey: int | None = None,
                dst_rkey: int | None = None) -> Chan:
        """A tpd::IbgdaChannel for rank 0 over host memory, built as a host would build it for a kernel."""
        alloc = HostAlloc()
        own_flags = np.zeros(NFLAGS, dtype=np.uint64)
        tables = build_channel(
            rank=0, world=2, alloc=alloc, signal_mode=mode, flags=own_flags.ctypes.data, flag_count=NFLAGS,
            queue_pairs={1: self.a.queue_pair(0, self.scratch.ctypes.data, self.mr_scratch.lkey)},
            local_regions=[(self.src.ctypes.data, self.src.nbytes, self.mr_src.lkey)],
            remote_regions={1: [(self.dst.ctypes.data, self.dst.nbytes,
                                 self.mr_dst.rkey if dst_rkey is None else dst_rkey)]},
            remote_flags={1: (self.flags.ctypes.data, self.flags.nbytes,
                              self.mr_flags.rkey if flag_rkey is None else flag_rkey)})
        chan = Chan(tables.record, view(tables.qp_states[1], QP_STATE_DTYPE, 1),
                    view(tables.shadow, np.dtype(np.uint64), 2 * NFLAGS), own_flags,
                    view(tables.error, np.dtype(np.uint32), 2), alloc)
        self.keep.append(chan)
        return chan


def view(addr: int, dtype: np.dtype, count: int) -> np.ndarray:
    """A live numpy view of ``count`` items at ``addr`` (memory the test keeps alive)."""
    raw = (ctypes.c_uint8 * (dtype.itemsize * count)).from_address(addr)
    return np.frombuffer(raw, dtype=dtype, count=count)


@dataclass
class Chan:
    """A channel record and live views of what it points at."""

    ch: np.ndarray
    state: np.ndarray       # QpState of the QP to rank 1, shape (1,)
    shadow: np.ndarray      # write/fence-mode flag values, [rank * NFLAGS + slot]
    own_flags: np.ndarray
    error: np.ndarray       # code, count
    alloc: HostAlloc

    @property
    def ptr(self) -> int:
        return int(self.ch.ctypes.data)


class FlagJudge:
    """Placement observer on the receiver: whenever a flag word lands, the payload it covers must be there.

    ``covers[slot][v - 1]`` is the list of (offset, length) writes flag value ``v`` on ``slot`` covers.
    """

    def __init__(self, link: Link) -> None:
        self.link = link
        self.covers: dict[int, list[list[tuple[int, int]]]] = {}
        self.violations: list[str] = []
        self.lo = link.flags.ctypes.data
        self.hi = self.lo + link.flags.nbytes

    def __call__(self, _qpn: int, addr: int, length: int) -> None:
        if not (self.lo <= addr < self.hi):
            return
        slot = (addr - self.lo) // 8
        value = int(self.link.flags[slot])
        covers = self.covers.get(slot, [])
        if not 0 < value <= len(covers):
            return
        for off, n in covers[value - 1]:
            if not np.array_equal(self.link.dst[off:off + n], self.link.src[off:off + n]):
                self.violations.append(f"flag {slot} reached {value} before bytes [{off}, {off + n}) landed")
                return
