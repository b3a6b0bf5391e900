"""Worker pinning: the cpulist parser and the decision (config node, else the NIC's sysfs node, else none)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from transportd.dataplane.pinning import choose_cpus, format_cpulist, nic_numa_node, parse_cpulist, pin_worker


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3,8-11\n", [0, 1, 2, 3, 8, 9, 10, 11]),
    ("5", [5]),
    ("", []),
    ("\n", []),
    ("0,2,4", [0, 2, 4]),
    ("3-3", [3]),
    ("8-11,0-1", [0, 1, 8, 9, 10, 11]),
    ("0-15:2/4", [0, 1, 4, 5, 8, 9, 12, 13]),
])
def test_cpulist_parser(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text) == cpus


def test_cpulist_round_trip() -> None:
    for cpus in ([0, 1, 2, 5], [7], [0, 2, 4], list(range(64)) + [96, 97]):
        assert parse_cpulist(format_cpulist(cpus)) == cpus
    assert format_cpulist([0, 1, 2, 5]) == "0-2,5" and format_cpulist([]) == "none"


@pytest.mark.parametrize("text", ["a", "3-1", "-1", "1-", "0-7:0/4", "0-7:5/4", "4:1/2", "1,,x"])
def test_cpulist_parser_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="not a cpulist entry"):
        parse_cpulist(text)


def _sysfs(root: Path, nodes: dict[int, str], nics: dict[str, str]) -> Path:
    for node, cpulist in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for name, numa in nics.items():
        d = root / "class" / "infiniband" / name / "device"
        d.mkdir(parents=True)
        (d / "numa_node").write_text(numa + "\n")
    return root


def test_configured_node_wins_over_the_nic(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {"mlx5_0": "0"})
    d = choose_cpus(1, "mlx5_0", sysfs=sysfs, allowed=range(8))
    assert d.cpus == (4, 5, 6, 7) and d.numa_node == 1 and "config" in d.reason


def test_unknown_node_asks_the_nic(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {"mlx5_1": "1", "mlx5_2": "-1"})
    assert nic_numa_node("mlx5_1", sysfs) == 1
    d = choose_cpus(-1, "mlx5_1", sysfs=sysfs, allowed=range(8))
    assert d.cpus == (4, 5, 6, 7) and d.numa_node == 1 and "infiniband/mlx5_1" in d.reason
    # the kernel writes -1 where the platform does not say; a missing NIC (a soft device) says nothing
    for device in ("mlx5_2", "softib1", ""):
        d = choose_cpus(-1, device, sysfs=sysfs, allowed=range(8))
        assert d.cpus is None and d.numa_node == -1 and "unknown" in d.reason
        assert "does not say" not in d.reason and "backend.rails[].numa_node is -1" in d.reason
    assert "no backend.rails entry names the device" in choose_cpus(-1, "", sysfs=sysfs, allowed=range(8)).reason
    assert "softib1 reports none in sysfs" in choose_cpus(-1, "softib1", sysfs=sysfs, allowed=range(8)).reason


def test_only_allowed_cpus_are_chosen(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0-3", 1: "4-7"}, {})
    assert choose_cpus(1, "", sysfs=sysfs, allowed=[0, 1, 5, 7]).cpus == (5, 7)
    d = choose_cpus(1, "", sysfs=sysfs, allowed=[0, 1])  # e.g. a cgroup that excludes the node
    assert d.cpus is None and "allowed" in d.reason


def test_missing_or_broken_node_files_leave_the_worker_unpinned(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "zero"}, {})
    assert choose_cpus(3, "", sysfs=sysfs, allowed=range(4)).cpus is None  # no node3
    assert choose_cpus(0, "", sysfs=sysfs, allowed=range(4)).cpus is None  # unparsable cpulist
    assert nic_numa_node("../../etc", sysfs) == -1


def test_pin_worker_sets_the_affinity_and_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    sysfs = _sysfs(tmp_path, {0: ",".join(map(str, allowed)), 1: "999"}, {})
    calls: list[tuple[int, tuple[int, ...]]] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, tuple(cpus))))
    assert pin_worker(0, 0, "softib0", sysfs=sysfs) == tuple(allowed)
    assert calls == [(0, tuple(allowed))]
    assert pin_worker(1, 1, "softib1", sysfs=sysfs) is None  # CPU 999 is not ours: left alone
    assert pin_worker(1, -1, "softib1", sysfs=sysfs) is None
    assert len(calls) == 1

    def refuse(pid: int, cpus: tuple[int, ...]) -> None:
        raise PermissionError("not allowed")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    assert pin_worker(0, 0, "softib0", sysfs=sysfs) is None


# isolate_loop rearranges every thread of its process: it runs in a child interpreter of its own
LOOP_CHILD = r"""
import json, os, sys, threading
from transportd.dataplane.pinning import isolate_loop

cpu = int(sys.argv[1])
stop = threading.Event()
helpers = [threading.Thread(target=stop.wait) for _ in range(2)]  # like the provider's and the link's threads
for t in helpers:
    t.start()
placed = isolate_loop(0, cpu)
out = {"placed": None if placed is None else [placed.cpu, sorted(placed.others)],
       "loop": sorted(os.sched_getaffinity(0)), "helpers": [sorted(os.sched_getaffinity(t.native_id)) for t in helpers]}
if placed is not None:
    placed.requests()  # a request's thread starts off the loop's CPU
    late = threading.Thread(target=stop.wait)
    late.start()
    out["during_requests"] = sorted(os.sched_getaffinity(0))
    out["started_by_a_request"] = sorted(os.sched_getaffinity(late.native_id))
    placed.loop()
    out["back_in_the_loop"] = sorted(os.sched_getaffinity(0))
    helpers.append(late)
stop.set()
for t in helpers:
    t.join()
print(json.dumps(out))
"""


def _isolate_in_child(cpu: int, cpus: set[int] | None = None) -> dict:
    import json
    import subprocess
    import sys

    pre = [] if cpus is None else ["taskset", "-c", format_cpulist(sorted(cpus))]
    run = subprocess.run([*pre, sys.executable, "-c", LOOP_CHILD, str(cpu)], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a loop CPU of its own needs two CPUs to choose from")
def test_isolate_loop_gives_the_loop_its_cpu_and_the_other_threads_the_rest() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpu, rest = allowed[-1], allowed[:-1]
    got = _isolate_in_child(cpu)
    assert got["placed"] == [cpu, rest] and got["loop"] == [cpu]
    assert got["helpers"] == [rest, rest]
    assert got["during_requests"] == rest and got["started_by_a_request"] == rest
    assert got["back_in_the_loop"] == [cpu]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU the child may not use")
def test_isolate_loop_leaves_the_loop_where_it_is_when_it_cannot() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    for cpu, cpus in ((-1, None), (max(allowed) + 1000, None), (allowed[0], {allowed[0]}), (allowed[1], {allowed[0]})):
        got = _isolate_in_child(cpu, cpus)
        mask = allowed if cpus is None else sorted(cpus)
        assert got["placed"] is None and got["loop"] == mask and got["helpers"] == [mask, mask], (cpu, cpus, got)
