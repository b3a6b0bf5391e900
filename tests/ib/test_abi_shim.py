"""The compiled ib lowering (ib/csrc/ib_post.c), call by call, at the libibverbs ABI.

A recording NIC: ShimQP / ShimCQ structs whose wr_complete hands each WR list to Python, where this
file keeps them (and completes every signaled WR on the next poll). So what the tests see is exactly what
reached ``wr_rdma_write``, ``wr_rdma_read``, ``wr_atomic_fetch_add``, ``wr_set_sge``,
``wr_set_inline_data``, ``wr_id`` and ``wr_flags``; it is compared with the Python lowering the backend
used to run (transportd_models/ib_lowering.py) for every signal mode, inline and not, and through the proxy's
engine with decoupled signaling on and off.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import uuid
from typing import Any

import numpy as np
import pytest

from cmd_ring import Command, Flag, Opcode, RingFile, RingProducer, records_from_commands
from tests.support.waiting import wait_until
from transportd import _core
from transportd.backends.interface import PLAN_DTYPE, PlanOp, SignalOp
from transportd.backends.null import NullBackend
from transportd.backends.verbs_common import WC_DTYPE
from transportd.backends.verbs_shim import SHIM_WR_DTYPE, WR_OPCODES
from transportd.dataplane.proxy import SERVE_INTERRUPTED, Proxy
from transportd.dataplane.worker import serve_policy
from transportd.errors import BackendError, SendQueueFullError, VerbsError
from transportd_models.ib_lowering import FENCE, SIGNALED, OracleConn, calls_of

MODES = ("write", "atomic", "fence")
WRITE, READ, FADD = WR_OPCODES["wr_rdma_write"], WR_OPCODES["wr_rdma_read"], WR_OPCODES["wr_atomic_fetch_add"]
SCRATCH_LKEY, STAGING_LKEY = 0x51, 0x77
REM_ACCESS_ERR, WR_FLUSH_ERR = 10, 5


class RecordingNic:
    """An IbPoster over recording shims; ``posts`` holds (conn_id, records) per wr_complete."""

    name = "ib"  # the kind whose traits it stands for: a compiled poster (``c_poster``)

    def __init__(self, mode: str, *, fetch: int = 1024) -> None:
        self.mode = mode
        self.posts: list[tuple[int, np.ndarray]] = []
        self.pending: list[tuple[int, int]] = []  # (wr_id, status) the CQ hands out next
        self.rc = 0  # what wr_complete returns
        self.fail_next: int | None = None  # status of the next signaled completion, then 0
        self.cq = _core.ShimCQ(self._poll, fetch)
        self.scratch = np.zeros(2, dtype=np.uint64)
        self.poster = _core.IbPoster(self.cq, mode, self.scratch.ctypes.data, SCRATCH_LKEY, BackendError,
                                     SendQueueFullError, VerbsError)
        self.qps: dict[int, Any] = {}
        self.staging: dict[int, np.ndarray] = {}
        self.oracles: dict[int, OracleConn] = {}

    @property
    def c_poster(self) -> Any:  # what Proxy posts to, as the ib kind's traits declare
        return self.poster

    def add(self, conn_id: int, *, depth: int = 64, inline: bool = True, base: int = 1000) -> OracleConn:
        staging = np.zeros(depth, dtype=np.uint64)
        qp = _core.ShimQP(lambda wrs, c=conn_id: self._post(c, wrs), conn_id)
        key = self.poster.add_connection(conn_id, qp, depth, staging.ctypes.data, STAGING_LKEY, base, inline)
        self.poster.connect(conn_id)
        self.qps[conn_id], self.staging[conn_id] = qp, staging
        oracle = OracleConn(self.mode, key, base, depth, inline, staging.ctypes.data, STAGING_LKEY,
                            self.scratch.ctypes.data, SCRATCH_LKEY)
        self.oracles[conn_id] = oracle
        return oracle

    def _post(self, conn_id: int, wrs: bytes) -> int:
        if self.rc:
            return self.rc
        rows = np.frombuffer(wrs, dtype=SHIM_WR_DTYPE).copy()
        self.posts.append((conn_id, rows))
        for wr_id, flags in zip(rows["wr_id"].tolist(), rows["flags"].tolist(), strict=True):
            if flags & SIGNALED:
                status = self.fail_next or 0
                self.fail_next = None
                self.pending.append((wr_id, status))
        return 0

    def _poll(self, n: int) -> np.ndarray:
        take, self.pending = self.pending[:n], self.pending[n:]
        out = np.zeros(len(take), dtype=WC_DTYPE)
        if take:
            out["wr_id"], out["status"] = zip(*take, strict=True)
        return out

    def completions(self, n: int = 4096) -> list[tuple[int, int, int]]:
        rows = np.frombuffer(self.poster.poll(n), dtype=[("token", "<u8"), ("status", "<u4"), ("v", "<u4")])
        return [(int(t), int(s), int(v)) for t, s, v in rows.tolist()]


def row(op: PlanOp, token: int, *, sop: SignalOp = SignalOp.ADD, raddr: int = 0, rkey: int = 0, value: int = 0,
        length: int = 0, laddr: int = 0, lkey: int = 0) -> tuple:
    return (op, sop, 1, length, laddr, raddr, lkey, rkey, value, 0, 0, token)


def random_plan(rng: np.random.Generator, n: int, first_token: int) -> np.ndarray:
    """n random rows over a few flag words, in runs of one token (token 0 mixed in, which ends no run)."""
    rows, token = [], first_token
    for _ in range(n):
        kind = rng.integers(0, 10)
        if kind < 4:
            rows.append(row(PlanOp.WRITE, token, raddr=0x1000 + int(rng.integers(0, 1 << 20)), rkey=0x11,
                            laddr=0x2000 + int(rng.integers(0, 1 << 20)), lkey=0x22, length=int(rng.integers(1, 4096))))
        elif kind < 8:
            slot = int(rng.integers(0, 4))
            rows.append(row(PlanOp.SIGNAL, token, sop=SignalOp(int(rng.integers(0, 2))), raddr=0x9000 + 8 * slot,
                            rkey=0x33 + (slot == 3), value=int(rng.integers(0, 1 << 62))))
        else:
            rows.append(row(PlanOp.FENCE, token))
        if rng.random() < 0.3:
            token = 0 if rng.random() < 0.2 else token + 1
    return np.array(rows, dtype=PLAN_DTYPE)


@pytest.mark.parametrize("inline", (True, False), ids=("inline", "sge"))
@pytest.mark.parametrize("mode", MODES)
def test_every_call_matches_the_python_lowering(mode: str, inline: bool) -> None:
    """Random plans on two connections, many passes: the same calls with the same arguments, in order."""
    rng = np.random.default_rng(hash((mode, inline)) & 0xFFFF)
    nic = RecordingNic(mode)
    oracles = {c: nic.add(c, depth=4096, inline=inline, base=int(rng.integers(0, 1 << 40))) for c in (3, 9)}
    token = 1
    for _ in range(60):
        ids, plans = [], []
        for _ in range(int(rng.integers(1, 4))):
            conn = int(rng.choice([3, 9]))
            plan = random_plan(rng, int(rng.integers(1, 12)), token)
            token = int(plan["token"].max()) + 1
            ids.append(conn)
            plans.append(plan)
        bounds = np.cumsum([0] + [len(p) for p in plans])
        nic.posts.clear()
        nic.poster.post_batches(np.array(ids, dtype=np.int64), np.concatenate(plans), bounds.astype(np.int64))
        # consecutive batches of one connection are one WR list
        expect, i = [], 0
        while i < len(ids):
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            expect.append((ids[i], oracles[ids[i]].post(np.concatenate(plans[i:j]))))
            i = j
        got = [(conn, calls_of(rows)) for conn, rows in nic.posts]
        assert got == expect
        if not inline:  # the SGE points at the staging slot, which holds the flag's value
            for conn, rows in nic.posts:
                for r in rows[(rows["opcode"] == WRITE) & (rows["sge_lkey"] == STAGING_LKEY)]:
                    slot = (int(r["sge_addr"]) - nic.staging[conn].ctypes.data) // 8
                    assert slot == (int(r["wr_id"]) & ((1 << 48) - 1)) % 4096
        nic.completions()


def test_write_mode_calls() -> None:
    nic = RecordingNic("write")
    nic.add(1, base=0)
    plan = np.array([row(PlanOp.WRITE, 1, raddr=0x100, rkey=7, laddr=0x200, lkey=8, length=64),
                     row(PlanOp.SIGNAL, 1, raddr=0x900, rkey=9, value=5),
                     row(PlanOp.SIGNAL, 1, raddr=0x900, rkey=9, value=2)], dtype=PLAN_DTYPE)
    assert nic.poster.post(1, plan) == 3
    key = 1 << 48
    (conn, rows), = nic.posts
    calls = calls_of(rows)
    assert calls[0] == (WRITE, key | 1, 0, 7, 0x100, 0, (0x200, 64, 8), None)
    assert calls[1] == (WRITE, key | 2, 0, 9, 0x900, 0, None, (5).to_bytes(8, "little")), "shadow 0 + 5, inline"
    assert calls[2] == (WRITE, key | 3, SIGNALED, 9, 0x900, 0, None, (7).to_bytes(8, "little")), "last signaled"


def test_atomic_mode_calls() -> None:
    nic = RecordingNic("atomic")
    nic.add(1, base=0)
    scratch = nic.scratch.ctypes.data
    plan = np.array([row(PlanOp.SIGNAL, 1, raddr=0x900, rkey=9, value=5),
                     row(PlanOp.SIGNAL, 1, sop=SignalOp.SET, raddr=0x908, rkey=9, value=42)], dtype=PLAN_DTYPE)
    assert nic.poster.post(1, plan) == 3
    calls = calls_of(nic.posts[0][1])
    key = 1 << 48
    assert calls[0] == (FADD, key | 1, 0, 9, 0x900, 5, (scratch, 8, SCRATCH_LKEY), None), "ADD: fetch-and-add"
    assert calls[1] == (READ, key | 2, 0, 9, 0x908, 0, (scratch + 8, 0, SCRATCH_LKEY), None), "ordering read"
    assert calls[2] == (WRITE, key | 3, FENCE | SIGNALED, 9, 0x908, 0, None, (42).to_bytes(8, "little"))


def test_fence_mode_and_fence_rows() -> None:
    nic = RecordingNic("fence")
    nic.add(1, base=0)
    plan = np.array([row(PlanOp.WRITE, 1, raddr=0x100, rkey=7, laddr=0x200, lkey=8, length=64),
                     row(PlanOp.FENCE, 1),
                     row(PlanOp.SIGNAL, 1, raddr=0x900, rkey=9, value=1)], dtype=PLAN_DTYPE)
    assert nic.poster.post(1, plan) == 3, "the FENCE's ordering read also serves the signal after it"
    ops = [(c[0], c[2]) for c in calls_of(nic.posts[0][1])]
    assert ops == [(WRITE, 0), (READ, 0), (WRITE, FENCE | SIGNALED)]
    # a FENCE ending a post fences the first WR of the next one
    nic.poster.post(1, np.array([row(PlanOp.FENCE, 2)], dtype=PLAN_DTYPE))
    nic.poster.post(1, np.array([row(PlanOp.WRITE, 3, length=8)], dtype=PLAN_DTYPE))
    assert [(c[0], c[2]) for c in calls_of(nic.posts[2][1])] == [(WRITE, FENCE | SIGNALED)]


def test_a_full_send_queue_refuses_the_whole_post_and_changes_nothing() -> None:
    nic = RecordingNic("write")
    oracle = nic.add(1, depth=8, base=0)
    sig = row(PlanOp.SIGNAL, 1, raddr=0x900, rkey=9, value=1)
    with pytest.raises(SendQueueFullError):
        nic.poster.post(1, np.array([sig] * 9, dtype=PLAN_DTYPE))
    assert nic.posts == [] and nic.qps[1].calls == 0 and nic.poster.inflight(1) == 0
    plan = np.array([sig], dtype=PLAN_DTYPE)
    nic.poster.post(1, plan)
    assert calls_of(nic.posts[0][1]) == oracle.post(plan), "no shadow value or WR number moved"


def test_wr_complete_errno_is_a_verbs_error_and_rolls_back() -> None:
    nic = RecordingNic("write")
    oracle = nic.add(1, base=0)
    plan = np.array([row(PlanOp.SIGNAL, 1, raddr=0x900, rkey=9, value=3)], dtype=PLAN_DTYPE)
    nic.rc = errno.ENOMEM
    with pytest.raises(VerbsError) as info:
        nic.poster.post(1, plan)
    assert info.value.errno == errno.ENOMEM and "ibv_wr_complete" in str(info.value)
    nic.rc = 0
    nic.poster.post(1, plan)
    assert calls_of(nic.posts[0][1]) == oracle.post(plan)


def test_a_failed_batch_flushes_the_rest_and_a_qp_in_error_is_not_touched() -> None:
    nic = RecordingNic("write")
    nic.add(1, base=0)
    w = row(PlanOp.WRITE, 0, length=8)
    nic.poster.post(1, np.array([w[:-1] + (1,)], dtype=PLAN_DTYPE))
    assert nic.completions() == [(1, 0, 0)]
    nic.fail_next = REM_ACCESS_ERR
    nic.poster.post(1, np.array([w[:-1] + (2,), w[:-1] + (2,)], dtype=PLAN_DTYPE))
    nic.poster.post(1, np.array([w[:-1] + (3,)], dtype=PLAN_DTYPE))
    # the provider completes the failed WR with its status and flushes the next one
    nic.pending[1:] = [(nic.pending[1][0], WR_FLUSH_ERR)]
    assert nic.completions() == [(2, REM_ACCESS_ERR, 0), (3, WR_FLUSH_ERR, 0)]
    calls = nic.qps[1].calls
    assert nic.poster.post(1, np.array([w[:-1] + (4,)], dtype=PLAN_DTYPE)) == 0
    assert nic.qps[1].calls == calls, "nothing reaches a QP in error"
    assert nic.completions() == [(4, WR_FLUSH_ERR, 0)]


def test_stale_completions_are_read_and_ignored() -> None:
    nic = RecordingNic("write")
    nic.add(1, base=0)
    plan = np.array([row(PlanOp.WRITE, t, length=8) for t in range(1, 6)], dtype=PLAN_DTYPE)
    nic.poster.post(1, plan)
    nic.pending.insert(0, ((1 << 48) | 999, 0))  # a WR number never posted on this connection
    nic.pending.insert(0, ((7 << 48) | 1, 0))  # a key no connection has
    assert nic.completions(2) == [], "a poll reads at most max CQ entries; these two settle nothing"
    assert nic.completions(2) == [(1, 0, 0), (2, 0, 0)]
    assert nic.completions(2) == [(3, 0, 0), (4, 0, 0)]
    assert nic.completions(2) == [(5, 0, 0)]
    assert nic.poster.stats()["cqes"] == 7


def test_entries_a_poll_did_not_take_stay_in_the_shim_cq() -> None:
    nic = RecordingNic("write", fetch=8)
    nic.add(1, base=0)
    nic.poster.post(1, np.array([row(PlanOp.WRITE, t, length=8) for t in range(1, 6)], dtype=PLAN_DTYPE))
    assert [t for t, _, _ in nic.completions(3)] == [1, 2, 3]
    assert nic.cq.calls == 1
    assert [t for t, _, _ in nic.completions(3)] == [4, 5], "the rest came from the shim, not a new call"
    assert nic.cq.calls == 1


def test_unknown_and_unconnected_connections() -> None:
    nic = RecordingNic("write")
    with pytest.raises(BackendError, match="unknown connection 5"):
        nic.poster.post(5, np.array([row(PlanOp.WRITE, 1)], dtype=PLAN_DTYPE))
    staging = np.zeros(8, dtype=np.uint64)
    qp = _core.ShimQP(lambda wrs: 0)
    nic.poster.add_connection(5, qp, 8, staging.ctypes.data, 1, 0, True)
    with pytest.raises(BackendError, match="not connected"):
        nic.poster.post(5, np.array([row(PlanOp.WRITE, 1)], dtype=PLAN_DTYPE))


def _fn(capsule: Any, name: str, member: str, restype: Any, *argtypes: Any) -> tuple[int, Any]:
    """(struct address, the function pointer at ``member``) of a shim struct, callable through ctypes."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    base = get(capsule, name.encode())
    addr = ctypes.c_void_p.from_address(base + _core.abi_layout()[f"offset {name}.{member}"]).value
    return base, ctypes.CFUNCTYPE(restype, ctypes.c_void_p, *argtypes)(addr)


def test_shim_wr_lists_are_all_or_nothing() -> None:
    """Called through the struct's own pointers: a setter with no WR fails the WR list, nothing is posted."""
    got: list[bytes] = []
    qp = _core.ShimQP(lambda wrs: got.append(wrs) or 0)
    base, start = _fn(qp.ibv_qp_ex, "ibv_qp_ex", "wr_start", None)
    _, complete = _fn(qp.ibv_qp_ex, "ibv_qp_ex", "wr_complete", ctypes.c_int)
    _, set_sge = _fn(qp.ibv_qp_ex, "ibv_qp_ex", "wr_set_sge", None, ctypes.c_uint32, ctypes.c_uint64,
                     ctypes.c_uint32)
    _, write = _fn(qp.ibv_qp_ex, "ibv_qp_ex", "wr_rdma_write", None, ctypes.c_uint32, ctypes.c_uint64)
    start(base)
    set_sge(base, 1, 0x1000, 8)
    write(base, 2, 0x2000)
    assert complete(base) == errno.EINVAL and got == [] and qp.calls == 0
    start(base)
    ctypes.c_uint64.from_address(base + _core.abi_layout()["offset ibv_qp_ex.wr_id"]).value = 77
    write(base, 2, 0x2000)
    set_sge(base, 1, 0x1000, 8)
    assert complete(base) == 0 and qp.calls == 1
    assert calls_of(got[0]) == [(WRITE, 77, 0, 2, 0x2000, 0, (0x1000, 8, 1), None)]


def test_one_completion_settling_several_batches_is_carried_past_max() -> None:
    nic = RecordingNic("write")
    nic.add(1, base=0)
    nic.poster.post(1, np.array([row(PlanOp.WRITE, t, length=8) for t in range(1, 4)], dtype=PLAN_DTYPE))
    nic.pending = nic.pending[-1:]  # a provider that reported only the last one
    assert nic.completions(1) == [(1, 0, 0)]
    assert nic.completions(1) == [(2, 0, 0)] and nic.completions(1) == [(3, 0, 0)]
    assert nic.poster.stats()["cqes"] == 1 and nic.poster.inflight(1) == 0


def test_the_record_layouts_match_the_shim() -> None:
    from softverbs.soft.batch import BATCH_WR_DTYPE, WC_BATCH_DTYPE

    assert SHIM_WR_DTYPE.itemsize == _core.SHIM_WR_SIZE == BATCH_WR_DTYPE.itemsize
    assert BATCH_WR_DTYPE.descr == SHIM_WR_DTYPE.descr and WC_BATCH_DTYPE.descr == WC_DTYPE.descr
    assert WC_DTYPE.itemsize == _core.SHIM_WC_SIZE


# --- through the engine: the proxy posts through the C poster, decoupled or not -----------------------------

JOB, WORLD = "job", 3
SRC, DST, FLAGS = 0x10_0000, 0x100_0000, 0x900_0000


def _proxy(backend: Any, decoupled: bool) -> Proxy:
    proxy = Proxy(backend, decoupled=decoupled, poll_window_us=0.0)
    proxy.set_source_region(JOB, 0, 0, SRC, 1 << 20, 1)
    for peer in (1, 2):
        proxy.set_remote_region(JOB, peer, 0, DST * peer, 1 << 20, 10 + peer)
        proxy.set_remote_flags(JOB, peer, FLAGS + 0x1000 * peer, 8, 20 + peer)
        proxy.bind_peer(JOB, peer, 100 + peer)
    return proxy


def _commands(rng: np.random.Generator, n: int) -> list[Command]:
    out = []
    for i in range(n):
        peer, k = int(rng.integers(1, 3)), int(rng.integers(0, 10))
        flags = Flag.SIGNAL_SET if rng.random() < 0.3 else Flag(0)
        if k < 5:
            out.append(Command(Opcode.PUT_SIGNAL, peer=peer, src_off=64 * i, dst_off=64 * i, length=64,
                               signal_slot=int(rng.integers(0, 8)), signal_value=int(rng.integers(1, 9)),
                               flags=flags, chunk_id=i))
        elif k < 7:
            out.append(Command(Opcode.PUT, peer=peer, src_off=64 * i, dst_off=64 * i, length=64, chunk_id=i))
        elif k < 9:
            out.append(Command(Opcode.SIGNAL, peer=peer, signal_slot=int(rng.integers(0, 8)),
                               signal_value=int(rng.integers(1, 9)), flags=flags))
        else:
            out.append(Command(Opcode.FENCE, peer=peer))
    return out


def _run(backend: Any, decoupled: bool, commands: list[Command], serve: bool = False) -> None:
    """Drain ``commands`` pass by pass (``run_once``), or with ``serve`` through the rail worker's loop in
    the engine (``Proxy.serve``, GIL released), run in a thread until every command completed."""
    proxy = _proxy(backend, decoupled)
    ring = RingFile.create(f"tpd-test-abi-{os.getpid()}-{uuid.uuid4().hex[:8]}", 1024)
    try:
        proxy.add_channel(1, ring, JOB, 0, WORLD)
        assert RingProducer(ring).push_records(records_from_commands(commands), block=False)
        if serve:  # the ring's own words are read here: a proxy call from this thread would interrupt the loop
            reasons: list[int] = []
            loop = threading.Thread(target=lambda: reasons.append(proxy.serve(**serve_policy(backend))))
            loop.start()
            wait_until(lambda: ring.completion_pos == len(commands), "the serve loop to drain the ring")
            proxy.interrupt()
            loop.join(10)
            assert reasons == [SERVE_INTERRUPTED] and proxy.loop_stats()["busy"] > 0
        else:
            for _ in range(64):
                proxy.run_once()
        assert proxy.completion_position(1) == len(commands)
    finally:
        ring.close()
        ring.unlink()


@pytest.mark.parametrize("loop", ("run_once", "serve"))
@pytest.mark.parametrize("decoupled", (False, True), ids=("coupled", "decoupled"))
@pytest.mark.parametrize("mode", MODES)
def test_the_engine_posts_through_the_c_poster(mode: str, decoupled: bool, loop: str) -> None:
    """The engine's plans (recorded with the null backend) lowered by the oracle == what reached the shims,
    pass by pass or inside the engine's serve loop (where each shim's Python call takes the GIL itself)."""
    commands = _commands(np.random.default_rng(7), 300)
    null = NullBackend(keep_plans=True)
    _run(null, decoupled, commands)
    nic = RecordingNic(mode)
    for conn in (101, 102):
        nic.add(conn, depth=1024, base=conn << 20)
    _run(nic, decoupled, commands, serve=loop == "serve")
    for conn in (101, 102):
        plans = null.plans[conn]
        expect = nic.oracles[conn].post(np.concatenate(plans)) if plans else []
        got = [c for cid, rows in nic.posts if cid == conn for c in calls_of(rows)]
        assert got == expect, f"connection {conn}"
    # one Python call per connection per pass on each side, never one per WR
    wrs = sum(len(rows) for _, rows in nic.posts)
    assert sum(qp.calls for qp in nic.qps.values()) == len(nic.posts) < wrs
    assert nic.poster.stats()["wrs"] == wrs
