"""The benchmark's null NIC (benchmarks/ibgda_null_nic.cpp) against the device posting path compiled for
the host: every WQE seen, a CQE exactly where one was asked for, posting and quiet finish. This is what
benchmarks/ibgda_bench.py runs with a GPU posting instead."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ibgda.channel_tables import HostAlloc, build_channel
from ibgda.device_handle import QP_STATE_DTYPE, QUEUE_PAIR_DTYPE, SignalMode
from ibgda.queue_memory import QueueMemory
from tests.support.ibgda_link import IBGDA_TESTS, compiler, include_flags, view

NULL_NIC = IBGDA_TESTS.parents[1] / "benchmarks" / "ibgda_null_nic.cpp"


@pytest.fixture(scope="module")
def null_nic(build_dir: Path) -> ctypes.CDLL:
    lib = build_dir / "libibgda_null_nic.so"
    subprocess.run([compiler(), "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
                    *include_flags(), str(NULL_NIC), "-o", str(lib)], check=True)
    nic = ctypes.CDLL(str(lib))
    nic.tpd_null_nic_start.restype = ctypes.c_void_p
    nic.tpd_null_nic_start.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_uint32] * 3
    nic.tpd_null_nic_stop.restype = ctypes.c_uint64
    nic.tpd_null_nic_stop.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
    return nic


@pytest.mark.parametrize("groups", [False, True], ids=["single-posts", "group-posts"])
@pytest.mark.parametrize("mode", list(SignalMode))
def test_null_nic_completes_the_posting_path(host_lib, null_nic, mode: SignalMode, groups: bool) -> None:
    """6 threads post through a 32-slot queue: single put_signal + signal each, or groups of 12 put_signals
    (post_group, the warp calls' steps; one doorbell per claim of up to 16 + 2 WQEBBs)."""
    mem = QueueMemory(32, 32, with_uar_page=True)
    qp = np.zeros(1, dtype=QUEUE_PAIR_DTYPE)
    for name, addr in mem.addresses().items():
        qp[name] = addr
    qp["qpn"], qp["wqe_cnt"], qp["ncqes"], qp["scratch"], qp["scratch_lkey"] = 0x4242, 32, 32, 0x1000, 1
    flags = np.zeros(8, dtype=np.uint64)
    tables = build_channel(rank=0, world=2, alloc=HostAlloc(), signal_mode=mode, flags=flags.ctypes.data,
                           flag_count=8, queue_pairs={1: qp}, local_regions=[(0x10000, 1 << 40, 1)],
                           remote_regions={1: [(0x20000, 1 << 40, 2)]}, remote_flags={1: (0x40000, 64, 3)})
    a = mem.addresses()
    handle = null_nic.tpd_null_nic_start(a["sq"], a["dbrec"], a["cq"], a["cq_dbrec"], 0x4242, 32, 32)
    ch = tables.record.ctypes.data
    try:
        if groups:
            host_lib.tpd_test_group_stress(ch, 1, 6, 25, 12, 4096, 4)
        else:
            host_lib.tpd_test_stress(ch, 1, 6, 150, 4096, 4)
    finally:
        cqes = ctypes.c_uint64()
        wqes = null_nic.tpd_null_nic_stop(handle, ctypes.byref(cqes))
    state = view(tables.qp_states[1], QP_STATE_DTYPE, 1)[0]
    assert host_lib.tpd_test_status(ch) == 0
    assert wqes == int(state["posted"]) == int(state["claimed"]) == int(state["done"])
    assert cqes.value == int(state["cq_ci"]) and 0 < cqes.value < wqes // 4 + 8
