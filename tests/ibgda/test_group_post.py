"""Aggregated posting (queue_pair.cuh's post_group: the steps tpd::warp_put / warp_put_signal run across a
warp's lanes, here in one host thread) against single posts: the same WQEs byte for byte, in command order,
one claim and one doorbell per group_cap WQEBBs, the doorbell record at the final producer index; and the
same data, flags and flag rule when the soft NIC executes them."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from ibgda import mlx5_layout as L
from ibgda.channel_tables import HostAlloc, build_channel
from ibgda.device_handle import QP_STATE_DTYPE, SignalMode, queue_pair_record
from ibgda.queue_memory import QueueMemory
from tests.support.ibgda_link import DATA_BYTES, NFLAGS, FlagJudge, view

GROUP_CMD_DTYPE = np.dtype([("kind", "<u4"), ("peer", "<u4"), ("dst_off", "<u8"), ("src_off", "<u8"),
                            ("bytes", "<u4"), ("slot", "<u4"), ("value", "<u8"), ("set", "<u4"),
                            ("dst_region", "<u4")])
assert GROUP_CMD_DTYPE.itemsize == 48  # host_lib.cpp's GroupCmd
NO_WQE = 2**64 - 1
PUT, PUT_SIGNAL = 0, 1
ERR_BAD_REGION, ERR_BAD_LENGTH = 3, 5


@dataclass
class Cmd:
    kind: int
    dst_off: int
    bytes: int
    slot: int = 0
    value: int = 0
    set: bool = False
    dst_region: int = 0

    @property
    def good(self) -> bool:
        return self.bytes > 0 and self.dst_region == 0


def wqes_of(cmd: Cmd, mode: SignalMode) -> list[tuple[int, bool]]:
    """(opcode, fenced) of the WQEs one command posts (channel.cuh's table), refused ones none."""
    if not cmd.good:
        return []
    w, r, fa = L.Opcode.RDMA_WRITE, L.Opcode.RDMA_READ, L.Opcode.ATOMIC_FA
    if cmd.kind == PUT:
        return [(w, False)]
    if mode == SignalMode.WRITE:
        return [(w, False), (w, False)]
    if mode == SignalMode.ATOMIC and not cmd.set:
        return [(w, False), (fa, False)]
    return [(w, False), (r, False), (w, True)]


def claims_of(cmds: list[Cmd], mode: SignalMode, cap: int) -> int:
    """Claims (= doorbells) a group takes: a command goes to the claim offset // cap (queue_pair.cuh)."""
    off, last = 0, None
    for c in cmds:
        n = len(wqes_of(c, mode))
        if n:
            last = off
        off += n
    return 0 if last is None else last // cap + 1


class BareQueue:
    """A tpd::IbgdaChannel over a queue nobody executes: posting only stores WQEs and rings (no CQEs, so
    at most wqe_cnt WQEBBs may be posted); the state, shadow and error words are live views."""

    def __init__(self, mode: SignalMode, wqe_cnt: int) -> None:
        self.mem = QueueMemory(wqe_cnt, wqe_cnt, with_uar_page=True)
        qp = queue_pair_record(self.mem.addresses(), qpn=0x4242, wqe_cnt=wqe_cnt, ncqes=wqe_cnt, scratch=0x1000,
                               scratch_lkey=0x5)
        self.flags = np.zeros(NFLAGS, dtype=np.uint64)
        self.alloc = HostAlloc()
        tables = build_channel(rank=0, world=2, alloc=self.alloc, signal_mode=mode, flags=self.flags.ctypes.data,
                               flag_count=NFLAGS, queue_pairs={1: qp}, local_regions=[(0x10000, DATA_BYTES, 0x11)],
                               remote_regions={1: [(0x20000, DATA_BYTES, 0x22)]},
                               remote_flags={1: (0x40000, 8 * NFLAGS, 0x33)})
        self.record = tables.record
        self.state = view(tables.qp_states[1], QP_STATE_DTYPE, 1)
        self.shadow = view(tables.shadow, np.dtype(np.uint64), 2 * NFLAGS)
        self.error = view(tables.error, np.dtype(np.uint32), 2)

    @property
    def ptr(self) -> int:
        return int(self.record.ctypes.data)

    def counters(self) -> dict[str, int]:
        s = self.state[0]
        return {k: int(s[k]) for k in ("claimed", "posted", "signaled", "fence_next", "rings")}

    def wqes(self, n: int) -> list[L.DecodedWqe]:
        return [L.decode_wqe(self.mem.sq[64 * i:64 * (i + 1)].tobytes()) for i in range(n)]


def post_single(lib, ptr: int, c: Cmd) -> None:
    if c.kind == PUT:
        lib.tpd_test_put(ptr, 1, c.dst_region, c.dst_off, 0, c.dst_off, c.bytes)
    else:
        lib.tpd_test_put_signal(ptr, 1, c.dst_region, c.dst_off, 0, c.dst_off, c.bytes, c.slot, c.value, int(c.set))


def post_group(lib, ptr: int, cmds: list[Cmd]) -> list[int]:
    arr = np.zeros(len(cmds), dtype=GROUP_CMD_DTYPE)
    for i, c in enumerate(cmds):
        arr[i] = (c.kind, 1, c.dst_off, c.dst_off, c.bytes, c.slot, c.value, int(c.set), c.dst_region)
    first_of = np.zeros(len(cmds), dtype=np.uint64)
    lib.tpd_test_post_group(ptr, arr.ctypes.data, len(cmds), first_of.ctypes.data)
    return [int(x) for x in first_of]


def random_cmds(rng: random.Random, count: int, kinds: tuple[int, ...], bad: bool) -> list[Cmd]:
    cmds = []
    for i in range(count):
        c = Cmd(rng.choice(kinds), i * 4096, rng.choice((8, 64, 4096)), rng.randrange(3), rng.randint(1, 9),
                rng.random() < 0.25)
        if bad and i % 7 == 3:
            c.bytes = 0          # BAD_LENGTH
        if bad and i % 11 == 5:
            c.dst_region = 3     # BAD_REGION
        cmds.append(c)
    return cmds


@pytest.mark.parametrize("mode", list(SignalMode))
@pytest.mark.parametrize(("kinds", "count", "wqe_cnt", "fence_first", "bad"), [
    ((PUT,), 32, 64, False, False),                # 32 WQEBBs: one claim (cap 32)
    ((PUT_SIGNAL,), 1, 64, False, False),
    ((PUT_SIGNAL,), 20, 64, True, False),          # 40-60 WQEBBs: cut in two claims; a pending fence first
    ((PUT, PUT_SIGNAL), 32, 256, False, True),     # refused commands in the middle post nothing
    ((PUT, PUT_SIGNAL), 32, 256, True, False),
], ids=["put32", "put_signal1", "put_signal20-split-fenced", "mixed-refused", "mixed-fenced"])
def test_group_stores_exactly_what_single_posts_store(host_lib, mode: SignalMode, kinds: tuple[int, ...], count: int,
                                                      wqe_cnt: int, fence_first: bool, bad: bool) -> None:
    rng = random.Random(hash((int(mode), kinds, count, fence_first, bad)) & 0xFFFF)
    cmds = random_cmds(rng, count, kinds, bad)
    single, group = BareQueue(mode, wqe_cnt), BareQueue(mode, wqe_cnt)
    for q in (single, group):
        q.shadow[NFLAGS + 1] = 40  # a slot's running value from earlier launches
        if fence_first:
            host_lib.tpd_test_fence(q.ptr, 1)
    for c in cmds:
        post_single(host_lib, single.ptr, c)
    first_of = post_group(host_lib, group.ptr, cmds)

    expect = [w for c in cmds for w in wqes_of(c, mode)]
    start = 1 if fence_first else 0
    total = start + len(expect)
    assert total <= wqe_cnt
    assert np.array_equal(group.mem.sq, single.mem.sq), "the group stored other bytes than single posts"
    decoded = group.wqes(total)
    assert [w.wqe_index for w in decoded] == list(range(total))
    assert [(w.opcode, w.fence) for w in decoded[start:start + 1]] == [(expect[0][0], fence_first or expect[0][1])]
    assert [(w.opcode, w.fence) for w in decoded[start + 1:]] == expect[1:], "command order within the group"

    s, g = single.counters(), group.counters()
    claims = claims_of(cmds, mode, wqe_cnt // 2)
    assert g["rings"] == start + claims and s["rings"] == start + sum(1 for c in cmds if c.good)
    assert {k: v for k, v in g.items() if k != "rings"} == {k: v for k, v in s.items() if k != "rings"}
    assert g["claimed"] == g["posted"] == total
    # one doorbell record update per claim, ending at the final producer index; the doorbell carries the last WQE
    assert group.mem.dbrec[L.SND_DBR] == single.mem.dbrec[L.SND_DBR] == L.sq_dbrec_value(total)
    assert int(group.mem.doorbell[0]) == int(single.mem.doorbell[0])
    assert int(group.mem.doorbell[0]) == int.from_bytes(group.mem.sq[64 * (total - 1):64 * (total - 1) + 8], "little")
    assert np.array_equal(group.shadow, single.shadow)
    assert tuple(group.error) == tuple(single.error)
    if bad:
        assert group.error[0] in (ERR_BAD_LENGTH, ERR_BAD_REGION) and group.error[1] > 0
    at = start
    for c, first in zip(cmds, first_of, strict=True):
        n = len(wqes_of(c, mode))
        assert first == (at if n else NO_WQE)
        at += n


def test_split_group_rings_once_per_claim(host_lib) -> None:
    """30 put_signals in write mode (60 WQEBBs) on a 64-slot queue: two claims of 32 and 28, two doorbells."""
    q = BareQueue(SignalMode.WRITE, 64)
    cmds = [Cmd(PUT_SIGNAL, i * 64, 64, 2, 1) for i in range(30)]
    first_of = post_group(host_lib, q.ptr, cmds)
    assert first_of == [2 * i for i in range(30)]
    assert q.counters()["rings"] == 2 and q.counters()["posted"] == 60
    flags = [int.from_bytes(w.inline or b"", "little") for w in q.wqes(60)[1::2]]
    assert flags == list(range(1, 31)), "write-mode flag values run on across the two claims"


@pytest.mark.parametrize(("mode", "adaptive_routing"), [
    (SignalMode.WRITE, False), (SignalMode.ATOMIC, True), (SignalMode.FENCE, True)])
def test_groups_through_the_soft_nic(make_link, host_lib, mode: SignalMode, adaptive_routing: bool) -> None:
    """Groups of 12 put_signals through a 32-slot queue (each group cut in two claims; the queue wraps many
    times): every byte lands, flags count every command, no flag lands before the payload it covers."""
    link = make_link(adaptive_routing=adaptive_routing, seed=3, packet_size=512 if adaptive_routing else None,
                     wqe_cnt=32)
    chan = link.channel(mode)
    judge = FlagJudge(link)
    link.observe(judge)
    groups, per, nbytes, slots = 16, 12, 2048, 3
    assert groups * per * nbytes <= DATA_BYTES
    writes: list[tuple[int, int]] = []
    counts = [0] * slots
    for gi in range(groups):
        cmds = []
        for k in range(per):
            off = (gi * per + k) * nbytes
            slot = (gi + k) % slots
            cmds.append(Cmd(PUT_SIGNAL, off, nbytes, slot, 1))
            writes.append((off, nbytes))
            counts[slot] += 1
            judge.covers.setdefault(slot, []).append(list(writes))
        post_group(host_lib, chan.ptr, cmds)
    host_lib.tpd_test_quiet(chan.ptr)
    assert host_lib.tpd_test_status(chan.ptr) == 0, link.a.errors
    s = chan.state[0]
    assert int(s["claimed"]) == int(s["posted"]) and int(s["error"]) == 0
    per_cmd = 2 if mode == SignalMode.WRITE else 3 if mode == SignalMode.FENCE else 2
    claims = claims_of([Cmd(PUT_SIGNAL, 0, 1)] * per, mode, 16)
    assert int(s["rings"]) in (groups * claims, groups * claims + 1)  # + quiet's probe, when one was needed
    assert int(s["posted"]) in (groups * per * per_cmd, groups * per * per_cmd + 1)
    assert judge.violations == []
    assert [int(f) for f in link.flags[:slots]] == counts
    end = groups * per * nbytes
    assert np.array_equal(link.dst[:end], link.src[:end])
    assert link.a.violations == [] and link.a.errors == []


@pytest.mark.parametrize("mode", list(SignalMode))
def test_many_threads_post_groups_at_once(make_link, host_lib, mode: SignalMode) -> None:
    """6 native threads x 8 groups of 10 put_signals each (20-30 WQEBBs a group, cut in two claims on a
    32-slot queue) contend for one QP's ticket, as warps do: every byte lands, every flag counts."""
    link = make_link(wqe_cnt=32)
    chan = link.channel(mode)
    threads, iters, group, nbytes, slots = 6, 8, 10, 1024, 4
    assert threads * iters * group * nbytes <= DATA_BYTES
    host_lib.tpd_test_group_stress(chan.ptr, 1, threads, iters, group, nbytes, slots)
    assert host_lib.tpd_test_status(chan.ptr) == 0, link.a.errors
    s = chan.state[0]
    assert int(s["claimed"]) == int(s["posted"]) and int(s["error"]) == 0
    claims = claims_of([Cmd(PUT_SIGNAL, 0, 1)] * group, mode, 16)
    probes = int(s["rings"]) - threads * iters * claims
    assert 0 <= probes <= threads, "one doorbell per claim, plus quiet's probes"
    expect = [0] * slots
    for t in range(threads):
        for k in range(group):
            expect[(t + k) % slots] += iters
    assert [int(f) for f in link.flags[:slots]] == expect
    end = threads * iters * group * nbytes
    assert np.array_equal(link.dst[:end], link.src[:end])
    assert link.a.violations == [] and link.a.errors == []
