"""Summaries of ``SOFTVERBS_TRACE`` files (`softverbs._trace`): where a message's time goes, step by step.

A caller stamps ``start <label>`` before each message it times and ``done`` after it; every process of the
fabric stamps its own steps in between (what any process stamps after the starter's ``done``, an I/O thread's
later wake-up say, belongs to no cycle). `summarize` splits the merged stamps into cycles at each ``start``
and gives, per label, each step's median and 10th-percentile time from its cycle's start. A step is named
``p<i>:<step>#<n>``: the i-th process to stamp in that label's cycles (p0 is the one that stamps ``start``),
its n-th such step in the cycle.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

__all__ = ["read", "ready_waits", "steps", "summarize"]


def read(directory: str | Path) -> list[tuple[int, int, str]]:
    """Every stamp of every ``trace-*.txt`` under ``directory``, as (ns, pid, step), in time order (a file's
    zero-filled room past its last line is not read)."""
    stamps = []
    for path in Path(directory).glob("trace-*.txt"):
        for line in path.read_bytes().rstrip(b"\0").decode().splitlines():
            ns, pid, step = line.split(" ", 2)
            stamps.append((int(ns), int(pid), step))
    stamps.sort()
    return stamps


def summarize(directory: str | Path, skip: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Per ``start`` label, its steps in the order of their median time (µs from the cycle's start):
    ``{"step", "n", "median_us", "p10_us"}``; the first ``skip`` cycles of each label are left out (warm-up)."""
    cycles: dict[str, list[list[tuple[int, int, str]]]] = defaultdict(list)
    current: list[tuple[int, int, str]] | None = None
    for ns, pid, step in read(directory):
        if step.startswith("start"):
            current = [(ns, pid, step)]
            cycles[step.partition(" ")[2]].append(current)
        elif current is not None:
            current.append((ns, pid, step))
            if step == "done" and pid == current[0][1]:  # what comes after its done belongs to no cycle
                current = None
    out: dict[str, list[dict[str, Any]]] = {}
    for label, runs in cycles.items():
        runs = runs[skip:]
        order: dict[int, int] = {}
        times: dict[str, list[float]] = defaultdict(list)
        for run in runs:
            t0 = run[0][0]
            seen: Counter[str] = Counter()
            for ns, pid, step in run:
                name = f"p{order.setdefault(pid, len(order))}:{step}"
                seen[name] += 1
                if step.startswith("start"):
                    continue
                times[f"{name}#{seen[name]}"].append((ns - t0) / 1e3)
        rows = [{"step": name, "n": len(v), "median_us": statistics.median(v),
                 "p10_us": sorted(v)[len(v) // 10]} for name, v in times.items()]
        out[label] = sorted(rows, key=lambda r: r["median_us"])
    return out


def steps(directory: str | Path) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Every stamp of each label's last cycle, from its ``start`` to the ``done`` of the process that started it
    (stamps after that belong to no cycle): ``{label: {"p<i>": {step: [µs from the start, in order]}}}``, the
    processes numbered as in `summarize`. For a cycle that carries many messages (a whole kernel launch), where
    `summarize`'s medians over cycles would mix them."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    label: str | None = None
    t0 = owner = 0
    order: dict[int, int] = {}
    for ns, pid, step in read(directory):
        if step.startswith("start"):
            label, t0, owner, order = step.partition(" ")[2], ns, pid, {pid: 0}
            out[label] = {}
        elif label is not None:
            name = f"p{order.setdefault(pid, len(order))}"
            out[label].setdefault(name, {}).setdefault(step, []).append((ns - t0) / 1e3)
            if step == "done" and pid == owner:
                label = None
    return out


#: a read this long after its thread's ``ready`` counts as a wait (the loop's own Python is ~10-20 µs)
SLOW_READ_US = 50.0


def ready_waits(directory: str | Path) -> dict[int, dict[str, float | int]]:
    """Per process, how long its I/O thread took from an epoll wait's return (``ready``, stamped before the GIL is
    taken back) to the ``read`` that followed: the wait for the GIL plus the loop's Python. ``{pid: {"n",
    "p50_us", "p90_us", "slow", "slow_in_own_post"}}``: ``slow`` of them took over ``SLOW_READ_US``, and
    ``slow_in_own_post`` of those overlapped a batch post of the same process (from its ``post`` to its
    ``posted``), which held the GIL meanwhile. Processes with no such pair are left out."""
    per: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for ns, pid, step in read(directory):
        per[pid].append((ns, step))
    out: dict[int, dict[str, float | int]] = {}
    for pid, seq in per.items():
        posts: list[list[int]] = []  # [post, posted] (the stamps are in time order; one posting thread)
        pairs = []  # (ready, the read after it)
        ready = None
        for ns, step in seq:
            if step == "post":
                posts.append([ns, ns])
            elif step == "posted" and posts:
                posts[-1][1] = ns
            elif step == "ready":
                ready = ns
            elif step == "read" and ready is not None:
                pairs.append((ready, ns))
                ready = None
        gaps, slow_in_post, first = [], 0, 0
        for ready_ns, read_ns in pairs:
            gap = (read_ns - ready_ns) / 1e3
            gaps.append(gap)
            while first < len(posts) and posts[first][1] < ready_ns:
                first += 1  # posts that ended before this wait began overlap no later one either
            # one posting thread: its posts are disjoint and in order, so the first one not over by the wait's
            # start is the only one that can overlap it
            if gap > SLOW_READ_US and first < len(posts) and posts[first][0] <= read_ns:
                slow_in_post += 1
        if gaps:
            out[pid] = {"n": len(gaps), "p50_us": round(statistics.median(gaps), 1),
                        "p90_us": round(sorted(gaps)[int(0.9 * (len(gaps) - 1))], 1),
                        "slow": sum(g > SLOW_READ_US for g in gaps), "slow_in_own_post": slow_in_post}
    return out

