"""The self-test's shared rules and its far side, for ``transportctl selftest`` (``transportd_cli.selftest``).

The near side (in the ``transportctl`` process) joins rank 0 of a job of the daemons' own; the far daemon
joins rank 1 itself (:class:`EchoResponder`: its own memory, flags and ring, no user process there) and
echoes every flag it sees back to rank 0 with the data that flag covers, having checked that data the
moment the flag appeared. What both sides agree on lives here: the regions' layout (:func:`segment`), the
data (:func:`pattern`), the rounds (``MODES``) and :func:`check_data`. The daemon's part of both sides (the
control op, the peer messages, the far rank's memory, flags and ring) is ``transportd.daemon.selftest_jobs``.
Like the rest of the daemon, nothing here uses the client library: the echo pushes with ``cmd_ring``'s
producer into a ring the daemon made.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from cmd_ring import RECORD_DTYPE, Flag, Opcode, RingProducer

__all__ = ["EchoResponder", "MODES", "REGION_BYTES", "SLOTS", "check_data", "pattern", "segment"]

MIB = 1 << 20
SMALL = 4096
#: (name, slot, op): the 4 KiB rounds; slot BIG is the 1 MiB round
MODES = (("put_signal add", 0, "add"), ("put_signal set", 1, "set"), ("put + signal add", 2, "add"))
BIG = 3
SLOTS = 4
#: region layout, the same on both sides: [0, 1 MiB) the 1 MiB round and the bandwidth puts, then one
#: 64 KiB segment per small-round slot
SEGMENT = 64 << 10
REGION_BYTES = MIB + SEGMENT * len(MODES)
SEND_REGION, RECV_REGION = 0, 1  # rank 0 registers these in this order; rank 1 has region 0 only
FAR_REGION = 0
ECHO_DEADLINE_S = 300.0  # the far side leaves a self-test on its own after this long (the near side died)


def segment(slot: int) -> tuple[int, int]:
    """(offset, length) in either side's region of what flag ``slot`` covers."""
    return (0, MIB) if slot == BIG else (MIB + SEGMENT * slot, SMALL)


def pattern(seed: int, slot: int, value: int, nbytes: int) -> np.ndarray:
    """The bytes flag ``slot`` reaching ``value`` covers: a different pattern for every (slot, value)."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    salt = np.uint64((seed ^ (slot << 56) ^ (value << 24)) & ((1 << 64) - 1))
    return (words * np.uint64(0x9E3779B97F4A7C15) + salt).view(np.uint8)


def check_data(view: np.ndarray, expected: np.ndarray, settle_s: float = 0.2) -> str:
    """'ok', 'early' (the flag was seen before its data, which then arrived) or 'corrupt'."""
    if np.array_equal(view, expected):
        return "ok"
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(0.001)
        if np.array_equal(view, expected):
            return "early"
    return "corrupt"


class EchoResponder:
    """The far side's rank 1, run by its daemon: a thread that watches the self-test's flags and, for each
    new value, checks the data it covers and echoes data and value back to rank 0 (PUT_SIGNAL, SET)."""

    def __init__(self, job: str, requester: str, seed: int, memory: np.ndarray, flags: Any, ring: Any) -> None:
        self.job, self.requester, self.seed = job, requester, seed
        self.memory, self.flags, self.ring = memory, flags, ring
        self._producer = RingProducer(ring)
        self.started = time.monotonic()
        self.report: dict[str, Any] = {"echoes": 0, "ok": 0, "early": 0, "corrupt": 0, "turnaround_us": []}
        # set by the daemon once this rank's connection back to rank 0 is up and bound: an echo pushed
        # before that would be refused (BAD_PEER)
        self.wired = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"selftest-{job}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = [0] * SLOTS
        record = np.zeros(1, dtype=RECORD_DTYPE)
        pause = 0.0
        while not self._stop.is_set():
            changed = False
            for slot in range(SLOTS):
                value = int(self.flags.values[slot])
                if value == seen[slot]:
                    continue
                changed, seen[slot] = True, value
                t_seen = time.monotonic()
                off, length = segment(slot)
                verdict = check_data(self.memory[off:off + length], pattern(self.seed, slot, value, length))
                self.report[verdict] += 1
                if not self.wired.is_set():
                    while not self.wired.wait(0.01):
                        if self._stop.is_set() or self.expired:
                            return
                record[0] = (0, int(Opcode.PUT_SIGNAL), int(Flag.SIGNAL_SET), 0, off, off, length, FAR_REGION,
                             RECV_REGION, 0, slot, value)
                try:
                    self._producer.push_records(record, timeout=5.0)
                except TimeoutError:
                    return  # the ring stayed full: the near side's report will say the echo never came
                self.report["echoes"] += 1
                self.report["turnaround_us"].append([slot, value, (time.monotonic() - t_seen) * 1e6])
            # a short nap while a round is likely under way, longer once idle: the daemon's other threads
            # share these cores
            pause = 0.0 if changed else min(pause * 2 or 20e-6, 1e-3)
            if pause:
                self._stop.wait(pause)

    @property
    def expired(self) -> bool:
        return time.monotonic() - self.started > ECHO_DEADLINE_S

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10.0)
        code, count, position = self.ring.error
        return {**self.report, "ring_error": [int(code), int(count), int(position)]}


# ---------------------------------------------------------------------------------------------------------
# The near side (transportctl).
