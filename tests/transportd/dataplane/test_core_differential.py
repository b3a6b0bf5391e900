"""The compiled engine against its numpy model: the same inputs must give the same outputs.

Each trial builds random job tables (regions registered, replaced and removed; peers bound, unbound and
lost), random knobs (batch_max, polling window, inflight cap, decoupled signaling, max_take) and streams
of random records, valid and invalid mixed, into two identical rings: one drained by
:class:`transportd.dataplane.proxy.Proxy` (the engine), one by :class:`transportd_models.engine.ModelProxy`.
Between passes the null NIC is paused and resumed and made to fail batches, the same way on both sides.
After every pass both must agree on every channel's error word, consumer and completion position, on every
counter, on the queue state they report (per ring and per connection), and on what was posted: the same
batches to the same connections in the same pass, row for row and token for token.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from cmd_ring.record import RECORD_DTYPE, Flag, Opcode
from cmd_ring.ring import RingFile, RingProducer
from transportd.backends.null import NullBackend
from transportd.dataplane.proxy import Proxy
from transportd_models.engine import ModelProxy

JOB = "diff"
SRC_LEN = 1 << 16
DST_LEN = 1 << 15
TRIALS = 100
RECORDS_PER_TRIAL = 10_000  # 10^6 records in all


def _random_record(rng: random.Random, world: int) -> tuple:
    op = rng.choice([Opcode.PUT] * 4 + [Opcode.PUT_SIGNAL] * 4 + [Opcode.SIGNAL] * 2 + [Opcode.FENCE, Opcode.QUIET]
                    + [0, 6, 200] * (rng.random() < 0.05))
    peer = rng.randrange(world + 2) if rng.random() < 0.1 else rng.randrange(1, world)
    length = rng.choice([0, 1, 8, 512, 4096, DST_LEN, DST_LEN + 1, 1 << 31]) if rng.random() < 0.1 else \
        rng.randrange(1, 4097)
    src_off = rng.randrange(SRC_LEN + 16) if rng.random() < 0.1 else rng.randrange(SRC_LEN // 2)
    dst_off = rng.choice([DST_LEN - length % DST_LEN, DST_LEN, 2**64 - 1]) if rng.random() < 0.05 else \
        rng.randrange(DST_LEN // 2)
    flags = (Flag.SIGNAL_SET if rng.random() < 0.2 else 0) | (Flag.NO_BATCH if rng.random() < 0.1 else 0)
    return (0, int(op), int(flags), peer, src_off, dst_off & (2**64 - 1), length, rng.randrange(4),
            rng.randrange(4), rng.getrandbits(32), rng.randrange(20), rng.getrandbits(64))


class Side:
    """One proxy (engine or model) with its own null NIC and rings, fed the same as the other side."""

    def __init__(self, kind: type, knobs: dict, tmp_path, tag: str, channels: int, world: int) -> None:
        self.nic = NullBackend(keep_plans=True)
        self.proxy = kind(self.nic, **knobs)
        self.rings = [RingFile.create(str(tmp_path / f"{tag}{i}"), 256, lock=False) for i in range(channels)]
        self.producers = [RingProducer(r) for r in self.rings]
        for i, ring in enumerate(self.rings):
            self.proxy.add_channel(i, ring, JOB, 0, world)
        self.compared = 0  # posts already compared with the other side

    def state(self) -> tuple:
        rings = tuple((r.error, r.consumer_pos, r.completion_pos) for r in self.rings)
        counters = {k: v for k, v in self.proxy.counters.items() if k != "iterations"}
        stats = self.proxy.stats()
        queues = self.proxy.queue_stats()  # less the head's age (a clock) and what only the daemon's proxy adds
        queue_rings = [{k: v for k, v in ring.items() if k not in ("oldest_age_us", "errors_by_code", "traced")}
                       for ring in queues["rings"]]
        return (rings, counters, stats["errors"], stats["inflight"], stats["batch_hist"], self.proxy.busy(),
                queue_rings, queues["connections"])

    def new_posts(self) -> list[tuple[bytes, bytes, bytes]]:
        """(connection ids, rows, batch bounds) of each post since the last call."""
        self.nic.poll(0)  # the null NIC files what was posted on its next poll
        kept = self.nic._kept[self.compared:]
        self.compared += len(kept)
        return [(ids.tobytes(), plan.tobytes(), bounds.tobytes()) for ids, plan, bounds in kept]


def _table_ops(rng: random.Random, world: int) -> list[tuple]:
    """A random sequence of table changes, applied to both sides alike."""
    ops: list[tuple] = []
    for region in range(3):
        if rng.random() < 0.9:
            ops.append(("set_source_region", JOB, 0, region, 0x1000_0000 * (region + 1), SRC_LEN, 7 + region))
    for peer in range(1, world):
        for region in range(3):
            if rng.random() < 0.85:
                ops.append(("set_remote_region", JOB, peer, region, 0x100_0000_0000 * peer + region * DST_LEN,
                            DST_LEN, 100 + peer))
        if rng.random() < 0.9:
            ops.append(("set_remote_flags", JOB, peer, 0xF00_0000_0000 + 0x1_0000 * peer, rng.choice([4, 16]),
                        200 + peer))
        if rng.random() < 0.9:
            ops.append(("bind_peer", JOB, peer, 1000 + peer % 3))  # several peers may share a connection
    return ops


def _between_passes(rng: random.Random, world: int) -> list[tuple]:
    """What may happen between two passes: NIC state, table changes, a failed connection."""
    ops: list[tuple] = []
    roll = rng.random()
    if roll < 0.15:
        ops.append(("pause", rng.random() < 0.5))
    elif roll < 0.2:
        ops.append(("fail_next", 1000 + rng.randrange(3), rng.choice([5, 10, 12])))
    elif roll < 0.23:
        ops.append(("remove_source_region", JOB, 0, rng.randrange(3)))
    elif roll < 0.26:
        ops.append(("set_remote_region", JOB, rng.randrange(1, world), rng.randrange(3), 0x7700_0000, 64, 9))
    elif roll < 0.27:
        ops.append(("fail_connection", 1000 + rng.randrange(3), rng.choice([0, 8])))
    elif roll < 0.28:
        ops.append(("forget_peer", JOB, rng.randrange(1, world)))
    elif roll < 0.285:
        ops.append(("mark_gone", rng.randrange(2)))
    return ops


def _apply(side: Side, op: tuple) -> None:
    name, *args = op
    if name == "pause":
        side.nic.paused = args[0]
    elif name == "fail_next":
        side.nic.fail_next(*args)
    else:
        getattr(side.proxy, name)(*args)


def _assert_same(engine: Side, model: Side, where: str) -> None:
    assert engine.state() == model.state(), where
    assert engine.new_posts() == model.new_posts(), f"{where}: the batches posted differ"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(TRIALS))
def test_engine_matches_model(tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randrange(2, 6)
    channels = rng.choice([1, 2])
    knobs = dict(batch_max=rng.randrange(1, 9), poll_window_us=rng.choice([0.0, 0.0, 1e9]),
                 inflight_cap=rng.choice([2, 3, 8, 64, 256]), decoupled=rng.random() < 0.5,
                 max_take=rng.choice([1, 7, 64, 4096]), max_length=rng.choice([1 << 31, 4096]))
    engine = Side(Proxy, knobs, tmp_path, "e", channels, world)
    model = Side(ModelProxy, knobs, tmp_path, "m", channels, world)
    for op in _table_ops(rng, world):
        _apply(engine, op)
        _apply(model, op)
    sent = 0
    step = 0
    while sent < RECORDS_PER_TRIAL:
        step += 1
        for ch in range(channels):
            free = engine.producers[ch].free_slots()
            assert free == model.producers[ch].free_slots()
            n = min(free, rng.randrange(0, 40), RECORDS_PER_TRIAL - sent)
            records = np.array([_random_record(rng, world) for _ in range(n)], dtype=RECORD_DTYPE)
            if n:
                assert engine.producers[ch].push_records(records, block=False)
                assert model.producers[ch].push_records(records, block=False)
                sent += n
        for op in _between_passes(rng, world):
            _apply(engine, op)
            _apply(model, op)
        assert engine.proxy.run_once() == model.proxy.run_once(), f"seed {seed} step {step}: did work"
        _assert_same(engine, model, f"seed {seed} step {step}")
    # flush: resume the NIC, QUIET every channel (a QUIET posts partial batches), drain both
    for side in (engine, model):
        side.nic.paused = False
        for producer in side.producers:
            producer.push_records(np.array([(0, int(Opcode.QUIET), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)],
                                           dtype=RECORD_DTYPE), timeout=5)
    for _ in range(50):
        assert engine.proxy.run_once() == model.proxy.run_once()
        _assert_same(engine, model, f"seed {seed} flush")
    assert engine.proxy.completion_position(0) == model.proxy.completion_position(0)
    for side in (engine, model):
        for ring in side.rings:
            ring.close()
            ring.unlink()
