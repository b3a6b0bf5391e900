"""Pin a rail's proxy worker to the CPUs of the NUMA node its NIC sits on ("pinned near it where the
machine says so").

Which node: ``backend.rails[i].numa_node`` when it is 0 or more; with -1 (unknown), the NIC's own
``/sys/class/infiniband/<device>/device/numa_node`` where that file exists (the kernel writes -1 there
when the platform does not say). Which CPUs: ``/sys/devices/system/node/node<N>/cpulist``, intersected
with the CPUs this process may use now (a cgroup or ``taskset`` may have narrowed them); an empty
intersection leaves the worker where it is. Pinning is advice: no outcome of it ever stops a worker from
starting — every reason not to pin (no node known, no sysfs, a refused ``sched_setaffinity``) is logged
and the worker runs unpinned.

The worker pins itself before it opens its device, so the threads the verbs provider starts inherit the
mask.

A rail's ``loop_cpu`` then gives the worker's loop a CPU of its own (:func:`isolate_loop`): the loop's thread
runs there alone, every other thread of the worker is moved to the rest of its CPUs, and the loop's thread
steps onto the rest while it serves a request (:class:`LoopCpu`), so threads a request starts do not land on
the loop's CPU. Advice as well: every reason not to is logged and the loop runs where it is.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoopCpu", "PinDecision", "choose_cpus", "format_cpulist", "isolate_loop", "nic_numa_node", "parse_cpulist",
           "pin_worker"]

log = logging.getLogger("transportd.dataplane.worker")


def parse_cpulist(text: str) -> list[int]:
    """A kernel cpulist (``0-3,8-11``, ``5``, ``0-15:2/4``, empty) -> sorted CPU numbers.

    ``a-b:u/g`` (the kernel's grouped form) takes the first ``u`` CPUs of every group of ``g`` in a-b.
    Raises ValueError on anything else.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        spec, _, group = part.partition(":")
        lo_text, dash, hi_text = spec.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
            used, size = (int(x) for x in group.split("/")) if group else (1, 1)
        except ValueError:
            raise ValueError(f"not a cpulist entry: {part!r}") from None
        if lo < 0 or hi < lo or size < 1 or not 1 <= used <= size or (group and not dash):
            raise ValueError(f"not a cpulist entry: {part!r}")
        cpus.update(c for c in range(lo, hi + 1) if (c - lo) % size < used)
    return sorted(cpus)


def nic_numa_node(device: str, sysfs: str | Path = "/sys") -> int:
    """The NUMA node the kernel reports for RDMA device ``device``; -1 if unknown or not readable."""
    if not device or "/" in device:
        return -1
    try:
        return int((Path(sysfs) / "class" / "infiniband" / device / "device" / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1


@dataclass(frozen=True)
class PinDecision:
    """What to do with a worker: ``cpus`` to pin to (None: leave it), and why, for the log."""

    cpus: tuple[int, ...] | None
    numa_node: int
    reason: str


def choose_cpus(numa_node: int, device: str, *, sysfs: str | Path = "/sys",
                allowed: Iterable[int] | None = None) -> PinDecision:
    """Decide a worker's CPUs from the rail's configured ``numa_node`` (-1: ask the NIC) and ``device``.

    ``allowed``: the CPUs the process may use now (default: ``os.sched_getaffinity(0)``).
    """
    node, source = numa_node, "config"
    if node < 0:
        node, source = nic_numa_node(device, sysfs), f"/sys/class/infiniband/{device}"
        if node < 0:
            where = (f"{device} reports none in sysfs" if device
                     else "no backend.rails entry names the device")
            return PinDecision(None, -1, f"NUMA node unknown: backend.rails[].numa_node is -1 and {where}")
    path = Path(sysfs) / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        cpus = parse_cpulist(path.read_text())
    except OSError:
        return PinDecision(None, node, f"NUMA node {node} ({source}) has no {path}")
    except ValueError as exc:
        return PinDecision(None, node, f"{path}: {exc}")
    may = set(os.sched_getaffinity(0) if allowed is None else allowed)
    chosen = tuple(c for c in cpus if c in may)
    if not chosen:
        return PinDecision(None, node, f"none of NUMA node {node}'s CPUs ({format_cpulist(cpus)}) is allowed here "
                                       f"(allowed: {format_cpulist(sorted(may))})")
    return PinDecision(chosen, node, f"NUMA node {node} ({source})")


def pin_worker(rail: int, numa_node: int, device: str, *, sysfs: str | Path = "/sys") -> tuple[int, ...] | None:
    """Pin this process per :func:`choose_cpus`; returns the CPUs pinned to, or None. Never raises."""
    try:
        decision = choose_cpus(numa_node, device, sysfs=sysfs)
        if decision.cpus is None:
            log.info("rail %d (%s): worker not pinned: %s", rail, device or "first device", decision.reason)
            return None
        os.sched_setaffinity(0, decision.cpus)
    except Exception as exc:  # noqa: BLE001  (pinning is advice: the worker starts whatever happens)
        log.warning("rail %d (%s): worker not pinned: %s", rail, device or "first device", exc)
        return None
    log.info("rail %d (%s): worker pinned to CPUs %s, %s", rail, device or "first device",
             format_cpulist(decision.cpus), decision.reason)
    return decision.cpus


@dataclass(frozen=True)
class LoopCpu:
    """The worker's loop on a CPU of its own: ``cpu`` for the loop's thread, ``others`` for every other thread."""

    cpu: int
    others: frozenset[int]

    def loop(self) -> None:
        """The calling thread (the loop's) back on its own CPU, before the loop goes in again."""
        os.sched_setaffinity(0, {self.cpu})

    def requests(self) -> None:
        """The calling thread onto the other CPUs while it serves requests: what they start starts there."""
        os.sched_setaffinity(0, self.others)


def isolate_loop(rail: int, cpu: int, *, tasks: str | Path = "/proc/self/task") -> LoopCpu | None:
    """Give the calling thread, the worker's loop, CPU ``cpu`` alone, and move every other thread of the process
    (listed in ``tasks``) to the rest of the calling thread's CPUs. None when ``cpu`` is -1, or (logged) not one
    of those CPUs, the only one, or refused. Never raises."""
    if cpu < 0:
        return None
    try:
        mine = os.sched_getaffinity(0)
        if cpu not in mine or len(mine) < 2:
            why = ("it is the worker's only CPU" if mine == {cpu}
                   else f"the worker runs on CPUs {format_cpulist(sorted(mine))}")
            log.warning("rail %d: loop_cpu %d not given to the loop: %s", rail, cpu, why)
            return None
        placed = LoopCpu(cpu, frozenset(mine - {cpu}))
        me = threading.get_native_id()
        for name in os.listdir(tasks):
            tid = int(name)
            if tid == me:
                continue
            try:
                os.sched_setaffinity(tid, placed.others)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        placed.loop()
    except Exception as exc:  # noqa: BLE001  (advice: the loop runs where it is)
        log.warning("rail %d: loop_cpu %d not given to the loop: %s", rail, cpu, exc)
        return None
    log.info("rail %d: the loop has CPU %d to itself; the worker's other threads run on %s", rail, cpu,
             format_cpulist(sorted(placed.others)))
    return placed


def format_cpulist(cpus: Iterable[int]) -> str:
    """Sorted CPU numbers back to cpulist form: [0, 1, 2, 5] -> '0-2,5' (empty: 'none')."""
    out: list[str] = []
    run: list[int] = []
    for c in cpus:
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"
