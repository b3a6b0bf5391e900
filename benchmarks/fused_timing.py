"""How a fused row's times and the daemons' counters are taken: launches timed on the host clock until the
GPU is idle, the modes of a row in turn over its rounds, and what each daemon counted over a mode's launches."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any


def time_once(launch: Callable[[], None], streams: list[Any]) -> float:
    """Seconds of one ``launch()`` (every rank's kernel, each on its stream) until the GPU is idle."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    launch()
    for s in streams:
        s.synchronize()
    return time.perf_counter() - t0


def time_median(launch: Callable[[], None], streams: list[Any], reps: int) -> float:
    """Median seconds of ``reps`` launches (``time_once``)."""
    return statistics.median(time_once(launch, streams) for _ in range(reps))


def interleaved(launches: dict[str, Callable[[], float]], reps: int, clients: list[Any],
                counted: tuple[str, ...] = ("comm", "fused")
                ) -> tuple[dict[str, float], dict[str, list[Counter[str]]]]:
    """Each mode's median seconds over ``reps`` rounds, a round running every mode's launch once in turn (so a
    drift of the soft fabric or the GPU over the row weighs on every mode alike, where timing each mode's launches
    in a block left it to whichever mode ran then); and, for the ``counted`` modes, what each daemon counted
    (``daemon_counters``) over their launches, read just before and after each one, outside its time (``per_launch``
    takes it). One untimed round first: a mode's first launch may compile its variant or initialize a library
    (cuBLAS), which a median of two would still carry."""
    for launch in launches.values():
        launch()
    samples: dict[str, list[float]] = {mode: [] for mode in launches}
    counted_by: dict[str, list[Counter[str]]] = {mode: [Counter() for _ in clients] for mode in counted}
    for _ in range(reps):
        for mode, launch in launches.items():
            if mode not in counted:
                samples[mode].append(launch())
                continue
            before = [daemon_counters(c) for c in clients]
            samples[mode].append(launch())
            for total, b, a in zip(counted_by[mode], before, [daemon_counters(c) for c in clients], strict=True):
                total.update({key: a[key] - b[key] for key in a})
    return {mode: statistics.median(v) for mode, v in samples.items()}, counted_by


COUNTED = ("commands", "wrs", "writes", "signals", "signals_requested", "fences", "direct_placed")


def daemon_counters(client: Any) -> dict[str, int]:
    """A daemon's rails' counters, the writes its soft devices placed by direct copy (``direct_placed``: the
    rest of what they received crossed TCP), the nanoseconds they spent placing them (``direct_ns``), those its
    workers spent in flag loopback writes (``loopback_ns``), those its NIC model's links were busy
    (``link_busy_ns``) and the flag words its workers copied into GPU memory (``flag_copies``)."""
    rails = [r for r in client.stats().get("rails", []) if "error" not in r]
    out = {key: sum(int(r.get(key, 0)) for r in rails) for key in COUNTED}
    for key in ("direct_placed", "direct_ns"):
        out[key] = sum(int((r.get("softverbs") or {}).get(key, 0)) for r in rails)
    out["loopback_ns"] = sum(int((r.get("flag_loopback") or {}).get("wait_ns", 0)) for r in rails)
    out["flag_copies"] = sum(int(r.get("flag_copies", 0)) for r in rails)
    out["link_busy_ns"] = sum(int(1e9 * ((r.get("softverbs") or {}).get("link") or {}).get("busy_s", 0.0))
                              for r in rails)
    return out


def settle(clients: list[Any], timeout: float = 30.0) -> None:
    """Wait until no rail of any daemon has a record in a ring, a record taken and not complete, a work request
    in flight or a record waiting for its batch, so that a timed phase does not pay for what the phase before it
    left the daemons to finish (and both row types start each phase from the same state: fp8's untimed
    dequantization is a pause bf16 has not)."""
    def rings(rail: dict[str, Any]) -> list[tuple[int, int]]:
        return [(ring["depth"], ring["outstanding"]) for ring in rail.get("queues", {}).get("rings", [])]

    def busy(rail: dict[str, Any]) -> bool:
        return bool(rail.get("inflight") or rail.get("pending_rows") or any(any(ring) for ring in rings(rail)))

    deadline = time.monotonic() + timeout
    while True:
        rails = [r for c in clients for r in c.stats().get("rails", []) if "error" not in r]
        if not any(busy(r) for r in rails):
            return
        if time.monotonic() >= deadline:
            left = [{"inflight": r.get("inflight"), "pending_rows": r.get("pending_rows"), "rings": rings(r)}
                    for r in rails if busy(r)]
            raise TimeoutError(f"the daemons did not settle in {timeout} s: {left}")


#: per launch and daemon, from ``daemon_counters``: (counter, row column, scale): the time its soft devices spent
#: placing direct copies (each blocks their thread), its workers spent in flag loopback writes (efa without
#: GDRCopy), its NIC model's link was busy, and the flag words its workers copied into GPU memory (efa, cuda-copy)
PER_LAUNCH = (("direct_ns", "direct_copy_ms", 1e-6), ("loopback_ns", "loopback_wait_ms", 1e-6),
              ("link_busy_ns", "link_busy_ms", 1e-6), ("flag_copies", "flag_copies", 1.0))


def per_launch(row: dict[str, Any], counted_by: dict[str, list[Counter[str]]], reps: int) -> None:
    """``row[f"{mode}_{column}"]``: what each daemon counted over a mode's ``reps`` launches (``interleaved``), per
    launch, for every ``PER_LAUNCH`` column."""
    for key, name, scale in PER_LAUNCH:
        for mode, daemons in counted_by.items():
            row[f"{mode}_{name}"] = [round(counted[key] / reps * scale, 3) for counted in daemons]
