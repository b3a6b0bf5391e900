"""The rail worker's loop in the engine (``Proxy.serve``, ``engine.c``'s ``tpd_serve_loop``), against its Python
model (``transportd_models.engine.model_serve``, the loop the worker ran pass by pass before).

Each scenario runs a serve loop in a thread over a real ring, with a pipe standing in for the worker link's
descriptor (a byte written is a request; the loop must return ``SERVE_LINK`` for it, and the test "serves"
it by reading the byte, as ``serve_loop`` does with the link): stop (``interrupt``) from every phase, a
request arriving while busy, spinning, watching and deep idle, each back-off phase reached under the
policy that reaches it, the idle clock carried across returns, records committed while the loop watches
or naps, and a backend whose post and poll are Python running inside the loop. Where the C loop and the
model are both run, they must agree on what was taken, posted and completed and on why each serve returned.
Times here are generous bounds on a shared machine, never measurements.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from cmd_ring import Command, Opcode, RingFile, RingProducer, records_from_commands
from tests.support.waiting import wait_until
from transportd.backends.interface import PlanOp
from transportd.backends.null import NullBackend
from transportd.dataplane import worker as rail
from transportd.dataplane.proxy import SERVE_INTERRUPTED, SERVE_LINK, Proxy
from transportd_models.engine import (
    MODEL_SERVE_INTERRUPTED,
    MODEL_SERVE_LINK,
    ModelLoopState,
    model_serve,
)

JOB = "loop"
WORLD = 3
REGION = 1 << 20
LONG = 60.0  # a wait only a request, a record or interrupt() may end within a test

assert (SERVE_LINK, SERVE_INTERRUPTED) == (MODEL_SERVE_LINK, MODEL_SERVE_INTERRUPTED)


def policy(**overrides: float) -> dict[str, float]:
    """The worker's policy (``dataplane.worker``'s constants) with ``overrides``."""
    out: dict[str, float] = {k: float(v) for k, v in rail.serve_policy(None).items() if k != "link_every_s"}
    out.update(overrides)
    return out


SPIN_ONLY = policy(spin_s=LONG, deep_after_s=LONG)  # never leaves the spin phase
WATCH_ONLY = policy(spin_s=0.0, deep_after_s=LONG)  # watch + nap from the first idle pass
DEEP_ONLY = policy(spin_s=0.0, deep_after_s=0.0, deep_watch_s=LONG)  # long-idle from the first idle pass
PHASES = {"spin": SPIN_ONLY, "watch": WATCH_ONLY, "deep": DEEP_ONLY}


def put(i: int, peer: int = 1) -> Command:
    return Command(Opcode.PUT, peer=peer, src_off=64 * i, dst_off=64 * i, length=64, chunk_id=i)


class Loop:
    """A proxy on one ring, and a serve loop (the engine's, or the model) run over and over in a thread the
    way ``worker.serve_loop`` runs it: after a ``SERVE_LINK`` the requests are served (the pipe drained)."""

    def __init__(self, model: bool = False, backend: NullBackend | None = None, capacity: int = 256,
                 link_every_s: float = 50e-6, **pol: float) -> None:
        self.model = model
        self.backend = backend
        self.proxy = Proxy(backend, poll_window_us=0.0)
        if backend is None:
            self.proxy.log_posts(1 << 16)
        self.proxy.set_source_region(JOB, 0, 0, 0x10_0000, REGION, 1)
        for peer in range(1, WORLD):
            self.proxy.set_remote_region(JOB, peer, 0, 0x100_0000 * peer, REGION, 10 + peer)
            self.proxy.bind_peer(JOB, peer, 100 + peer)
        self.ring = RingFile.create(f"tpd-test-serve-{os.getpid()}-{uuid.uuid4().hex[:8]}", capacity)
        self.proxy.add_channel(1, self.ring, JOB, 0, WORLD)
        self.producer = RingProducer(self.ring)
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.policy = {**(pol or SPIN_ONLY), "link_every_s": link_every_s}
        self.reasons: list[int] = []
        self.served = 0
        self.state = ModelLoopState()
        self._stop = threading.Event()  # the model's interrupt
        self._done = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="serve-loop")

    def serve_once(self) -> int:
        if self.model:
            return model_serve(self.proxy, self.state, self._stop.is_set, wake_fd=self.read_fd, **self.policy)
        return self.proxy.serve(wake_fd=self.read_fd, **self.policy)

    def _run(self) -> None:
        try:
            while not self._done:
                reason = self.serve_once()
                self.reasons.append(reason)
                if reason == SERVE_LINK:
                    try:
                        self.served += len(os.read(self.read_fd, 4096))
                    except BlockingIOError:
                        pass
                else:
                    self._stop.clear()
        except BaseException as exc:  # the test thread reports it
            self.error = exc

    def start(self) -> Loop:
        self.thread.start()
        return self

    def request(self) -> None:
        os.write(self.write_fd, b"r")

    def interrupt(self) -> None:
        self._stop.set()
        self.proxy.interrupt()

    def stop(self) -> None:
        self._done = True
        self.interrupt()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the serve loop did not stop"
        if self.error is not None:
            raise self.error

    def stats(self) -> dict[str, int]:
        return dict(self.state.stats) if self.model else self.proxy.loop_stats()

    def push(self, *commands: Command) -> None:
        assert self.producer.push_records(records_from_commands(list(commands)), timeout=10)

    def chunks(self) -> list[int]:
        if self.backend is None:
            return sorted(self.proxy.post_log()[1].tolist())
        self.backend.poll(0)
        return sorted(int(c) for plans in self.backend.plans.values() for plan in plans
                      for c in plan["chunk_id"][plan["op"] == PlanOp.WRITE])

    def close(self) -> None:
        if self.thread.is_alive():
            self.stop()
        os.close(self.read_fd)
        os.close(self.write_fd)
        self.ring.close()
        self.ring.unlink()


@pytest.fixture
def loops() -> Iterator[Callable[..., Loop]]:
    made: list[Loop] = []

    def make(*args, **kwargs) -> Loop:
        made.append(Loop(*args, **kwargs))
        return made[-1]

    yield make
    for loop in made:
        loop.close()


SIDES = pytest.mark.parametrize("model", [False, True], ids=["engine", "model"])


@SIDES
@pytest.mark.parametrize("phase", PHASES)
def test_interrupt_ends_a_serve_in_every_phase(loops, model: bool, phase: str) -> None:
    loop = loops(model, **PHASES[phase]).start()
    key = {"spin": "spins", "watch": "watches", "deep": "deep_watches"}[phase]
    wait_until(lambda: loop.stats()[key] > 0, f"the loop to reach its {phase} phase")
    loop.interrupt()
    wait_until(lambda: SERVE_INTERRUPTED in loop.reasons, "serve to return for interrupt()")
    assert loop.reasons == [SERVE_INTERRUPTED] and loop.stats()["interrupted"] == 1
    loop.stop()


def test_an_interrupt_before_serve_makes_the_next_serve_return_at_once(loops) -> None:
    loop = loops(**DEEP_ONLY)
    loop.proxy.interrupt()
    start = time.monotonic()
    assert loop.serve_once() == SERVE_INTERRUPTED
    assert time.monotonic() - start < LONG / 2
    assert loop.proxy.loop_stats()["passes"] == 0  # it returned before a pass


def test_a_negative_link_look_interval_is_refused(loops) -> None:
    loop = loops(**SPIN_ONLY)
    with pytest.raises(ValueError, match="link_every_ns"):
        loop.proxy.serve(wake_fd=loop.read_fd, **{**SPIN_ONLY, "link_every_s": -1e-6})
    assert loop.proxy.loop_stats()["passes"] == 0


@SIDES
@pytest.mark.parametrize("phase", PHASES)
def test_a_request_on_the_link_returns_from_every_phase(loops, model: bool, phase: str) -> None:
    """Only the link's descriptor can end the deep phase's minute-long watch here; the spin phase looks at
    it every link_every_s, the watch phase every pass and during its naps."""
    loop = loops(model, **PHASES[phase]).start()
    key = {"spin": "spins", "watch": "watches", "deep": "deep_watches"}[phase]
    for n in (1, 2, 3):
        wait_until(lambda: loop.stats()[key] > 0, f"the loop to reach its {phase} phase")
        loop.request()
        wait_until(lambda n=n: loop.served == n, f"request {n} to be served")
    assert loop.reasons == [SERVE_LINK] * 3
    loop.stop()


@SIDES
def test_a_request_while_busy_is_served_between_passes(loops, model: bool) -> None:
    """A producer keeps the loop busy (records arriving all the time); a request is still served, and
    every record taken before and after it completes."""
    loop = loops(model, capacity=64, link_every_s=0.0, **SPIN_ONLY).start()
    total, stop = 3000, threading.Event()

    def produce() -> None:
        for i in range(total):
            if stop.is_set():
                return
            loop.push(put(i, 1 + i % (WORLD - 1)))

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        wait_until(lambda: loop.stats()["busy"] > 10, "the loop to be busy")
        loop.request()
        wait_until(lambda: loop.served == 1, "the request to be served while records flow")
    finally:
        producer.join(60)
        stop.set()
    wait_until(lambda: loop.ring.completion_pos == total, "every record to complete")
    loop.stop()
    assert loop.chunks() == list(range(total))
    assert loop.reasons[0] == SERVE_LINK


@SIDES
def test_the_back_off_goes_spin_watch_deep_and_a_return_does_not_restart_it(loops, model: bool) -> None:
    pol = policy(spin_s=0.005, deep_after_s=0.05, deep_watch_s=LONG)
    loop = loops(model, **pol).start()
    wait_until(lambda: loop.stats()["deep_watches"] > 0, "the loop to reach the long-idle watch")
    s = loop.stats()
    assert s["spins"] > 0 and s["watches"] > 0 and s["naps"] > 0 and s["busy"] == 0
    # a request returns to Python; the loop goes back in still long idle: no spin or watch phase again
    loop.request()
    wait_until(lambda: loop.served == 1, "the request to be served")
    wait_until(lambda: loop.stats()["deep_watches"] > s["deep_watches"], "the next long-idle watch")
    after = loop.stats()
    assert (after["spins"], after["watches"]) == (s["spins"], s["watches"])
    # work restarts the clock: a record, then spin and watch again before the next deep watch
    loop.push(put(0))
    wait_until(lambda: loop.ring.completion_pos == 1, "the record committed while deep idle")
    wait_until(lambda: loop.stats()["deep_watches"] > after["deep_watches"], "long idle again")
    again = loop.stats()
    assert again["busy"] >= 1 and again["spins"] > after["spins"] and again["watches"] > after["watches"]
    loop.stop()
    assert loop.reasons == [SERVE_LINK, SERVE_INTERRUPTED] and loop.chunks() == [0]


@SIDES
@pytest.mark.parametrize("phase", ["watch", "deep"])
def test_records_committed_while_the_loop_watches_or_naps_are_taken(loops, model: bool, phase: str) -> None:
    loop = loops(model, **PHASES[phase]).start()
    key = {"watch": "watches", "deep": "deep_watches"}[phase]
    for i in range(20):
        wait_until(lambda: loop.stats()[key] > 0, "the loop to be idle")
        loop.push(put(i))
        wait_until(lambda i=i: loop.ring.completion_pos == i + 1, f"record {i}")
        time.sleep(0.002 * (i % 3))
    loop.stop()
    assert loop.chunks() == list(range(20)) and loop.reasons == [SERVE_INTERRUPTED]


def test_a_python_backend_gets_its_pass_inside_the_loop_and_python_runs_beside_it(loops) -> None:
    """The null backend's post and poll are Python: the engine's loop takes the GIL for those calls only,
    so another thread keeps running Python while the loop serves (busy or idle)."""
    backend = NullBackend(keep_plans=True)
    loop = loops(backend=backend, capacity=64, **SPIN_ONLY).start()
    ticks = 0
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # the loop thread is spinning, calling poll() every pass
        ticks += 1
    for i in range(500):
        loop.push(put(i, 1 + i % (WORLD - 1)))
    wait_until(lambda: loop.ring.completion_pos == 500, "every record to complete through Python post/poll")
    loop.stop()
    assert ticks > 1000 and loop.chunks() == list(range(500))
    assert backend.counts["writes"] == 500 and loop.proxy.loop_stats()["busy"] > 0


class _Exploding(NullBackend):
    def poll(self, max_completions: int = 256) -> np.ndarray:
        if self.explode:
            raise RuntimeError("poll failed")
        return super().poll(max_completions)


def test_an_exception_in_a_backends_python_call_ends_serve_with_it(loops) -> None:
    backend = _Exploding(keep_plans=True)
    backend.explode = False
    loop = loops(backend=backend, **WATCH_ONLY).start()
    wait_until(lambda: loop.stats()["watches"] > 0, "the loop to be idle")
    backend.explode = True
    wait_until(lambda: not loop.thread.is_alive(), "serve to end with the backend's exception")
    assert isinstance(loop.error, RuntimeError) and "poll failed" in str(loop.error)
    loop.error = None


def test_a_table_call_from_another_thread_interrupts_the_loop_and_gets_in(loops) -> None:
    """Proxy's lock is held while serve runs; a table call from another thread interrupts the loop until it
    gets the lock, and the loop goes on with the new table."""
    loop = loops(**DEEP_ONLY).start()
    wait_until(lambda: loop.stats()["deep_watches"] > 0, "the loop to be long idle")
    start = time.monotonic()
    loop.proxy.set_remote_region(JOB, 2, 1, 0x700_0000, REGION, 77)
    assert time.monotonic() - start < LONG / 2
    loop.push(Command(Opcode.PUT, peer=2, dst_region=1, length=64, chunk_id=9))
    wait_until(lambda: loop.ring.completion_pos == 1, "a record for the new region")
    loop.stop()
    assert loop.ring.error == (0, 0, 0) and loop.chunks() == [9]
    assert set(loop.reasons) == {SERVE_INTERRUPTED}


def _scenario(loop: Loop) -> tuple:
    """Bursts, idle gaps in every phase, requests between them: what was taken, posted and completed."""
    loop.start()
    n = 0
    for burst, gap_s in ((40, 0.0), (7, 0.003), (1, 0.03), (120, 0.08), (3, 0.0)):
        for _ in range(burst):
            loop.push(put(n, 1 + n % (WORLD - 1)))
            n += 1
        wait_until(lambda m=n: loop.ring.completion_pos == m, f"{n} records to complete")
        time.sleep(gap_s)
        served = loop.served
        loop.request()
        wait_until(lambda s=served: loop.served == s + 1, "the request to be served")
    loop.stop()
    return (loop.ring.consumer_pos, loop.ring.completion_pos, loop.ring.error, loop.chunks(), loop.reasons,
            loop.proxy.stats()["commands"])


def test_the_engine_loop_and_its_model_agree_over_one_scenario(loops) -> None:
    pol = policy(spin_s=0.002, deep_after_s=0.02)
    engine, model = _scenario(loops(False, **pol)), _scenario(loops(True, **pol))
    assert engine == model
    assert engine[4] == [SERVE_LINK] * 5 + [SERVE_INTERRUPTED]
