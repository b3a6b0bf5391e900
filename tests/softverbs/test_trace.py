"""``SOFTVERBS_TRACE``: the steps a write's processes stamp, and their summary (`softverbs.soft.trace`)."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from pathlib import Path

import pytest

from softverbs import _trace, soft
from softverbs.soft.trace import read, ready_waits, steps, summarize
from tests.support.verbs_resources import RCPair, open_provider, poll
from tests.support.waiting import wait_until


def test_summarize_times_each_step_from_its_cycles_start_and_names_processes_in_order(tmp_path: Path) -> None:
    lines = {7: [], 9: []}
    for cycle, t0 in enumerate((1_000_000, 2_000_000, 3_000_000)):
        lines[7].append(f"{t0} 7 start ib:x:4096")
        lines[9].append(f"{t0 + 10_000 * (cycle + 1)} 9 sent 1")  # 10, 20, 30 µs
        lines[9].append(f"{t0 + 50_000} 9 read")
        lines[9].append(f"{t0 + 60_000} 9 read")  # a second read in the same cycle: read#2
        lines[7].append(f"{t0 + 90_000} 7 done")
        lines[9].append(f"{t0 + 95_000} 9 ready")  # after the starter's done: in no cycle
    lines[7].append("4000000 7 start efa:y:1")
    lines[7].append("4005000 7 done")
    for pid, text in lines.items():
        (tmp_path / f"trace-{pid}.txt").write_text("\n".join(text) + "\n")
    assert len(read(tmp_path)) == sum(len(v) for v in lines.values())
    out = summarize(tmp_path)
    assert [r["step"] for r in out["ib:x:4096"]] == ["p1:sent 1#1", "p1:read#1", "p1:read#2", "p0:done#1"]
    sent = out["ib:x:4096"][0]
    assert sent["n"] == 3 and sent["median_us"] == pytest.approx(20.0) and sent["p10_us"] == pytest.approx(10.0)
    assert out["efa:y:1"] == [{"step": "p0:done#1", "n": 1, "median_us": pytest.approx(5.0),
                              "p10_us": pytest.approx(5.0)}]
    skipped = summarize(tmp_path, skip=2)["ib:x:4096"][0]
    assert skipped["n"] == 1 and skipped["median_us"] == pytest.approx(30.0)


def test_a_traced_write_stamps_its_frame_its_reads_and_its_placement_and_an_untraced_one_nothing(
        tmp_path: Path, monkeypatch) -> None:
    provider = open_provider("soft")
    name = f"softib-{uuid.uuid4().hex[:6]}"
    soft.add_device(name, "ib")
    with RCPair(provider, "softib0", connect=False) as a, RCPair(provider, name, connect=False) as b:
        a.connect(a.client, b.server)
        b.connect(b.server, a.client)
        e = a.v.enums

        def write() -> None:
            a.client.qp.post_send(a.send_wr(e.IBV_WR_RDMA_WRITE, a.client.sge(0, 4096), rkey=b.server.mr.rkey,
                                            raddr=b.server.mr.buf, flags=int(e.IBV_SEND_SIGNALED)))
            (wc,) = poll(a.client.cq, timeout=30)
            assert wc.status == e.IBV_WC_SUCCESS

        write()  # the connection is up before the traced writes
        monkeypatch.setattr(_trace, "DIR", str(tmp_path))
        write()  # the I/O threads were asleep in an untraced wait: from their next one on, they stamp it
        write()
        monkeypatch.setattr(_trace, "DIR", None)
        write()
    stamps = read(tmp_path)
    steps = [step for _, _, step in stamps]
    # this process holds both devices: the post's WRs queued and framed, the request frame, the responder's read,
    # parse and placement, the ack's frame and its read and parse by the requester; nothing after tracing went off
    assert steps[:2] == ["locked", "pump"] and steps.count("pump") == steps.count("locked") == 2
    assert steps.count("pumped") == 2
    assert all(s in ("locked", "pump", "pumped", "send 1", "send 2", "ready", "read", "frame 1 1", "frame 2 1",
                     "placed") for s in steps), steps
    second = steps[len(steps) - 1 - steps[::-1].index("pump"):]
    sent = second.index("send 1")
    assert second.index("pumped") > sent
    got = second.index("read", sent)  # the responder's read of the request
    assert second.index("frame 1 1", got) < second.index("placed", got) < second.index("send 2")
    assert second.index("frame 2 1") > second.index("send 2")
    # by the second write the I/O threads wait through the traced epoll wait, which stamps when it returns
    assert "ready" in second and second.index("pump") < sent
    # two traced writes, and nothing of the third (a wake-up may stamp ``ready`` any time while on)
    assert steps.count("send 1") == steps.count("placed") == steps.count("send 2") == 2


def test_a_trace_directory_that_cannot_be_written_turns_tracing_off_and_the_write_still_lands(
        tmp_path: Path, monkeypatch, caplog) -> None:
    provider = open_provider("soft")
    name = f"softib-{uuid.uuid4().hex[:6]}"
    soft.add_device(name, "ib")
    missing = tmp_path / "no-such-dir"
    with RCPair(provider, "softib0", connect=False) as a, RCPair(provider, name, connect=False) as b:
        a.connect(a.client, b.server)
        b.connect(b.server, a.client)
        e = a.v.enums
        a.client.mr.write(b"\x5a" * 4096, 4096, 0)
        monkeypatch.setattr(_trace, "DIR", str(missing))
        with caplog.at_level("WARNING", logger="softverbs.trace"):
            a.client.qp.post_send(a.send_wr(e.IBV_WR_RDMA_WRITE, a.client.sge(0, 4096), rkey=b.server.mr.rkey,
                                            raddr=b.server.mr.buf, flags=int(e.IBV_SEND_SIGNALED)))
            (wc,) = poll(a.client.cq, timeout=30)
        assert wc.status == e.IBV_WC_SUCCESS and b.server.mr.read(4096, 0) == b"\x5a" * 4096
        assert _trace.DIR is None and not missing.exists()
        assert "cannot write the trace" in caplog.text


def test_steps_lists_every_stamp_of_a_labels_last_cycle_until_its_done(tmp_path: Path) -> None:
    lines = {7: ["1000000 7 start moe:comm", "1090000 7 done", "2000000 7 start moe:comm", "2100000 7 done",
                 "3000000 7 start moe:fused", "3200000 7 done"],
             9: ["1010000 9 send 1", "2010000 9 send 1", "2020000 9 send 1", "2050000 9 placed",
                 "2150000 9 placed",  # after the cycle's done: in no cycle
                 "3100000 9 send 1"]}
    for pid, text in lines.items():
        (tmp_path / f"trace-{pid}.txt").write_text("\n".join(text) + "\n")
    out = steps(tmp_path)
    assert out["moe:comm"] == {"p0": {"done": [100.0]}, "p1": {"send 1": [10.0, 20.0], "placed": [50.0]}}
    assert out["moe:fused"] == {"p1": {"send 1": [100.0]}, "p0": {"done": [200.0]}}


def test_ready_waits_time_each_read_from_its_threads_wake_and_tell_the_ones_inside_a_post(tmp_path: Path) -> None:
    """Process 5: a read 10 µs after its wake, one 200 µs after (while the process posted: 150 -> 400 µs), one
    90 µs after with no post then (a request its I/O thread sent meanwhile is no post); a wake followed by
    another (a timer) pairs nothing. Process 6 never reads."""
    us = 1_000
    lines = {5: [(0, "ready"), (10, "read"), (100, "ready"), (150, "post"), (250, "pump"), (300, "read"),
                 (400, "posted"), (1000, "ready"), (1050, "ready"), (1100, "send 1"), (1140, "read"), (2000, "post"),
                 (2100, "posted")],
             6: [(5, "ready"), (7, "send 2")]}
    for pid, stamps in lines.items():
        (tmp_path / f"trace-{pid}.txt").write_text("".join(f"{t * us} {pid} {step}\n" for t, step in stamps))
    waits = ready_waits(tmp_path)
    assert list(waits) == [5]
    assert waits[5] == {"n": 3, "p50_us": 90.0, "p90_us": 90.0, "slow": 2, "slow_in_own_post": 1}



def test_stamps_are_stores_into_a_mapped_file_whole_lines_from_every_thread(tmp_path: Path, monkeypatch) -> None:
    """After the file is opened a stamp makes no write (a write would hand the GIL over mid-step); lines from
    threads stamping at once come out whole, and the file's zero-filled room is not read as stamps."""
    monkeypatch.setattr(_trace, "DIR", str(tmp_path))
    _trace.stamp("first")  # opens and maps the file

    def no_write(*_args: object) -> None:
        raise AssertionError("a stamp made a write")

    monkeypatch.setattr(os, "write", no_write)

    def stamps(name: str) -> None:
        for i in range(2000):
            _trace.stamp(f"{name} {i}")

    threads = [threading.Thread(target=stamps, args=(f"t{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = read(tmp_path)
    assert _trace.DIR == str(tmp_path), "no stamp failed"
    assert {pid for _, pid, _ in got} == {os.getpid()}
    steps = [step for _, _, step in got]
    assert steps[0] == "first" and len(steps) == 8001
    for k in range(4):
        mine = [int(s.split()[1]) for s in steps if s.startswith(f"t{k} ")]
        assert mine == list(range(2000)), "each thread's lines whole and in its order"
    (path,) = tmp_path.glob("trace-*.txt")
    assert path.stat().st_size == _trace.FILE_BYTES


def test_a_full_trace_file_turns_tracing_off_with_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(_trace, "DIR", str(tmp_path))
    monkeypatch.setattr(_trace, "FILE_BYTES", 4096)
    monkeypatch.setattr(_trace, "_file", [None, None, 0])
    with caplog.at_level("WARNING", logger="softverbs.trace"):
        for i in range(1000):
            _trace.stamp(f"step {i}")
    assert _trace.DIR is None and "tracing is off" in caplog.text
    got = [step for _, _, step in read(tmp_path)]
    assert 0 < len(got) < 1000 and got == [f"step {i}" for i in range(len(got))], "what fitted, whole"


def test_a_forked_child_stamps_into_its_own_file_even_if_the_lock_was_held(tmp_path: Path, monkeypatch) -> None:
    """fork() while another thread held the stamp lock: the child's first stamp neither waits forever nor lands
    in the parent's file."""
    monkeypatch.setattr(_trace, "DIR", str(tmp_path))
    _trace.stamp("parent")
    with _trace._lock:  # as a thread mid-stamp would hold it
        pid = os.fork()
        if pid == 0:  # the child: stamp, then leave at once (no pytest teardown in the child)
            try:
                _trace.stamp("child")
            finally:
                os._exit(0)
    done: list[int] = []

    def exited() -> bool:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            done.append(status)
        return bool(got)

    try:
        wait_until(exited, "the forked child to stamp and exit (a lock held at the fork would hang it)")
    finally:
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(done[0]) == 0
    got = read(tmp_path)
    assert sorted(step for _, _, step in got) == ["child", "parent"]
    assert {p for _, p, s in got if s == "child"} == {pid}
    assert len(list(tmp_path.glob("trace-*.txt"))) == 2
