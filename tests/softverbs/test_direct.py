"""Direct placement (softverbs._direct): writes from device memory placed by one copy on the responder.

Device memory is emulated here (tests/support/device_memory.py: /dev/shm files behind an accessor, the
ShmCopier installed); the same tests run on a GPU's memory in tests/gpu/test_soft_fabric.py. What they
show: the first write of an allocation crosses the wire while the peer opens it, later ones go as
references; the target's checks fail a direct write exactly as they fail a wire write; a peer that cannot
open the allocation keeps it on the wire; closing the last MR over an allocation closes the peer's
mapping; and between two processes the same holds.
"""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing as mp
import socket
import threading
from typing import Any

import numpy as np
import pytest

from softverbs import _direct, soft
from tests.softverbs import direct_node
from tests.support.device_memory import ShmDeviceMemory
from tests.support.verbs_resources import RCPair, access, no_completion, open_provider, poll

SIZE = 64 << 10


@pytest.fixture
def shm() -> Any:
    with ShmDeviceMemory() as memory:
        yield memory


@pytest.fixture
def provider() -> Any:
    provider = open_provider("soft")
    soft.device_stats("softib0", reset=True)
    return provider


def _write(pair: RCPair, off: int, length: int, *, wr_id: int = 1, rkey: int | None = None,
           raddr: int | None = None) -> Any:
    e = pair.v.enums
    wr = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(off, length), wr_id=wr_id, rkey=rkey,
                      raddr=pair.server.mr.buf + off if raddr is None else raddr)
    pair.client.qp.post_send(wr)
    (wc,) = poll(pair.client.cq)
    return wc


def _image(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("target", ["device", "host"])
def test_device_writes_go_direct_once_the_peer_opened_their_allocation(provider, shm, target: str) -> None:
    with provider.rc_pair(client_memory=shm, server_memory=shm if target == "device" else None) as pair:
        e = pair.v.enums
        image = _image(8 * SIZE, 1)
        pair.client.write_buf(0, image)
        for i in range(8):
            assert _write(pair, i * SIZE, SIZE, wr_id=i).status == e.IBV_WC_SUCCESS
        assert pair.server.read_buf(0, 8 * SIZE) == image
        stats = soft.device_stats("softib0")
        # the first crossed the wire with the IMPORT; the peer (this process) answered before its ack
        assert stats["device_wire_writes"] == 1 and stats["imports_opened"] == 1
        assert stats["direct_sent"] == 7 and stats["direct_placed"] == 7 and stats["direct_bytes"] == 7 * SIZE
        assert stats["direct_ns"] > 0  # the time the responder spent placing them


def test_host_memory_never_goes_direct(provider, shm) -> None:
    with provider.rc_pair() as pair:
        pair.client.write_buf(0, b"x" * SIZE)
        for i in range(3):
            assert _write(pair, 0, SIZE, wr_id=i).status == pair.v.enums.IBV_WC_SUCCESS
        stats = soft.device_stats("softib0")
        assert stats["direct_sent"] == stats["device_wire_writes"] == stats["imports_opened"] == 0


def test_a_trace_stamps_each_run_of_copies_before_its_placements(provider, shm, tmp_path, monkeypatch) -> None:
    """``SOFTVERBS_TRACE``: a run of copies into device memory stamps ``copy <pieces>`` as it is issued, and each
    piece ``placed`` once the run's wait returned, so a trace tells the copy's time from the steps around it."""
    from softverbs import _trace
    from softverbs.soft.trace import read

    with provider.rc_pair(client_memory=shm, server_memory=shm) as pair:
        pair.client.write_buf(0, _image(4 * SIZE, 4))
        assert _write(pair, 0, SIZE, wr_id=0).status == pair.v.enums.IBV_WC_SUCCESS  # the IMPORT's, on the wire
        monkeypatch.setattr(_trace, "DIR", str(tmp_path))
        for i in range(1, 4):
            assert _write(pair, i * SIZE, SIZE, wr_id=i).status == pair.v.enums.IBV_WC_SUCCESS
        monkeypatch.setattr(_trace, "DIR", None)
    steps = [step for _ns, _pid, step in read(tmp_path) if step in ("copy 1", "placed")]
    assert steps == ["copy 1", "placed"] * 3
    assert soft.device_stats("softib0")["direct_placed"] == 3


def _failures(provider: Any, memory: Any) -> list[tuple[int, int]]:
    """(status of the bad write, status of the write posted after it) for each way a target refuses."""
    out = []
    for case in ("rkey", "bounds", "mr_access", "qp_access"):
        v = provider.v
        qp_access = access(v, "IBV_ACCESS_REMOTE_READ") if case == "qp_access" else None
        with provider.rc_pair(client_memory=memory, server_memory=memory, qp_access=qp_access) as pair:
            e = v.enums
            ro = v.mr.MR(pair.pd, SIZE, access(v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ"))
            try:
                # qp_access refuses every write: the agreement is reached on another pair first
                if case != "qp_access":
                    assert _write(pair, 0, 64).status == e.IBV_WC_SUCCESS
                kw = {"rkey": {"rkey": pair.server.mr.rkey ^ 0x100},
                      "bounds": {"raddr": pair.server.mr.buf + pair.server.mr.length - 16},
                      "mr_access": {"rkey": ro.rkey, "raddr": ro.buf},
                      "qp_access": {}}[case]
                bad = _write(pair, 0, 64, wr_id=2, **kw)
                pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, 64), wr_id=3))
                (after,) = poll(pair.client.cq)
                out.append((bad.status, after.status))
            finally:
                ro.close()
    return out


def test_the_target_refuses_a_direct_write_exactly_as_a_wire_write(provider) -> None:
    wire = _failures(provider, None)
    with ShmDeviceMemory() as memory:
        soft.device_stats("softib0", reset=True)
        direct = _failures(provider, memory)
        sent = soft.device_stats("softib0")["direct_sent"]
    e = provider.v.enums
    assert wire == [(e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_WR_FLUSH_ERR)] * 4
    assert direct == wire
    assert sent >= 2  # the rkey and bounds refusals (at least) were direct writes


def test_a_peer_that_cannot_open_the_allocation_keeps_it_on_the_wire(provider, shm, monkeypatch) -> None:
    def refuse(copier: Any, record: bytes) -> Any:
        raise ValueError("the exporter runs on another host")

    monkeypatch.setattr(_direct, "open_import", refuse)
    with provider.rc_pair(client_memory=shm, server_memory=shm) as pair:
        image = _image(4 * SIZE, 2)
        pair.client.write_buf(0, image)
        for i in range(4):
            assert _write(pair, i * SIZE, SIZE, wr_id=i).status == pair.v.enums.IBV_WC_SUCCESS
        assert pair.server.read_buf(0, 4 * SIZE) == image
    stats = soft.device_stats("softib0")
    assert stats["imports_refused"] == 1 and stats["direct_sent"] == 0 and stats["device_wire_writes"] == 4


def test_an_import_is_refused_from_another_host_or_without_a_copier() -> None:
    copier = soft.ShmCopier()
    base = copier.allocate(4096)
    try:
        descriptor, start, size = copier.export_range(base, 16)
        record = _direct.Export(1, descriptor, start, size).record()
        here = _direct.open_import(copier, record)
        assert (here.base, here.size, here.descriptor) == (base, 4096, None)  # this process: nothing opened
        with pytest.raises(ValueError, match="no direct copier"):
            _direct.open_import(None, record)
        other = bytearray(record)
        other[0] ^= 0xFF  # another boot id
        with pytest.raises(ValueError, match="another host"):
            _direct.open_import(copier, bytes(other))
        with pytest.raises(ValueError, match="short"):
            _direct.open_import(copier, record[:10])
    finally:
        copier.free(base)


def test_an_allocation_opened_by_another_copier_is_mapped_there_by_its_path() -> None:
    a, b = soft.ShmCopier(), soft.ShmCopier()
    base = a.allocate(8192)
    try:
        descriptor, start, size = a.export_range(base + 100, 50)
        assert (start, size) == (base, 8192) and a.export_range(base + 8000, 500) is None
        there, mapped = b.open_export(descriptor)
        assert mapped == 8192 and there != base
        ctypes.memmove(base, b"abc" * 10, 30)
        assert ctypes.string_at(there, 30) == b"abc" * 10  # one memory, two mappings
        assert b.opened() == 1
        b.close_export(descriptor)
        assert b.opened() == 0
    finally:
        a.free(base)


# --- two processes ------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_between_two_processes_the_responder_copies_from_the_requester_s_shared_memory(provider, shm) -> None:
    from tests.support.verbs_resources import Side

    v, e = provider.v, provider.v.enums
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=direct_node.responder, args=(there,), daemon=True)
    proc.start()
    try:
        assert here.poll(60), "the responder process did not start"
        remote = here.recv()
        dev_ctx = v.device.Context(name="softib0")
        pd = v.pd.PD(dev_ctx)
        holder = type("P", (), {"v": v, "pd": pd})()
        side = Side(holder, 8 * SIZE, access(v, "IBV_ACCESS_LOCAL_WRITE"), shm)
        side.cq = v.cq.CQ(dev_ctx, 64)
        side.qp = v.qp.QP(pd, v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=side.cq, rcq=side.cq,
                                              cap=v.qp.QPCap(max_send_wr=16, max_recv_wr=16)))
        here.send({"qpn": side.qp.qp_num, "gid": str(dev_ctx.query_gid(1, 0)), "lid": dev_ctx.query_port(1).lid,
                   "psn": side.psn})
        direct_node.to_rts(v, side.qp, remote, side.psn)
        assert here.recv() == "ready"
        image = _image(8 * SIZE, 3)
        side.write_buf(0, image)
        for i in range(8):
            wr = v.wr.SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[side.sge(i * SIZE, SIZE)],
                             send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(remote["rkey"], remote["addr"] + i * SIZE)
            side.qp.post_send(wr)
            assert poll(side.cq)[0].status == e.IBV_WC_SUCCESS
        here.send("state")
        state = here.recv()
        assert state["data"] == image
        assert state["opened"] == 1 and state["stats"]["imports_opened"] == 1
        assert state["stats"]["direct_placed"] == 7
        assert soft.device_stats("softib0")["direct_sent"] == 7
        side.close()  # the last MR over the allocation: FORGET, and the responder unmaps it
        for _ in range(200):
            here.send("state")
            if here.recv()["opened"] == 0:
                break
        else:
            pytest.fail("the responder kept the allocation mapped after its last MR was closed")
        pd.close()
        dev_ctx.close()
    finally:
        here.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# --- RC in order: a run of direct writes, copied with one wait -------------------------------------------------
def _post_chain(pair: RCPair, wrs: list) -> None:
    """Post ``wrs`` linked in one call, so they travel in one frame."""
    for a, b in itertools.pairwise(wrs):
        a.next_wr = b
    pair.client.qp.post_send(wrs[0])


def _agree(pair: RCPair) -> None:
    """One write from the client's device memory: the peer opens the allocation, later writes go direct."""
    assert _write(pair, 0, 64, wr_id=99).status == pair.v.enums.IBV_WC_SUCCESS


@pytest.mark.parametrize("target", ["device", "host"])
def test_rc_direct_writes_posted_together_are_copied_as_one_run(provider, shm, target: str) -> None:
    """In-order RC direct writes arriving together are copied by one ``copy_many`` (one wait on a GPU), in
    order, and each completes only after the run's bytes are in place: the write-with-immediate that ends the
    chain has every earlier write's bytes there when its receive completion appears."""
    n = 16
    with provider.rc_pair(client_memory=shm, server_memory=shm if target == "device" else None) as pair:
        e = pair.v.enums
        _agree(pair)
        image = _image(n * 4096, 5)
        pair.client.write_buf(0, image)
        pair.server.qp.post_recv(pair.v.wr.RecvWR(wr_id=7, num_sge=0))
        shm.copier.runs = shm.copier.copies = 0
        wrs = [pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(i * 4096, 4096), wr_id=i,
                            raddr=pair.server.mr.buf + i * 4096) for i in range(n - 1)]
        wrs.append(pair.send_wr(e.IBV_WR_RDMA_WRITE_WITH_IMM, pair.client.sge((n - 1) * 4096, 4096), wr_id=n - 1,
                                raddr=pair.server.mr.buf + (n - 1) * 4096, imm=5))
        _post_chain(pair, wrs)
        (recv,) = poll(pair.server.cq)
        assert recv.status == e.IBV_WC_SUCCESS and recv.wr_id == 7
        assert pair.server.read_buf(0, n * 4096) == image  # read at the receive completion
        done = poll(pair.client.cq, n)
        assert [w.wr_id for w in done] == list(range(n)) and all(w.status == e.IBV_WC_SUCCESS for w in done)
        assert shm.copier.copies == n
        assert 1 <= shm.copier.runs < n / 2, f"{shm.copier.runs} runs for {n} writes"


FLAG_AT = 3 * 4096 - 8  # where run_flag_run_atomic's flag goes in the server's MR


def run_flag_run_atomic(pair: RCPair) -> None:
    """Two direct writes, a flag write from host memory, then a direct write over the first, an 8-byte direct
    write and an atomic on it, posted as two chains; checks every completion and what each write left: the
    later write won, the flag is there, the atomic read the direct write before it and added to it."""
    e = pair.v.enums
    base = pair.server.mr.buf
    second, value = _image(4096, 7), (0x1234_5678_9ABC).to_bytes(8, "little")
    pair.client.write_buf(0, _image(4096, 6))
    pair.client.write_buf(4096, second)
    pair.client.write_buf(8192, value)
    host = pair.v.mr.MR(pair.pd, 64, access(pair.v, "IBV_ACCESS_LOCAL_WRITE"))  # the flag write's source
    host.write(b"FLAGFLAG", 8, 0)
    try:
        _post_chain(pair, [
            pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, 4096), wr_id=0, raddr=base),
            pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(4096, 4096), wr_id=1, raddr=base + 4096),
            pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, 8, mr=host), wr_id=2, raddr=base + FLAG_AT)])
        _post_chain(pair, [
            pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(4096, 4096), wr_id=3, raddr=base),
            pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(8192, 8), wr_id=4, raddr=base + 2 * 4096),
            pair.send_wr(e.IBV_WR_ATOMIC_FETCH_AND_ADD, pair.client.sge(8192 + 64, 8), wr_id=5,
                         raddr=base + 2 * 4096, add=1)])
        done = poll(pair.client.cq, 6)
    finally:
        host.close()
    assert [w.status for w in done] == [e.IBV_WC_SUCCESS] * 6
    assert pair.server.read_buf(0, 4096) == second  # the direct write after the flag landed after the first
    assert pair.server.read_buf(4096, 4096) == second
    assert pair.server.read_buf(FLAG_AT, 8) == b"FLAGFLAG"
    assert pair.client.read_buf(8192 + 64, 8) == value  # the atomic read what the run wrote before it
    assert int.from_bytes(pair.server.read_buf(2 * 4096, 8), "little") == int.from_bytes(value, "little") + 1


@pytest.mark.parametrize("target", ["device", "host"])
def test_a_run_of_direct_writes_lands_before_what_follows_it_on_the_qp(provider, shm, target: str,
                                                                       monkeypatch) -> None:
    """A wire write (a flag) posted after direct writes is not visible before them: into device memory it joins
    their run, in its place; into a host target its bytes go straight from the socket, after the run was
    copied. A direct write after it lands after it, and an atomic after them all reads the run's value."""
    with provider.rc_pair(client_memory=shm, server_memory=shm if target == "device" else None) as pair:
        _agree(pair)
        base = pair.server.mr.buf
        pair.server.write_buf(0, bytes(3 * 4096))
        copied: list[int] = []  # what the copier placed, in order (offsets into the server's MR)
        flag_seen: list[bool] = []  # as each piece for the first 8 KiB was copied: was the flag there already?
        copy_many = shm.copier.copy_many

        def one_by_one(copies: list) -> None:
            for dst, src, n in copies:
                if dst in (base, base + 4096):
                    flag_seen.append(pair.server.read_buf(FLAG_AT, 8) == b"FLAGFLAG")
                copied.append(dst - base)
                copy_many([(dst, src, n)])

        monkeypatch.setattr(shm.copier, "copy_many", one_by_one)
        soft.device_stats("softib0", reset=True)
        run_flag_run_atomic(pair)
        assert flag_seen == [False, False, True]  # the third: the direct write posted after the flag
        in_run = target == "device"
        assert copied == [0, 4096] + [FLAG_AT] * in_run + [0, 2 * 4096]
        assert soft.device_stats("softib0")["run_wire_writes"] == in_run


def test_a_frame_of_runs_and_host_placements_lands_and_completes_in_post_order(provider, shm) -> None:
    """Two frames of writes. The first: one into the server's host memory, a few direct writes, and host
    memory again (it waits for those direct writes' run). The second: more than a run's worth of direct writes
    (a full run copied in the middle of the frame), one over the first device bytes, and host memory a third
    time. Every write is placed once, in post order (a host write only after the run before it), completes
    in post order, and every byte is the last write's."""
    from softverbs._responder import WRITE_RUN_MAX

    n = WRITE_RUN_MAX + 5  # device writes, each 4 KiB at its own offset
    with provider.rc_pair(client_memory=shm, server_memory=shm) as pair:
        e = pair.v.enums
        _agree(pair)
        image = _image((n + 1) * 4096, 11)
        pair.client.write_buf(0, image)
        base = pair.server.mr.buf
        pair.server.write_buf(0, bytes((n + 1) * 4096))
        host_src = pair.v.mr.MR(pair.pd, 64, access(pair.v, "IBV_ACCESS_LOCAL_WRITE"))
        host_dst = pair.v.mr.MR(pair.pd, 64, access(pair.v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE"))
        host_src.write(b"FIRST...SECOND..THIRD...", 24, 0)
        placed: list[int] = []  # the server's placements in order: device offsets, -1 / -2 / -3 the host writes
        host_at = {host_dst.buf + 8 * i: -1 - i for i in range(3)}
        soft.set_placement_observer(pair.ctx, lambda _qpn, addr, _n: placed.append(host_at.get(addr, addr - base)))
        write = e.IBV_WR_RDMA_WRITE

        def host(i: int) -> Any:
            return pair.send_wr(write, pair.client.sge(8 * i, 8, mr=host_src), rkey=host_dst.rkey,
                                raddr=host_dst.buf + 8 * i)

        def device(src: int, dst: int) -> Any:
            return pair.send_wr(write, pair.client.sge(src * 4096, 4096), raddr=base + dst * 4096)

        frames = [[host(0), *(device(i, i) for i in range(3)), host(1)],
                  [*(device(i, i) for i in range(3, n)), device(n, 0), host(2)]]
        wrs = [wr for frame in frames for wr in frame]
        for i, wr in enumerate(wrs):
            wr.wr_id = i
        try:
            for frame in frames:
                _post_chain(pair, frame)
            done = poll(pair.client.cq, len(wrs))
            assert [w.wr_id for w in done] == list(range(len(wrs)))
            assert all(w.status == e.IBV_WC_SUCCESS for w in done)
            assert host_dst.read(24, 0) == b"FIRST...SECOND..THIRD..."
        finally:
            soft.set_placement_observer(pair.ctx, None)
            host_src.close()
            host_dst.close()
        assert pair.server.read_buf(0, 4096) == image[n * 4096:]  # the later write over offset 0 won
        assert pair.server.read_buf(4096, (n - 1) * 4096) == image[4096:n * 4096]
        assert placed == [-1, 0, 4096, 8192, -2, *(i * 4096 for i in range(3, n)), 0, -3]


def _gate(monkeypatch: Any, copier: Any) -> tuple[Any, Any]:
    """Hold ``copier``'s runs at a gate: (an event set when a run starts, the event that lets it go)."""
    copying, release = threading.Event(), threading.Event()
    copy_many = copier.copy_many

    def gated(copies: list) -> None:
        copying.set()
        assert release.wait(30), "the test never let the copy go"
        copy_many(copies)

    monkeypatch.setattr(copier, "copy_many", gated)
    return copying, release


def _returns_while_the_copy_is_held(copying: Any, release: Any, post: Any, what: str) -> None:
    """``post()``, a post on the QP whose copy the gate (`_gate`) holds, returns before the copy is let go;
    then the copy goes on."""
    try:
        assert copying.wait(10), f"the {what}'s copy never started"
        thread = threading.Thread(target=post)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), f"the post waited for the {what}'s copy"
        assert not release.is_set()
    finally:
        release.set()


def _agree_srd(pair: Any) -> None:
    """`_agree` on an SRD pair."""
    pair.post(pair.client, "write", pair.client.sge(8192, 8), raddr=pair.server.mr.buf + 8192)
    assert poll(pair.client.cq)[0].status == pair.v.enums.IBV_WC_SUCCESS


def test_a_post_on_the_qp_does_not_wait_for_its_run_s_copy(provider, shm, monkeypatch) -> None:
    """While the I/O thread copies a QP's run of direct writes (a copy into GPU memory can take a hundred
    microseconds), the QP's lock is let go: a post on the same QP goes out at once instead of waiting for
    the copy. Once the copy ends, the run completes as before, and so does the post."""
    with provider.rc_pair(client_memory=shm, server_memory=shm) as pair:
        e = pair.v.enums
        _agree(pair)
        pair.client.write_buf(0, _image(4096, 12))
        copying, release = _gate(monkeypatch, shm.copier)
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, 4096), wr_id=1))
        back = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.server.sge(8192, 64), wr_id=2, rkey=pair.client.mr.rkey,
                            raddr=pair.client.mr.buf + 8192)
        _returns_while_the_copy_is_held(copying, release, lambda: pair.server.qp.post_send(back), "run")
        assert [w.status for w in poll(pair.client.cq)] == [e.IBV_WC_SUCCESS]
        assert [w.status for w in poll(pair.server.cq)] == [e.IBV_WC_SUCCESS]
        assert pair.server.read_buf(0, 4096) == _image(4096, 12)


@pytest.mark.parametrize("qp_type", ["rc", "srd"])
def test_a_qp_failed_during_its_copy_answers_what_the_copy_placed_as_a_failed_qp(shm, monkeypatch,
                                                                              qp_type: str) -> None:
    """The copy goes with the QP's lock let go, so another thread can move the QP to the error state
    meanwhile; what the copy then completes is answered as a QP in error answers a request: the requester's
    write fails, and the failed QP queues no receive completion for it."""
    provider = open_provider("soft")
    pairs = provider.rc_pair if qp_type == "rc" else provider.srd_pair
    with pairs(client_memory=shm, server_memory=shm) as pair:
        e = pair.v.enums
        (_agree if qp_type == "rc" else _agree_srd)(pair)
        copying, release = _gate(monkeypatch, shm.copier)
        if qp_type == "rc":
            pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, 4096), wr_id=1))
        else:
            pair.post(pair.client, "write_imm", pair.client.sge(0, 4096), wr_id=1, raddr=pair.server.mr.buf, imm=7)
        try:
            assert copying.wait(10), "the copy never started"
            pair.server.qp.modify(pair.v.qp.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        finally:
            release.set()
        (done,) = poll(pair.client.cq)
        assert done.wr_id == 1 and done.status != e.IBV_WC_SUCCESS
        assert no_completion(pair.server.cq)


def test_a_refused_write_after_a_run_fails_after_the_run_completes(provider, shm) -> None:
    """Direct writes held in a run, then one the target refuses: the run's bytes land and its writes succeed,
    the refused one fails with a remote access error, and what was posted after it is flushed unplaced."""
    with provider.rc_pair(client_memory=shm, server_memory=shm) as pair:
        e = pair.v.enums
        _agree(pair)
        image = _image(4 * 4096, 8)
        pair.client.write_buf(0, image)
        pair.server.write_buf(0, bytes(4 * 4096))
        base = pair.server.mr.buf
        wrs = [pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(i * 4096, 4096), wr_id=i, raddr=base + i * 4096,
                            rkey=pair.server.mr.rkey ^ (0x100 if i == 2 else 0)) for i in range(4)]
        _post_chain(pair, wrs)
        done = poll(pair.client.cq, 4)
        assert [w.status for w in done] == [e.IBV_WC_SUCCESS, e.IBV_WC_SUCCESS, e.IBV_WC_REM_ACCESS_ERR,
                                            e.IBV_WC_WR_FLUSH_ERR]
        assert pair.server.read_buf(0, 2 * 4096) == image[:2 * 4096]
        assert pair.server.read_buf(2 * 4096, 2 * 4096) == bytes(2 * 4096)


# --- SRD: unordered at packet granularity, direct or not ----------------------------------------------------
def srd_write_imm_order(memory: Any, n: int = 48, size: int = 6000, **packets: Any) -> tuple[list[int], dict]:
    """``n`` write-with-imm of ``size`` bytes from ``memory`` into ``memory`` over SRD, packets shuffled; at
    each receive completion the message's bytes must all be there. The completion order and the stats."""
    provider = open_provider("soft")
    soft.configure("softefa0", reorder_seed=7, **packets)
    soft.device_stats("softefa0", reset=True)
    try:
        with provider.srd_pair(max_send_wr=128, client_memory=memory, server_memory=memory) as pair:
            e = pair.v.enums
            pair.post(pair.client, "write", pair.client.sge(n * size, 8), raddr=pair.server.mr.buf + n * size)
            assert poll(pair.client.cq)[0].status == e.IBV_WC_SUCCESS  # the agreement, before the trial
            image = _image(n * size, 4)
            pair.client.write_buf(0, image)
            for i in range(n):
                pair.post(pair.client, "write_imm", pair.client.sge(i * size, size), wr_id=i,
                          raddr=pair.server.mr.buf + i * size, imm=i)
            order = []
            for _ in range(n):
                (recv,) = poll(pair.server.cq)
                assert recv.status == e.IBV_WC_SUCCESS
                i = socket.ntohl(recv.imm_data)
                assert pair.server.read_buf(i * size, size) == image[i * size:(i + 1) * size], f"message {i} torn"
                order.append(i)
            assert sorted(w.wr_id for w in poll(pair.client.cq, n)) == list(range(n))
            return order, soft.device_stats("softefa0")
    finally:
        defaults = soft.DeviceOptions()
        soft.configure("softefa0", reorder_seed=None, packet_size=None, direct_packet_size=defaults.direct_packet_size)


@pytest.mark.parametrize("packets", [{"packet_size": 512}, {"direct_packet_size": 1024}], ids=["packet", "direct"])
def test_srd_direct_write_imm_completes_after_all_its_packets_in_any_order(shm, packets: dict) -> None:
    order, stats = srd_write_imm_order(shm, **packets)
    assert sorted(order) == list(range(48)) and order != sorted(order)
    per_message = -(-6000 // next(iter(packets.values())))
    assert stats["direct_sent"] == 48 and stats["direct_placed"] == 48 * per_message  # one copy per packet


def test_srd_direct_packets_taken_together_are_copied_as_one_run(shm) -> None:
    """The pool's direct packets given up back to back are placed by one ``copy_many`` (one wait on a GPU),
    still one copy a packet in the pool's shuffled order, and each message still completes only after all of
    its bytes are in place (``srd_write_imm_order`` checks every message at its completion)."""
    shm.copier.runs = shm.copier.copies = 0
    order, stats = srd_write_imm_order(shm, direct_packet_size=1024)
    assert sorted(order) == list(range(48))
    packets = 48 * -(-6000 // 1024)
    assert stats["direct_placed"] == packets and shm.copier.copies == packets
    assert 1 <= shm.copier.runs < packets / 2, f"{shm.copier.runs} runs for {packets} packets"


def test_a_post_on_the_srd_qp_does_not_wait_for_the_pool_s_copy(shm, monkeypatch) -> None:
    """efa's one SRD QP carries both directions of a rail. While the I/O thread copies the reorder pool's
    direct packets into place, the QP's lock is let go: a post on the same QP goes out at once. Once the copy
    ends, the write-with-immediate completes on both sides and its bytes are there."""
    provider = open_provider("soft")
    with provider.srd_pair(client_memory=shm, server_memory=shm) as pair:
        e = pair.v.enums
        _agree_srd(pair)
        image = _image(4096, 13)
        pair.client.write_buf(0, image)
        copying, release = _gate(monkeypatch, shm.copier)
        pair.post(pair.client, "write_imm", pair.client.sge(0, 4096), wr_id=1, raddr=pair.server.mr.buf, imm=7)
        _returns_while_the_copy_is_held(
            copying, release, lambda: pair.post(pair.server, "write", pair.server.sge(8192, 8), wr_id=2,
                                                raddr=pair.client.mr.buf + 8192), "pool")
        by_id = {w.wr_id: w for w in poll(pair.server.cq, 2)}  # the arrival (unsolicited: 0) and the post back
        assert by_id[2].status == e.IBV_WC_SUCCESS
        assert by_id[0].status == e.IBV_WC_SUCCESS and socket.ntohl(by_id[0].imm_data) == 7
        assert pair.server.read_buf(0, 4096) == image
        assert [(w.wr_id, w.status) for w in poll(pair.client.cq)] == [(1, e.IBV_WC_SUCCESS)]


def test_srd_reordering_of_a_stream_holds_a_bounded_number_of_bytes(shm) -> None:
    """While a stream goes on, the reorder pool holds at most ``reorder_window_bytes`` (and always one packet):
    a fabric reorders within a bounded time. Counted only in packets, a window of 1 MiB direct packets held
    64 MiB, and each message completed only after ~64 MiB more traffic or once the link went idle."""
    n, size, packet, window_packets = 48, 6000, 1024, 2
    provider = open_provider("soft")
    soft.configure("softefa0", reorder_seed=11, direct_packet_size=packet, reorder_window_bytes=window_packets * packet)
    try:
        with provider.srd_pair(max_send_wr=128, client_memory=shm, server_memory=shm) as pair:
            e = pair.v.enums
            base = pair.server.mr.buf
            pair.post(pair.client, "write", pair.client.sge(n * size, 8), raddr=base + n * size)
            assert poll(pair.client.cq)[0].status == e.IBV_WC_SUCCESS  # the agreement: later writes go direct
            placed: list[int] = []
            soft.set_placement_observer(pair.ctx, lambda qpn, addr, length: placed.append(addr - base)
                                        if base <= addr < base + n * size else None)
            for i in range(n):
                pair.post(pair.client, "write_imm", pair.client.sge(i * size, size), wr_id=i, raddr=base + i * size,
                          imm=i)
            assert all(w.status == e.IBV_WC_SUCCESS for w in poll(pair.server.cq, n))
            soft.set_placement_observer(pair.ctx, None)
    finally:
        defaults = soft.DeviceOptions()
        soft.configure("softefa0", reorder_seed=None, direct_packet_size=defaults.direct_packet_size,
                       reorder_window_bytes=defaults.reorder_window_bytes)
    per_message = -(-size // packet)
    arrival = [(off // size) * per_message + (off % size) // packet for off in placed]
    assert sorted(arrival) == list(range(n * per_message))
    assert arrival != sorted(arrival)  # still reordered
    # the k-th packet placed arrived while at most the held window plus the frame's own message were pooled
    late = max(a - k for k, a in enumerate(arrival))
    assert late < window_packets + per_message, f"a packet was placed {late} arrivals after it came in"
