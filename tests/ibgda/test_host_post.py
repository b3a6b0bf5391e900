"""The IBGDA device path, compiled for the host, against the soft NIC: tpd::put / put_signal / signal /
fence / quiet / status on a tpd::IbgdaChannel run the header's own claim, ticket, doorbell and CQ-polling
code — from one thread, and from many native threads at once — exactly as a kernel's threads would."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ibgda import mlx5_layout as L
from ibgda.device_handle import SignalMode
from tests.support.ibgda_link import DATA_BYTES, NFLAGS, FlagJudge

ERR_BAD_PEER, ERR_BAD_REGION, ERR_OUT_OF_BOUNDS, ERR_BAD_LENGTH, ERR_BAD_SLOT = 2, 3, 4, 5, 6
ERR_REMOTE_ACCESS, ERR_TRANSPORT = 9, 10


def counters(chan) -> dict[str, int]:
    s = chan.state[0]
    return {k: int(s[k]) for k in ("claimed", "posted", "done", "cq_ci", "signaled", "error")}


@pytest.mark.parametrize(("mode", "adaptive_routing"), [
    (SignalMode.WRITE, False), (SignalMode.ATOMIC, False), (SignalMode.FENCE, False),
    (SignalMode.ATOMIC, True), (SignalMode.FENCE, True)])
def test_put_signal_then_quiet(make_link, host_lib, mode: SignalMode, adaptive_routing: bool) -> None:
    link = make_link(adaptive_routing=adaptive_routing, seed=9, packet_size=1024 if adaptive_routing else None,
                     wqe_cnt=32)
    chan = link.channel(mode)
    judge = FlagJudge(link)
    link.observe(judge)
    rng = random.Random(int(mode) * 10 + adaptive_routing)
    counts = [0] * 4
    writes: list[tuple[int, int]] = []
    off = 0
    for _ in range(60):  # 120-180 WQEs: the 32-slot send queue wraps several times
        n = rng.randint(1, 8) * 1024
        slot = rng.randrange(4)
        writes.append((off, n))
        counts[slot] += 1
        judge.covers.setdefault(slot, []).append(list(writes))
        host_lib.tpd_test_put_signal(chan.ptr, 1, 0, off, 0, off, n, slot, 1, 0)
        off += n
    host_lib.tpd_test_quiet(chan.ptr)
    assert host_lib.tpd_test_status(chan.ptr) == 0, link.a.errors
    c = counters(chan)
    assert c["claimed"] == c["posted"] == c["done"] and c["error"] == 0
    per_put = {SignalMode.WRITE: 2, SignalMode.ATOMIC: 2, SignalMode.FENCE: 3}[mode]
    assert c["posted"] in (60 * per_put, 60 * per_put + 1)  # + quiet's completion probe, when one was needed
    assert link.a.stats["cqes"] == c["cq_ci"] < c["posted"] // 4 + 2, "CQEs only at period ends and for quiet"
    assert judge.violations == []
    assert [int(f) for f in link.flags[:4]] == counts
    assert np.array_equal(link.dst[:off], link.src[:off])
    assert link.a.violations == [] and link.a.errors == []


@pytest.mark.parametrize("mode", list(SignalMode))
def test_signal_add_and_set(make_link, host_lib, mode: SignalMode) -> None:
    link = make_link()
    chan = link.channel(mode)
    for value, is_set in ((5, 0), (2, 0), (100, 1), (1, 0)):
        host_lib.tpd_test_signal(chan.ptr, 1, 7, value, is_set)
    host_lib.tpd_test_quiet(chan.ptr)
    assert host_lib.tpd_test_status(chan.ptr) == 0
    assert int(link.flags[7]) == 101
    if mode != SignalMode.ATOMIC:
        assert int(chan.shadow[NFLAGS + 7]) == 101, "write/fence modes keep the absolute value per (peer, slot)"


def test_fence_marks_the_next_wqe(make_link, host_lib) -> None:
    link = make_link(wqe_cnt=16)
    chan = link.channel(SignalMode.WRITE)
    host_lib.tpd_test_put(chan.ptr, 1, 0, 0, 0, 0, 4096)
    host_lib.tpd_test_fence(chan.ptr, 1)
    host_lib.tpd_test_put(chan.ptr, 1, 0, 4096, 0, 4096, 4096)
    host_lib.tpd_test_put(chan.ptr, 1, 0, 8192, 0, 8192, 4096)
    host_lib.tpd_test_quiet(chan.ptr)
    wqes = [L.decode_wqe(link.a.sq[64 * i:64 * (i + 1)].tobytes()) for i in range(4)]
    assert [(w.opcode, w.fence, w.length) for w in wqes] == [
        (L.Opcode.RDMA_WRITE, False, 4096), (L.Opcode.RDMA_READ, False, 0),
        (L.Opcode.RDMA_WRITE, True, 4096), (L.Opcode.RDMA_WRITE, False, 4096)]
    assert np.array_equal(link.dst[:12288], link.src[:12288])


@pytest.mark.parametrize("mode", list(SignalMode))
def test_many_threads_post_at_once(make_link, host_lib, mode: SignalMode) -> None:
    """8 native threads x 100 put_signal + signal each, through a 64-slot send queue (~40 laps)."""
    link = make_link(wqe_cnt=64)
    chan = link.channel(mode)
    threads, iters, nbytes, slots = 8, 100, 1024, 4
    assert threads * iters * nbytes <= DATA_BYTES
    host_lib.tpd_test_stress(chan.ptr, 1, threads, iters, nbytes, slots)
    assert host_lib.tpd_test_status(chan.ptr) == 0, link.a.errors
    c = counters(chan)
    assert c["claimed"] == c["posted"] and c["done"] >= c["posted"] - 1 and c["error"] == 0
    assert [int(f) for f in link.flags[:slots + 1]] == [threads // slots * iters] * slots + [threads * iters]
    assert np.array_equal(link.dst[:threads * iters * nbytes], link.src[:threads * iters * nbytes])
    assert link.a.violations == [] and link.a.errors == []
    assert link.a.stats["doorbells"] > 0


def test_bad_commands_are_refused_and_not_posted(make_link, host_lib) -> None:
    link = make_link()
    chan = link.channel()
    lib, ptr = host_lib, chan.ptr
    lib.tpd_test_put(ptr, 5, 0, 0, 0, 0, 64)                       # no such rank
    lib.tpd_test_put(ptr, 0, 0, 0, 0, 0, 64)                       # ourselves: no QP
    lib.tpd_test_put(ptr, 1, 1, 0, 0, 0, 64)                       # region 1 not registered
    lib.tpd_test_put(ptr, 1, 0, DATA_BYTES - 32, 0, 0, 64)         # past the destination's end
    lib.tpd_test_put(ptr, 1, 0, 0, 0, 2**64 - 8, 64)               # offset + length wraps
    lib.tpd_test_put(ptr, 1, 0, 0, 0, 0, 0)                        # zero length
    lib.tpd_test_put_signal(ptr, 1, 0, 0, 0, 0, 64, NFLAGS, 1, 0)  # slot out of range
    lib.tpd_test_signal(ptr, 1, NFLAGS + 3, 1, 0)
    assert lib.tpd_test_status(ptr) == ERR_BAD_PEER, "the first code sticks"
    assert lib.tpd_test_error_count(ptr) == 8
    assert counters(chan)["claimed"] == 0, "nothing was posted"
    lib.tpd_test_put(ptr, 1, 0, 0, 0, 0, 64)  # the good command after them still goes
    lib.tpd_test_quiet(ptr)
    assert np.array_equal(link.dst[:64], link.src[:64])
    assert lib.tpd_test_error_count(ptr) == 8


def test_bad_codes_one_by_one(make_link, host_lib) -> None:
    link = make_link()
    cases = [
        (lambda p: host_lib.tpd_test_put(p, 1, 3, 0, 0, 0, 64), ERR_BAD_REGION),
        (lambda p: host_lib.tpd_test_put(p, 1, 0, DATA_BYTES, 0, 0, 1), ERR_OUT_OF_BOUNDS),
        (lambda p: host_lib.tpd_test_put(p, 1, 0, 0, 0, 0, 0), ERR_BAD_LENGTH),
        (lambda p: host_lib.tpd_test_signal(p, 1, NFLAGS, 1, 0), ERR_BAD_SLOT),
    ]
    for call, code in cases:
        chan = link.channel()
        call(chan.ptr)
        assert (host_lib.tpd_test_status(chan.ptr), host_lib.tpd_test_error_count(chan.ptr)) == (code, 1)


def test_completion_error_reaches_status_and_nothing_hangs(make_link, host_lib) -> None:
    link = make_link(wqe_cnt=16)
    chan = link.channel(SignalMode.ATOMIC, dst_rkey=link.mr_dst.rkey ^ 0x777700)
    for i in range(40):  # far more than the send queue: every WQE after the failure flushes, posting goes on
        host_lib.tpd_test_put_signal(chan.ptr, 1, 0, 1024 * i, 0, 1024 * i, 1024, 0, 1, 0)
    host_lib.tpd_test_quiet(chan.ptr)
    assert host_lib.tpd_test_status(chan.ptr) == ERR_REMOTE_ACCESS
    c = counters(chan)
    assert c["error"] & 0xFF == L.Syndrome.REMOTE_ACCESS_ERR and c["done"] >= c["posted"] - 1
    assert int(link.flags[0]) == 0 and not link.dst.any()
    assert "ibv_wc_status 10" in link.a.errors[0]


def test_quiet_when_idle_posts_nothing(make_link, host_lib) -> None:
    link = make_link()
    chan = link.channel()
    host_lib.tpd_test_quiet(chan.ptr)
    assert counters(chan)["claimed"] == 0 and link.a.stats["wqes"] == 0


def test_wait_reads_this_ranks_flags(make_link, host_lib) -> None:
    link = make_link()
    chan = link.channel()
    chan.own_flags[3] = 2**64 - 1  # wraparound-safe: 2^64-1 is "before" 1
    chan.own_flags[4] = 9
    assert host_lib.tpd_test_wait(chan.ptr, 4, 9) == 9
    assert host_lib.tpd_test_wait(chan.ptr, 3, 2**64 - 2) == 2**64 - 1


def test_quiet_after_a_cqe_inside_the_last_batch(make_link, host_lib) -> None:
    """Three fenced put_signals on a 32-slot queue: WQEBB 7 ends a CQE period inside the third batch
    [6, 9). signaled must say 8, not 9, so quiet posts its probe instead of waiting for a CQE that never
    comes (it spun until the bound before)."""
    link = make_link(wqe_cnt=32)
    chan = link.channel(SignalMode.FENCE)
    for i in range(3):
        host_lib.tpd_test_put_signal(chan.ptr, 1, 0, 64 * i, 0, 64 * i, 64, 0, 1, 0)
    assert counters(chan)["signaled"] == 8 and counters(chan)["posted"] == 9
    host_lib.tpd_test_quiet(chan.ptr)
    c = counters(chan)
    assert c["posted"] == 10 and c["done"] == 10, "quiet posted its probe and waited for it"
    assert int(link.flags[0]) == 3 and np.array_equal(link.dst[:192], link.src[:192])
