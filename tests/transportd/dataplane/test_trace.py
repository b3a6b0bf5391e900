"""The trace recorder in the compiled engine and the trace file format (transportd/dataplane/trace.py)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cmd_ring import Command, Opcode, RingFile, RingProducer, records_from_commands
from cmd_ring.record import RECORD_DTYPE
from transportd.backends.interface import PlanOp
from transportd.backends.null import NullBackend
from transportd.dataplane import trace as tr
from transportd.dataplane.proxy import Proxy
from transportd.errors import ErrorCode, TraceFormatError

JOB = "job"
WORLD = 4
REGION = 1 << 20
FLAG_SLOTS = 8


def conn_of(peer: int) -> int:
    return 100 + peer


class Rig:
    """A proxy over the null backend with one job: rank 0 here (channel 1), peers 1..WORLD-1 connected."""

    def __init__(self, capacity: int = 64, **proxy_opts: object) -> None:
        self.rings: list[RingFile] = []
        self.backend = NullBackend(keep_plans=True)
        self.proxy = Proxy(self.backend, **proxy_opts)  # type: ignore[arg-type]
        self.proxy.set_source_region(JOB, 0, 0, 0x10_0000, REGION, 1)
        for peer in range(1, WORLD):
            self.proxy.set_remote_region(JOB, peer, 0, 0x100_0000 * peer, REGION, 10 + peer)
            self.proxy.set_remote_flags(JOB, peer, 0x900_0000 + 0x1000 * peer, FLAG_SLOTS, 20 + peer)
            self.proxy.bind_peer(JOB, peer, conn_of(peer))
        self.ring = self.add_ring(1, capacity)
        self.producer = RingProducer(self.ring)

    def add_ring(self, channel: int, capacity: int, rank: int = 0) -> RingFile:
        ring = RingFile.create(f"tpd-test-trace-{os.getpid()}-{uuid.uuid4().hex[:8]}", capacity)
        self.rings.append(ring)
        self.proxy.add_channel(channel, ring, JOB, rank, WORLD)
        return ring

    def push(self, *commands: Command) -> None:
        assert self.producer.push_records(records_from_commands(list(commands)), block=False)

    def spin(self, times: int = 4) -> None:
        for _ in range(times):
            self.proxy.run_once()

    def chunks(self, peer: int) -> list[int]:
        self.backend.poll(0)
        return [int(c) for plan in self.backend.plans.get(conn_of(peer), [])
                for c in plan["chunk_id"][plan["op"] == PlanOp.WRITE]]

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
            ring.unlink()


def put(chunk: int, peer: int = 1, opcode: int = Opcode.PUT, **kw: int) -> Command:
    opts = dict(peer=peer, length=64, src_off=64 * chunk, dst_off=64 * chunk, chunk_id=chunk)
    opts.update(kw)
    return Command(opcode, **opts)  # type: ignore[arg-type]


def put_signal(chunk: int, peer: int = 1, slot: int = 0) -> Command:
    return put(chunk, peer, opcode=Opcode.PUT_SIGNAL, signal_slot=slot, signal_value=1)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig(poll_window_us=0)
    yield made
    made.close()


def _records(commands: list[Command]) -> np.ndarray:
    return records_from_commands(commands)


def _stop(rig: Rig, tmp_path: Path) -> tuple[dict, np.ndarray]:
    out = rig.proxy.trace_stop(JOB, 0)
    entries = np.concatenate([tr.read_part(p) for p in out["parts"]]) if out["parts"] else np.zeros(0, tr.ENTRY_DTYPE)
    return out, entries


# --- the format ---------------------------------------------------------------------------------------------
def test_entry_layout_is_the_c_struct() -> None:
    assert tr.ENTRY_DTYPE.itemsize == 72
    offsets = {name: tr.ENTRY_DTYPE.fields[name][1] for name in tr.ENTRY_DTYPE.names}
    assert offsets == {"record": 0, "t_ns": 48, "position": 56, "channel": 64, "code": 68, "kind": 70, "reserved": 71}
    assert tr.HEADER_DTYPE.itemsize == 64


def test_write_and_read_back(tmp_path: Path) -> None:
    entries = np.zeros(3, dtype=tr.ENTRY_DTYPE)
    entries["record"] = _records([put(1), put(2), put(3, length=0)])
    entries["t_ns"] = [10, 20, 20]
    entries["position"] = [0, 1, 2]
    entries["code"] = [0, 0, ErrorCode.BAD_LENGTH]
    entries["kind"] = tr.TAKEN
    context = {"job": "j", "world": 2, "peers": {"1": {"regions": {"0": 64}}}}
    size = tr.write_trace(tmp_path / "t.trace", context, entries, start_mono_ns=5, start_wall_ns=7)
    data = (tmp_path / "t.trace").read_bytes()
    assert len(data) == size and data[:8] == b"TPDTRACE" and size % 8 == 0
    back = tr.read_trace(tmp_path / "t.trace")
    assert back.context == context and back.start_mono_ns == 5 and back.start_wall_ns == 7
    assert back.entries.tobytes() == entries.tobytes()
    assert len(back.taken) == 3 and len(back.failed) == 0


def test_reader_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    tr.write_trace(path, {}, np.zeros(2, dtype=tr.ENTRY_DTYPE))
    good = path.read_bytes()
    path.write_bytes(b"NOTTRACE" + good[8:])
    with pytest.raises(TraceFormatError, match="magic"):
        tr.read_trace(path)
    header = np.frombuffer(good[:64], dtype=tr.HEADER_DTYPE).copy()
    header["version"] = 2
    path.write_bytes(header.tobytes() + good[64:])
    with pytest.raises(TraceFormatError, match="version 2"):
        tr.read_trace(path)
    path.write_bytes(good[:-1])
    with pytest.raises(TraceFormatError, match="cannot hold 2 entries"):
        tr.read_trace(path)


def test_a_torn_part_tail_is_left_out(tmp_path: Path) -> None:
    entries = np.zeros(2, dtype=tr.ENTRY_DTYPE)
    entries["position"] = [4, 5]
    (tmp_path / "p").write_bytes(entries.tobytes() + b"\1" * 30)
    assert tr.read_part(tmp_path / "p")["position"].tolist() == [4, 5]


def test_merge_orders_parts_by_time_then_channel_then_position(tmp_path: Path) -> None:
    a, b = np.zeros(2, dtype=tr.ENTRY_DTYPE), np.zeros(2, dtype=tr.ENTRY_DTYPE)
    a["t_ns"], a["channel"], a["position"], a["kind"] = [5, 9], 2, [0, 1], tr.TAKEN
    b["t_ns"], b["channel"], b["position"], b["kind"] = [5, 7], 1, [0, 1], tr.TAKEN
    (tmp_path / "a").write_bytes(a.tobytes())
    (tmp_path / "b").write_bytes(b.tobytes())
    n = tr.merge_parts(tmp_path / "t", [tmp_path / "a", tmp_path / "b"], {"job": "j"})
    got = tr.read_trace(tmp_path / "t").entries
    assert n == 4 and list(zip(got["t_ns"].tolist(), got["channel"].tolist(), strict=True)) == [
        (5, 1), (5, 2), (7, 1), (9, 2)]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- the recorder in the engine -----------------------------------------------------------------------------
def test_every_taken_record_is_recorded_with_its_outcome(rig: Rig, tmp_path: Path) -> None:
    assert rig.proxy.trace_start(JOB, 0, str(tmp_path / "t")) == [1]
    commands = [put(1), put_signal(2, slot=3), put(3, src_region=7), Command(Opcode.QUIET), put(4, peer=WORLD)]
    rig.push(*commands)
    rig.spin()
    out, entries = _stop(rig, tmp_path)
    assert out["entries"] == out["written"] == 5 and out["dropped"] == 0 and out["write_errors"] == []
    assert entries["kind"].tolist() == [tr.TAKEN] * 5
    assert entries["position"].tolist() == [0, 1, 2, 3, 4] and set(entries["channel"].tolist()) == {1}
    assert entries["code"].tolist() == [0, 0, ErrorCode.BAD_REGION, 0, ErrorCode.BAD_PEER]
    want = _records(commands)
    want["seq"] = np.arange(1, 6)  # as the producer stamped them
    assert entries["record"].tobytes() == want.tobytes()
    assert (entries["t_ns"] >= out["start_mono_ns"]).all() and np.all(np.diff(entries["t_ns"].astype(np.int64)) >= 0)


def test_a_later_failure_is_a_failed_entry(rig: Rig, tmp_path: Path) -> None:
    rig.proxy.trace_start(JOB, 0, str(tmp_path / "t"))
    rig.backend.fail_next(conn_of(1), 10)  # IBV_WC_REM_ACCESS_ERR
    rig.push(put(0), put(1, peer=2))
    rig.spin()
    _, entries = _stop(rig, tmp_path)
    failed = entries[entries["kind"] == tr.FAILED]
    assert failed["position"].tolist() == [0] and failed["code"].tolist() == [ErrorCode.REMOTE_ACCESS]
    assert failed["record"].tobytes() == bytes(RECORD_DTYPE.itemsize)
    assert entries[entries["kind"] == tr.TAKEN]["code"].tolist() == [0, 0]


def test_only_the_traced_rank_is_recorded_and_stopping_ends_it(rig: Rig, tmp_path: Path) -> None:
    other = rig.add_ring(2, 64, rank=1)
    rig.proxy.trace_start(JOB, 0, str(tmp_path / "t"))
    assert rig.proxy.tracing() == [(JOB, 0)]
    RingProducer(other).push_records(_records([put(9, peer=2)]), block=False)
    rig.push(put(0))
    rig.spin()
    out, entries = _stop(rig, tmp_path)
    assert out["parts"] == [str(tmp_path / "t.ch1.part")] and entries["position"].tolist() == [0]
    rig.push(put(1))
    rig.spin()
    assert tr.read_part(out["parts"][0])["position"].tolist() == [0]  # nothing after the stop
    assert rig.proxy.tracing() == []
    with pytest.raises(KeyError):
        rig.proxy.trace_stop(JOB, 0)


def test_a_channel_opened_while_traced_is_traced_and_removing_one_closes_its_part(rig: Rig, tmp_path: Path) -> None:
    rig.proxy.trace_start(JOB, 0, str(tmp_path / "t"))
    with pytest.raises(ValueError, match="traced already"):
        rig.proxy.trace_start(JOB, 0, str(tmp_path / "u"))
    second = rig.add_ring(5, 16)
    RingProducer(second).push_records(_records([put(7), put(8)]), block=False)
    rig.push(put(0))
    rig.spin()
    rig.proxy.remove_channel(5)
    out, entries = _stop(rig, tmp_path)
    assert sorted(out["parts"]) == [str(tmp_path / "t.ch1.part"), str(tmp_path / "t.ch5.part")]
    assert out["entries"] == 3 and sorted(entries["channel"].tolist()) == [1, 5, 5]
    assert out["context"]["channels"] == {"1": {"capacity": 64}, "5": {"capacity": 16}}


def test_a_small_buffer_writes_as_it_goes_and_the_ring_wraps(tmp_path: Path) -> None:
    rig = Rig(capacity=16, poll_window_us=0)
    try:
        rig.proxy.trace_start(JOB, 0, str(tmp_path / "t"), buffer_entries=3)
        sent = 0
        while sent < 200:
            rig.push(*[put(i, peer=1 + i % 3) for i in range(sent, sent + 10)])
            sent += 10
            rig.spin(2)
            assert len(tr.read_part(tmp_path / "t.ch1.part")) >= sent - 3  # at most a buffer behind
        assert rig.proxy.trace_flush(JOB, 0) == 200
        _, entries = _stop(rig, tmp_path)
        assert entries["position"].tolist() == list(range(200))
        assert entries["record"]["chunk_id"].tolist() == list(range(200))
    finally:
        rig.close()


def test_a_failing_write_drops_entries_and_the_data_path_goes_on(rig: Rig, tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to make writes fail")
    prefix = tmp_path / "t"
    os.symlink("/dev/full", f"{prefix}.ch1.part")
    rig.proxy.trace_start(JOB, 0, str(prefix), buffer_entries=2)
    rig.push(*[put(i) for i in range(5)])
    rig.spin()
    out = rig.proxy.trace_stop(JOB, 0)
    assert out["entries"] == 5 and out["written"] == 0 and out["dropped"] == 5
    assert out["write_errors"] and "No space" in out["write_errors"][0]
    assert rig.chunks(1) == [0, 1, 2, 3, 4] and rig.ring.completion_pos == 5


def test_context_holds_what_a_replay_needs(rig: Rig) -> None:
    ctx = rig.proxy.trace_context(JOB, 0)
    assert ctx["job"] == JOB and ctx["rank"] == 0 and ctx["world"] == WORLD
    assert ctx["sources"] == {"0": REGION}
    assert ctx["peers"]["0"] == {"regions": {}, "flags": 0, "connected": False, "code": 0}
    for peer in range(1, WORLD):
        assert ctx["peers"][str(peer)] == {"regions": {"0": REGION}, "flags": FLAG_SLOTS, "connected": True,
                                           "code": 0}
    assert ctx["channels"] == {"1": {"capacity": 64}} and ctx["proxy"]["batch_max"] == 8


# --- errors by code per channel -----------------------------------------------------------------------------
def test_each_ring_counts_its_errors_by_code(rig: Rig) -> None:
    other = rig.add_ring(2, 64)
    RingProducer(other).push_records(_records([put(0, length=0)]), block=False)
    rig.push(put(0, peer=9), put(1), put(2, length=0), put(3, src_region=3), put(4, peer=9))
    rig.spin()
    rings = {r["channel"]: r for r in rig.proxy.queue_stats()["rings"]}
    assert rings[1]["errors_by_code"] == {"BAD_PEER": 2, "BAD_REGION": 1, "BAD_LENGTH": 1}
    assert rings[2]["errors_by_code"] == {"BAD_LENGTH": 1}
    assert rings[1]["error"] == ErrorCode.BAD_PEER and not rings[1]["traced"]
