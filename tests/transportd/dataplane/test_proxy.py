"""The proxy loop end to end: real rings, the null backend, one process."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cmd_ring import Command, Flag, Opcode, RingFile, RingProducer, records_from_commands
from tests.support.waiting import wait_until
from transportd.backends.interface import PlanOp
from transportd.backends.null import NullBackend, apply_plans
from transportd.dataplane import worker as rail
from transportd.dataplane.proxy import Proxy
from transportd.errors import ErrorCode
from transportd_models.engine import completion_error_code

JOB = "job"
WORLD = 4
SRC_BASE, DST_BASE, FLAG_BASE = 0x10_0000, 0x100_0000, 0x900_0000
REGION = 1 << 20
FLAG_SLOTS = 8


def conn_of(peer: int) -> int:
    return 100 + peer


class Rig:
    """A proxy with one job: rank 0 on this node, peers 1..WORLD-1 each on their own connection."""

    def __init__(self, capacity: int = 64, **proxy_opts) -> None:
        self.rings: list[RingFile] = []
        self.backend = NullBackend(keep_plans=True)
        self.proxy = Proxy(self.backend, **proxy_opts)
        self.proxy.set_source_region(JOB, 0, 0, SRC_BASE, REGION, 1)
        for peer in range(1, WORLD):
            self.proxy.set_remote_region(JOB, peer, 0, DST_BASE * peer, REGION, 10 + peer)
            self.proxy.set_remote_flags(JOB, peer, FLAG_BASE + 0x1000 * peer, FLAG_SLOTS, 20 + peer)
            self.proxy.bind_peer(JOB, peer, conn_of(peer))
        self.ring = self.add_ring(1, capacity)
        self.producer = RingProducer(self.ring)

    def add_ring(self, channel: int, capacity: int, rank: int = 0) -> RingFile:
        ring = RingFile.create(f"tpd-test-proxy-{os.getpid()}-{uuid.uuid4().hex[:8]}", capacity)
        self.rings.append(ring)
        self.proxy.add_channel(channel, ring, JOB, rank, WORLD)
        return ring

    def push(self, *commands: Command, producer: RingProducer | None = None) -> None:
        assert (producer or self.producer).push_records(records_from_commands(list(commands)), block=False)

    def spin(self, times: int = 4) -> None:
        for _ in range(times):
            self.proxy.run_once()

    def posted(self, peer: int) -> list[np.ndarray]:
        self.backend.poll(0)  # settle what was posted
        return self.backend.plans.get(conn_of(peer), [])

    def chunks(self, peer: int) -> list[int]:
        return [int(c) for plan in self.posted(peer) for c in plan["chunk_id"][plan["op"] == PlanOp.WRITE]]

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
            ring.unlink()


@pytest.fixture
def rig_factory() -> Iterator:
    made: list[Rig] = []

    def make(**kw) -> Rig:
        rig = Rig(**kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


@pytest.fixture
def rig(rig_factory) -> Rig:
    return rig_factory(poll_window_us=0)


def put(chunk: int, peer: int = 1, opcode: int = Opcode.PUT, **kw) -> Command:
    opts = dict(peer=peer, length=64, src_off=64 * chunk, dst_off=64 * chunk, chunk_id=chunk)
    opts.update(kw)
    return Command(opcode, **opts)  # type: ignore[arg-type]  # bad opcodes on purpose


def put_signal(chunk: int, peer: int = 1, slot: int = 0, value: int = 1, **kw) -> Command:
    return put(chunk, peer, opcode=Opcode.PUT_SIGNAL, signal_slot=slot, signal_value=value, **kw)


# --- validation in the loop ---------------------------------------------------------------------------------
BAD = [
    (put(0, opcode=9), ErrorCode.BAD_OPCODE),
    (put(0, peer=WORLD), ErrorCode.BAD_PEER),
    (put(0, peer=0), ErrorCode.BAD_PEER),
    (put(0, src_region=7), ErrorCode.BAD_REGION),
    (put(0, dst_region=7), ErrorCode.BAD_REGION),
    (put(0, src_off=REGION), ErrorCode.OUT_OF_BOUNDS),
    (put(0, dst_off=(1 << 64) - 1), ErrorCode.OUT_OF_BOUNDS),
    (put(0, length=0), ErrorCode.BAD_LENGTH),
    (put(0, length=REGION + 1), ErrorCode.BAD_LENGTH),
    (put_signal(0, slot=FLAG_SLOTS), ErrorCode.BAD_SLOT),
]


@pytest.mark.parametrize(("bad", "code"), BAD, ids=[f"{c.name}-{i}" for i, (_, c) in enumerate(BAD)])
def test_bad_record_is_reported_and_the_good_ones_around_it_are_posted_in_order(rig_factory, bad, code) -> None:
    rig = rig_factory(poll_window_us=0, max_length=REGION)
    rig.push(put(1), put(2), bad, put(3), put_signal(4))
    rig.spin()
    assert rig.chunks(1) == [1, 2, 3, 4]
    assert rig.ring.error == (int(code), 1, 2)  # first code, count, position of the bad record
    stats = rig.proxy.stats()
    assert stats["errors"] == {code.name: 1} and stats["rejected"] == 1 and stats["commands"] == 4
    assert rig.ring.completion_pos == 5


def test_first_error_code_sticks_and_the_count_grows(rig) -> None:
    rig.push(put(0, peer=9), put(1), put(2, length=0), put(3, src_region=3))
    rig.spin()
    assert rig.ring.error == (int(ErrorCode.BAD_PEER), 3, 0)
    assert rig.chunks(1) == [1]


def test_every_opcode_reaches_the_backend_as_its_rows(rig) -> None:
    rig.push(put(1), put_signal(2, slot=3, value=5), Command(Opcode.SIGNAL, peer=1, signal_slot=1, signal_value=2,
                                                               flags=Flag.SIGNAL_SET),
             Command(Opcode.FENCE, peer=1), Command(Opcode.QUIET))
    rig.spin()
    (plan,) = rig.posted(1)  # one batch: closed by the FENCE
    assert plan["op"].tolist() == [PlanOp.WRITE, PlanOp.WRITE, PlanOp.SIGNAL, PlanOp.SIGNAL, PlanOp.FENCE]
    assert plan["raddr"][2] == FLAG_BASE + 0x1000 + 8 * 3 and plan["raddr"][3] == FLAG_BASE + 0x1000 + 8
    assert plan["laddr"][1] == SRC_BASE + 128 and plan["raddr"][1] == DST_BASE + 128
    assert len(set(plan["token"].tolist())) == 1
    stats = rig.proxy.stats()
    assert (stats["writes"], stats["signals"], stats["fences"], stats["quiets"]) == (2, 2, 1, 1)
    assert stats["bytes"] == 128


# --- batching -----------------------------------------------------------------------------------------------
def test_batches_hold_at_most_batch_max_commands(rig_factory) -> None:
    rig = rig_factory(poll_window_us=0, batch_max=3)
    rig.push(*[put(i) for i in range(7)], *[put(i, peer=2) for i in range(7, 9)])
    rig.spin()
    assert [len(p) for p in rig.posted(1)] == [3, 3, 1]
    assert [len(p) for p in rig.posted(2)] == [2]
    assert rig.chunks(1) == list(range(7)) and rig.chunks(2) == [7, 8]
    stats = rig.proxy.stats()
    assert stats["batch_hist"] == [1, 1, 2] and stats["batches_full"] == 2 and stats["batches_partial"] == 2


def test_partial_batch_waits_for_the_window_then_posts(rig_factory) -> None:
    rig = rig_factory(poll_window_us=30_000)
    rig.push(put(0), put(1))
    rig.spin()
    assert rig.posted(1) == [] and rig.proxy.stats()["pending_rows"] == 2
    rig.push(*[put(i) for i in range(2, 10)])  # fills one batch of 8; 2 wait
    rig.spin()
    assert [len(p) for p in rig.posted(1)] == [8]
    wait_until(lambda: rig.spin() or len(rig.posted(1)) == 2, "the 30 ms window to post the partial batch",
               interval=0.001)
    assert [len(p) for p in rig.posted(1)] == [8, 2] and rig.chunks(1) == list(range(10))
    assert not rig.proxy.busy()


@pytest.mark.parametrize(
    "closer",
    [put(9, flags=Flag.NO_BATCH), Command(Opcode.FENCE, peer=1), Command(Opcode.QUIET)],
    ids=["NO_BATCH", "FENCE", "QUIET"],
)
def test_no_batch_fence_and_quiet_post_at_once(rig_factory, closer) -> None:
    rig = rig_factory(poll_window_us=10_000_000)
    rig.push(put(0), put(1))
    rig.spin()
    assert rig.posted(1) == []
    rig.push(closer)
    rig.spin()
    (plan,) = rig.posted(1)
    assert plan["chunk_id"][:2].tolist() == [0, 1]
    assert rig.ring.completion_pos == 3


def test_quiet_flushes_only_its_own_channel(rig_factory) -> None:
    rig = rig_factory(poll_window_us=10_000_000)
    other = rig.add_ring(2, 64, rank=0)
    rig.push(put(0, peer=2), producer=RingProducer(other))
    rig.push(put(1), Command(Opcode.QUIET))
    rig.spin()
    assert rig.chunks(1) == [1] and rig.chunks(2) == []


# --- backpressure -------------------------------------------------------------------------------------------
def test_full_connection_leaves_records_in_the_ring_and_nothing_is_lost(rig_factory) -> None:
    rig = rig_factory(capacity=16, poll_window_us=0, inflight_cap=8)
    rig.backend.paused = True  # the NIC completes nothing
    total, sent, refused = 200, 0, 0
    for _ in range(50):
        if rig.producer.push_records(records_from_commands([put(sent)]), block=False):
            sent += 1
        else:
            refused += 1
        rig.proxy.run_once()
    assert refused > 0, "the producer never saw a full ring"
    assert rig.ring.consumer_pos == 8, "the proxy took more than the inflight cap allows"
    assert rig.proxy.stats()["stalls"] > 0
    assert rig.backend.inflight(conn_of(1)) == 8
    rig.backend.paused = False

    def drained() -> bool:
        nonlocal sent
        if sent >= total and rig.ring.completion_pos >= total:
            return True
        if sent < total and rig.producer.push_records(records_from_commands([put(sent)]), block=False):
            sent += 1
        rig.proxy.run_once()
        assert rig.backend.inflight(conn_of(1)) <= 8
        return False

    wait_until(drained, "the records to drain after the NIC resumed", interval=0)  # each look is a proxy pass
    assert rig.chunks(1) == list(range(total))
    assert rig.proxy.stats()["signal_stalls"] == 0


def test_a_full_connection_does_not_take_records_for_it_but_takes_those_before(rig_factory) -> None:
    rig = rig_factory(poll_window_us=0, inflight_cap=4)
    rig.backend.paused = True
    rig.push(put(0, peer=2), *[put(i) for i in range(1, 7)], put(7, peer=2))
    rig.spin()
    assert rig.ring.consumer_pos == 5  # peer 1 took 4; the 5th PUT to peer 1 waits in the ring
    assert rig.chunks(2) == [0] and rig.chunks(1) == [1, 2, 3, 4]
    rig.backend.paused = False
    rig.spin(6)
    assert rig.chunks(1) == [1, 2, 3, 4, 5, 6] and rig.chunks(2) == [0, 7]


# --- completions --------------------------------------------------------------------------------------------
def test_completion_position_is_the_first_position_not_yet_complete(rig) -> None:
    rig.backend.held = {conn_of(2)}
    rig.push(put(0), put(1, peer=2), put(2), Command(Opcode.QUIET), put(4))
    rig.spin()
    assert rig.ring.completion_pos == 1  # position 1 (peer 2) is still in flight
    rig.backend.held = set()
    rig.spin()
    assert rig.ring.completion_pos == 5  # a QUIET at position 3 is now satisfied (5 > 3)
    assert not rig.proxy.busy()


def test_completion_errors_write_remote_access_or_transport(rig_factory) -> None:
    rig = rig_factory(poll_window_us=0)
    rig.push(put(0))
    rig.spin()
    rig.backend.fail_next(conn_of(1), 10)  # IBV_WC_REM_ACCESS_ERR
    rig.push(put(1), put(2))
    rig.spin()
    assert rig.ring.completion_pos == 3
    assert rig.ring.error == (int(ErrorCode.REMOTE_ACCESS), 2, 1)
    rig.backend.fail_next(conn_of(2), 12)  # IBV_WC_RETRY_EXC_ERR: the far end stopped answering
    rig.push(put(3, peer=2))
    rig.spin()
    stats = rig.proxy.stats()
    # it may or may not have executed: an unknown outcome, not a transport error
    assert stats["errors"] == {"REMOTE_ACCESS": 2, "UNKNOWN_OUTCOME": 1} and stats["completion_errors"] == 2
    assert rig.ring.completion_pos == 4
    # and its connection is held (records for peer 2 wait in the ring) until the daemon decides
    assert rig.proxy._core.broken_connections() == [conn_of(2)]
    rig.push(put(4, peer=2), put(5, peer=1))
    rig.spin()
    assert (rig.ring.consumer_pos, rig.ring.completion_pos) == (4, 4)  # in ring order: both wait, none fail
    rig.proxy.hold_connection(conn_of(2), False)  # (the daemon re-wires it, or fails it: docs/restart.md)
    rig.spin()
    assert (rig.ring.consumer_pos, rig.ring.completion_pos) == (6, 6) and rig.ring.error[0] == ErrorCode.REMOTE_ACCESS
    assert completion_error_code(np.array([0, 4, 10, 5, 12])).tolist() == [0, 9, 9, 10, 10]


def test_ring_wraps_many_times_and_positions_stay_exact(rig_factory) -> None:
    rig = rig_factory(capacity=16, poll_window_us=0)
    sent = 0
    while sent < 500:
        n = min(11, 500 - sent)
        rig.push(*[put(i, peer=1 + i % 3) for i in range(sent, sent + n)])
        sent += n
        rig.spin(2)
    rig.spin(3)
    assert rig.ring.completion_pos == 500
    got = sorted(rig.chunks(1) + rig.chunks(2) + rig.chunks(3))
    assert got == list(range(500))
    assert rig.chunks(2) == sorted(rig.chunks(2))


# --- decoupled signaling in the loop ------------------------------------------------------------------------
def test_decoupled_posts_one_signal_per_destination_per_batch(rig_factory) -> None:
    rig = rig_factory(poll_window_us=0, decoupled=True)
    rig.push(*[put_signal(i) for i in range(16)], *[put_signal(i, peer=2, slot=1, value=3) for i in range(16, 20)])
    rig.spin()
    for plan in rig.posted(1):
        assert plan["op"].tolist() == [PlanOp.WRITE] * 8 + [PlanOp.SIGNAL]
    flags = apply_plans(rig.posted(1) + rig.posted(2))
    assert flags == {(1, FLAG_BASE + 0x1000): 16, (2, FLAG_BASE + 0x2000 + 8): 12}
    stats = rig.proxy.stats()
    assert stats["signals"] == 3 and stats["signals_requested"] == 20 and stats["signals_per_dest_batch"] == 1.0


def test_naive_posts_a_signal_per_command(rig) -> None:
    rig.push(*[put_signal(i) for i in range(8)])
    rig.spin()
    stats = rig.proxy.stats()
    assert stats["signals"] == 8 and stats["signals_per_dest_batch"] == 8.0
    assert apply_plans(rig.posted(1)) == {(1, FLAG_BASE + 0x1000): 8}


# --- clients and peers that go away -------------------------------------------------------------------------
def test_gone_client_records_are_rejected_with_client_gone(rig_factory) -> None:
    rig = rig_factory(poll_window_us=10_000_000)
    rig.push(put(0), put(1))
    rig.spin()
    rig.proxy.mark_gone(1)  # the two waiting rows are dropped, not posted
    rig.push(put(2), Command(Opcode.QUIET))
    rig.spin()
    assert rig.chunks(1) == []
    assert rig.ring.error == (int(ErrorCode.CLIENT_GONE), 4, 0)
    assert rig.ring.completion_pos == 4
    assert rig.proxy.stats()["channels_gone"] == 1 and not rig.proxy.busy()
    rig.proxy.remove_channel(1)
    rig.push(put(4))
    rig.spin()
    assert rig.proxy.stats()["channels"] == 0


def test_failed_connection_completes_its_work_with_peer_lost(rig_factory) -> None:
    rig = rig_factory(poll_window_us=0)
    rig.backend.paused = True
    rig.push(put(0), put(1, peer=2))
    rig.spin()
    rig.proxy.fail_connection(conn_of(1), ErrorCode.PEER_LOST)
    assert rig.ring.error == (int(ErrorCode.PEER_LOST), 1, 0)
    rig.push(put(2))
    rig.spin()
    assert rig.ring.error[1] == 2
    rig.backend.paused = False
    rig.spin()
    assert rig.ring.completion_pos == 3 and not rig.proxy.busy()
    assert rig.proxy.stats()["unknown_completions"] == 0  # the late completion of the failed batch is ignored


def test_remove_channel_while_work_is_in_flight(rig) -> None:
    rig.backend.paused = True
    rig.push(put(0), put(1))
    rig.spin()
    rig.proxy.remove_channel(1)
    rig.backend.paused = False
    rig.spin()
    assert not rig.proxy.busy()


def test_two_channels_of_a_job_share_connections_and_keep_their_own_positions(rig) -> None:
    other = rig.add_ring(2, 64, rank=1)
    rig.proxy.set_source_region(JOB, 1, 0, SRC_BASE * 2, REGION, 2)
    rig.push(put(0), put(1, src_region=0), producer=RingProducer(other))
    rig.push(put(2))
    rig.spin()
    assert sorted(rig.chunks(1)) == [0, 1, 2]
    assert rig.ring.completion_pos == 1 and other.completion_pos == 2
    with pytest.raises(ValueError, match="world"):
        rig.proxy.add_channel(3, other, JOB, 0, WORLD + 1)


# --- the rail worker's loop (worker.serve_loop, Proxy.serve), run in a thread --------------------------------
class QuietLink:
    """What ``serve_loop`` needs of a worker link, with no requests ever: a descriptor to watch (a pipe's read
    end, readable once something is written to ``write_fd``) and nothing pending."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()

    def wake_fd(self) -> int:
        return self.read_fd

    def serve_pending(self, timeout_ms: int = 0) -> bool:
        return False

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def test_serve_loop_runs_until_stopped_in_a_thread(rig) -> None:
    stop = threading.Event()
    link = QuietLink()
    worker = threading.Thread(target=rail.serve_loop, args=(rig.proxy, link, stop.is_set))
    worker.start()
    try:
        for i in range(0, 300, 10):
            rig.producer.push_records(records_from_commands([put(j) for j in range(i, i + 10)]), timeout=5)
        wait_until(lambda: rig.ring.completion_pos >= 300, "the loop to drain the ring", interval=0.001)
    finally:
        stop.set()
        rig.proxy.interrupt()  # the engine's loop returns; serve_loop then sees stop set
        worker.join(5)
        link.close()
    assert not worker.is_alive()
    assert rig.chunks(1) == list(range(300))


def test_serve_loop_asks_a_callable_stop_around_each_serve(rig) -> None:
    """``stopping`` is any callable, asked before each serve and again once the link's requests are served:
    here it says stop on its fourth call, so the engine's loop ran once (returning for the link, whose
    descriptor stays readable)."""
    calls = []
    link = QuietLink()
    os.write(link.write_fd, b"r")
    try:
        rail.serve_loop(rig.proxy, link, lambda: calls.append(1) or len(calls) > 3)
    finally:
        link.close()
    assert len(calls) == 4
    assert rig.proxy.loop_stats()["link"] == 1


def test_stats_are_plain_json(rig) -> None:
    rig.push(put(0), put(1, peer=9))
    rig.spin()
    stats = rig.proxy.stats()
    assert json.loads(json.dumps(stats)) == stats
    for key in ("commands", "bytes", "signals", "fences", "batches_full", "batches_partial", "batch_hist", "stalls",
                "signal_stalls", "errors", "inflight"):
        assert key in stats


# --- naive and decoupled proxies agree on random streams ----------------------------------------------------
def _stream_command(kind: int, peer: int, slot: int, set_: bool, value: int, no_batch: bool, chunk: int) -> Command:
    flags = (Flag.SIGNAL_SET if set_ else Flag.NONE) | (Flag.NO_BATCH if no_batch else Flag.NONE)
    if kind == 0:
        return put(chunk, peer, flags=flags)
    if kind == 1:
        return put_signal(chunk, peer, slot=slot, value=value, flags=flags)
    if kind == 2:
        return Command(Opcode.SIGNAL, peer=peer, signal_slot=slot, signal_value=value, flags=flags, chunk_id=chunk)
    if kind == 3:
        return Command(Opcode.FENCE, peer=peer, flags=flags, chunk_id=chunk)
    if kind == 4:
        return Command(Opcode.QUIET, chunk_id=chunk)
    return put_signal(chunk, peer, slot=FLAG_SLOTS + slot, value=value)  # bad: BAD_SLOT


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4, 5]), st.integers(1, WORLD - 1), st.integers(0, 2),
                          st.integers(0, 5).map(lambda x: x == 0), st.integers(0, 3), st.integers(0, 7).map(
                              lambda x: x == 0)), min_size=1, max_size=80),
       st.sampled_from([1, 3, 8]))
def test_naive_and_decoupled_proxies_agree(stream, batch_max) -> None:
    rigs = [Rig(poll_window_us=0, batch_max=batch_max, decoupled=d) for d in (False, True)]
    try:
        _check_naive_and_decoupled_agree(rigs, [_stream_command(*item, chunk=i) for i, item in enumerate(stream)])
    finally:
        for rig in rigs:
            rig.close()


def _check_naive_and_decoupled_agree(rigs: list[Rig], commands: list[Command]) -> None:
    for rig in rigs:
        for i in range(0, len(commands), 16):  # several takes, so batches span iterations
            rig.push(*commands[i : i + 16])
            rig.spin(2)
        rig.spin(2)
        assert rig.ring.completion_pos == len(commands) and not rig.proxy.busy()
    naive, dec = rigs
    all_plans = {r: [p for peer in range(1, WORLD) for p in r.posted(peer)] for r in (naive, dec)}
    assert apply_plans(all_plans[naive]) == apply_plans(all_plans[dec])
    for peer in range(1, WORLD):
        assert naive.chunks(peer) == dec.chunks(peer)
    assert naive.ring.error == dec.ring.error
    # each FENCE-delimited segment of a batch: its leading signals, its writes, its signals, its trailing writes
    # (phases 0-3), one signal per flag word in each run of signals
    for plan in all_plans[dec]:
        phase, words = 0, set()
        for row in plan:
            if row["op"] == PlanOp.FENCE:
                phase, words = 0, set()
            elif row["op"] == PlanOp.SIGNAL:
                assert phase != 3, "a signal after the segment's trailing writes"
                if phase == 1:
                    phase, words = 2, set()
                assert int(row["raddr"]) not in words
                words.add(int(row["raddr"]))
            else:
                phase = 1 if phase in (0, 1) else 3


def test_wait_ready_watches_the_ring_heads_without_taking(rig) -> None:
    assert not rig.proxy.wait_ready(0.001)  # nothing committed: waits out the timeout
    rig.push(put(0))
    assert rig.proxy.wait_ready(5.0)  # returns at once
    assert rig.proxy.wait_ready(0.0)  # still there: watching takes nothing
    rig.backend.paused = True
    rig.proxy.run_once()
    assert rig.proxy.busy() and not rig.proxy.wait_ready(5.0)  # work in flight: a pass is due, no watching
    rig.backend.paused = False
    rig.spin()
    assert rig.chunks(1) == [0] and rig.ring.completion_pos == 1


def test_wait_ready_with_naps_sees_a_record_committed_while_it_waits(rig) -> None:
    start = time.monotonic()
    assert not rig.proxy.wait_ready(0.01, 50e-6)  # nothing: the whole timeout, napping between looks
    assert time.monotonic() - start >= 0.01
    watching = threading.Event()
    result: list[bool] = []

    def watch() -> None:
        watching.set()
        result.append(rig.proxy.wait_ready(60.0, 50e-6))

    watcher = threading.Thread(target=watch)
    watcher.start()
    watching.wait()
    rig.push(put(0))  # the watcher returns once it looks again, long before its 60 s
    watcher.join(30)
    assert result == [True]
    rig.spin()
    assert rig.chunks(1) == [0]


def test_rail_serve_loop_takes_sparse_records_and_serves_its_link_while_idle(tmp_path, monkeypatch) -> None:
    """The rail worker's own loop over a real worker link: it takes a record, goes idle, serves a request
    that arrives while it waits, takes the next record, and stops on a stop request. Long idle from the
    start here, with a minute-long watch: only the link's descriptor can end the wait for the request."""
    import threading

    import msgspec
    import zmq

    from transportd.control import codec
    from transportd.dataplane.link_messages import LinkRequest, Stop, Stopped
    from transportd.dataplane.worker_link import WorkerEndpoint

    class Pings(msgspec.Struct):
        pings: int

    class Ping(LinkRequest, frozen=True):
        reply = Pings

    class Handler:
        def __init__(self) -> None:
            self.pings = 0

        def ping(self, req: Ping) -> Pings:
            self.pings += 1
            return Pings(self.pings)

        def stop(self, req: Stop) -> Stopped:
            return Stopped(drained=True)

    monkeypatch.setattr(rail, "DEEP_AFTER_S", 0.0)
    monkeypatch.setattr(rail, "DEEP_WATCH_S", 60.0)
    rig = Rig(poll_window_us=0)
    ctx = zmq.Context()
    main_end = ctx.socket(zmq.PAIR)
    main_end.linger = 0
    main_end.bind(f"ipc://{tmp_path}/link")
    handler = Handler()
    link = WorkerEndpoint(f"ipc://{tmp_path}/link", {Ping: handler.ping, Stop: handler.stop})
    loop = threading.Thread(target=rail.serve_loop, args=(rig.proxy, link, lambda: False))
    try:
        rig.push(put(0))
        loop.start()
        wait_until(lambda: rig.ring.completion_pos == 1, "the record to be taken and completed")
        assert rig.chunks(1) == [0]
        main_end.send(codec.encode({"seq": 7, "fds": 0, "request": Ping()}))
        assert main_end.poll(10_000), "a request to an idle worker was not served"
        assert codec.decode(main_end.recv(), max_size=1 << 16) == {"ok": True, "reply": {"pings": 1}, "seq": 7}
        rig.push(put(1))
        wait_until(lambda: rig.ring.completion_pos == 2, "the record after the idle to be taken")
        main_end.send(codec.encode({"seq": 8, "fds": 0, "request": Stop()}))
        loop.join(10)
        assert not loop.is_alive()
    finally:
        if loop.is_alive():
            main_end.send(codec.encode({"seq": 9, "fds": 0, "request": Stop()}))
            loop.join(10)
        link.close()
        main_end.close()
        ctx.term()
        rig.close()
