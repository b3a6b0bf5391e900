"""benchmarks/fused_timing.py: the daemons settled before a timed phase (on real daemons), per-launch counter
columns, and the modes of a row timed in turn."""

from __future__ import annotations

from collections import Counter

import pytest

from benchmarks import fused_timing


@pytest.mark.multiprocess
def test_settle_waits_until_no_rail_has_work_in_flight() -> None:
    """``_settle`` on two real daemons over a slow modeled link: while a burst of PUTs is in a ring or on the wire
    it gives up after its timeout, and once it returns no rail has a record in a ring or taken and not complete,
    a work request in flight or a record waiting for its batch."""
    from tests.support.cluster import close_ranks, join_ranks
    from transportd_cli.localcluster import LocalCluster

    nbytes, puts = 1 << 16, 16  # 1 MiB at 20 MB/s: the link is busy for ~50 ms after the last push
    overrides = {"softverbs": {"nic_bandwidth": 20e6, "nic_latency_s": 1e-3}}
    with LocalCluster(2, backend="ib", overrides=overrides) as cluster:
        ranks = join_ranks(cluster, "settle", nbytes=nbytes, flags=8)
        clients = [r.client for r in ranks]
        try:
            sender, receiver = ranks
            for _ in range(puts):
                sender.channel.put(1, receiver.dst.id, 0, sender.src.id, 0, nbytes)
            with pytest.raises(TimeoutError, match="did not settle"):
                fused_timing.settle(clients, timeout=0.0)
            fused_timing.settle(clients)
            rails = [r for c in clients for r in c.stats()["rails"]]
            assert rails and not any(r["inflight"] or r["pending_rows"] for r in rails)
            rings = [ring for r in rails for ring in r["queues"]["rings"]]
            assert rings and not any(ring["depth"] or ring["outstanding"] for ring in rings)
            assert sum(r["commands"] for r in rails) >= puts  # the burst was taken, not lost
            sender.channel.quiet(timeout=10)
        finally:
            close_ranks(ranks)


def test_per_launch_columns_are_each_daemons_counters_over_a_phase_divided_by_its_launches() -> None:
    zero = dict.fromkeys((key for key, _, _ in fused_timing.PER_LAUNCH), 0)
    before = [zero, {**zero, "direct_ns": 1_000_000}]
    middle = [{**zero, "direct_ns": 6_000_000, "flag_copies": 30}, {**zero, "direct_ns": 3_000_000}]
    after = [{**middle[0], "link_busy_ns": 9_000_000}, middle[1]]
    row: dict = {}

    def counted(start: list[dict], end: list[dict]) -> list:  # what each daemon counted from start to end
        return [Counter({key: e[key] - b[key] for key in b}) for b, e in zip(start, end, strict=True)]

    fused_timing.per_launch(row, {"comm": counted(before, middle), "fused": counted(middle, after)}, reps=3)
    assert row["comm_direct_copy_ms"] == [2.0, pytest.approx(0.667)]
    assert row["comm_flag_copies"] == [10.0, 0.0] and row["fused_flag_copies"] == [0.0, 0.0]
    assert row["fused_link_busy_ms"] == [3.0, 0.0] and row["comm_loopback_wait_ms"] == [0.0, 0.0]
    assert set(row) == {f"{mode}_{name}" for mode in ("comm", "fused") for _, name, _ in fused_timing.PER_LAUNCH}


def test_interleaved_runs_the_modes_in_turn_and_counts_only_around_the_counted_ones() -> None:
    """Each round runs every mode once, in order, after one untimed round; the medians are per mode; the counted
    modes' columns are what the daemons counted across their own timed launches alone (a counter that moves only
    during ``comm`` launches lands in comm's column, none in fused's)."""
    calls: list[str] = []
    placed = [0]

    class Daemon:  # a client whose one rail counts direct copies
        def stats(self) -> dict:
            return {"rails": [{"softverbs": {"direct_placed": placed[0], "direct_ns": 1000 * placed[0]}}]}

    def launch(mode: str, seconds: list[float]):
        def run() -> float:
            calls.append(mode)
            if mode == "comm":
                placed[0] += 4
            return seconds[sum(1 for c in calls if c == mode) - 1]
        return run

    # the first of each: the untimed round (a compile, say)
    times = {"compute": [90.0, 3.0, 1.0, 2.0], "comm": [90.0, 5.0, 6.0, 4.0], "fused": [90.0, 7.0, 9.0, 8.0],
             "torch": [90.0, 1.0, 1.0, 1.0]}
    launches = {mode: launch(mode, t) for mode, t in times.items()}
    seconds, counted_by = fused_timing.interleaved(launches, 3, [Daemon(), Daemon()])
    assert calls == ["compute", "comm", "fused", "torch"] * 4
    assert seconds == {"compute": 2.0, "comm": 5.0, "fused": 8.0, "torch": 1.0}
    row: dict = {}
    fused_timing.per_launch(row, counted_by, reps=3)
    assert row["comm_direct_copy_ms"] == [pytest.approx(0.004)] * 2  # 4 copies of 1 µs a launch, each daemon
    assert row["fused_direct_copy_ms"] == [0.0, 0.0]
