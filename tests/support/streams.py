"""A rank streaming PUT_SIGNALs to a peer from a thread, and what the receiver must then hold (restart tests,
the restart benchmark)."""

from __future__ import annotations

import threading
import time

import numpy as np

from cmd_ring import RingFullError
from tests.support.cluster import Rank
from tests.support.waiting import wait_until

CHUNK = 256  #: bytes per message
SLOTS = 4096  #: message i lands at (i % SLOTS) * CHUNK: the receive buffer wraps, a flag counts every message


class Stream:
    """``src`` sends message after message to ``dst`` (rank ``peer``): PUT_SIGNAL of chunk ``i % SLOTS`` to the
    same offset, ADD 1 on flag ``slot``. Backpressure (a full ring) is waited out, never dropped: ``committed``
    counts the records the ring took, ``positions[i]`` is message i's ring position, ``completions`` the time
    of each rise of the channel's completion position the thread saw (the pause a client sees). :meth:`pause`
    holds the thread between two pushes until :meth:`resume`."""

    def __init__(self, src: Rank, dst: Rank, peer: int, slot: int = 0, interval_s: float = 0.001) -> None:
        self.src, self.dst, self.peer, self.slot = src, dst, peer, slot
        self.interval_s = interval_s
        self.committed = 0
        self.positions: list[int] = []
        self.completions: list[tuple[float, int]] = []  # (monotonic time, completion position) when it rose
        self._stop = threading.Event()
        self._gate = threading.Condition()
        self._pause_asked = False  # pause() asked the thread to hold
        self._held = False  # the thread holds between two pushes
        self._thread = threading.Thread(target=self._run, name=f"stream-{peer}", daemon=True)
        src.channel.timeout = 0.02  # a full ring raises soon, and the thread tries again

    def start(self) -> Stream:
        self._thread.start()
        return self

    def _run(self) -> None:
        ch, ring = self.src.channel, self.src.channel.ring
        seen = ring.completion_pos
        i = 0
        while not self._stop.is_set():
            self._hold_while_paused()
            off = (i % SLOTS) * CHUNK
            try:
                position = ch.put_signal(peer=self.peer, dst_region=self.dst.dst.id, dst_off=off,
                                         src_region=self.src.src.id, src_off=off, nbytes=CHUNK, slot=self.slot)
            except RingFullError:
                position = -1
            done = ring.completion_pos
            if done > seen:
                seen = done
                self.completions.append((time.monotonic(), done))
            if position < 0:
                continue  # backpressure: the daemon is not taking records now
            self.positions.append(position)
            i += 1
            self.committed = i
            time.sleep(self.interval_s)

    def _hold_while_paused(self) -> None:
        with self._gate:
            if not self._pause_asked:
                return
            self._held = True
            self._gate.notify_all()
            self._gate.wait_for(lambda: not self._pause_asked or self._stop.is_set())
            self._held = False

    def pause(self, timeout: float = 30.0) -> None:
        """Push nothing more until :meth:`resume`: returns once the thread holds between two pushes, so
        ``committed`` and ``positions`` stay as they are."""
        with self._gate:
            self._pause_asked = True
            held = self._gate.wait_for(lambda: self._held or not self._thread.is_alive(), timeout)
        assert held and self._thread.is_alive(), "the streaming thread did not pause"

    def resume(self) -> None:
        with self._gate:
            self._pause_asked = False
            self._gate.notify_all()

    def flowing_beyond(self, count: int, what: str, timeout: float = 120.0) -> None:
        """Wait until more than ``count`` messages were committed *and* completed."""
        def moved() -> bool:
            done = self.src.channel.ring.completion_pos
            return self.committed > count and sum(1 for p in self.positions[count:] if p < done) > 0

        wait_until(moved, lambda: f"{what} (committed {self.committed}, completion position "
                   f"{self.src.channel.ring.completion_pos})", timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        with self._gate:
            self._gate.notify_all()  # a paused thread stops too
        self._thread.join(30)
        assert not self._thread.is_alive(), "the streaming thread did not stop"
        self.src.channel.timeout = 30.0  # the caller's pushes from now on wait out backpressure

    def settled(self, timeout: float = 60.0) -> None:
        """Wait until everything committed has completed at the sender (without raising on an error word)."""
        ring = self.src.channel.ring
        wait_until(lambda: ring.completion_pos >= ring.producer_pos,
                   lambda: f"completion {ring.completion_pos} to reach {ring.producer_pos}", timeout=timeout)

    def touched(self) -> slice:
        """The bytes of the receive buffer this stream wrote."""
        return slice(0, min(self.committed, SLOTS) * CHUNK)

    def data_arrived(self) -> bool:
        part = self.touched()
        return bool(np.array_equal(self.dst.recv[part], self.src.send[part]))

    def pause_s(self, after: float) -> float:
        """The longest gap between two rises of the completion position that the stream saw after ``after``
        (a monotonic time): the pause a streaming client saw across a restart."""
        times = [t for t, _ in self.completions if t >= after]
        before = [t for t, _ in self.completions if t < after]
        points = before[-1:] + times
        return max((b - a for a, b in zip(points, points[1:], strict=False)), default=0.0)
