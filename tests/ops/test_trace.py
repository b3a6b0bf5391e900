"""Trace record and replay end to end: real daemons over softverbs, ``transportctl trace``, ``transportd replay``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import gpuclient
from tests.support.cluster import Rank, close_ranks, join_ranks, started_clusters
from tests.support.ctl import assert_one_line, ctl
from tests.support.waiting import wait_until
from transportd.dataplane.trace import ENTRY_DTYPE, FAILED, TAKEN, Trace, read_trace, write_trace
from transportd.errors import ErrorCode
from transportd.ops.metrics import job_traffic, render_metrics
from transportd_cli import bench_proxy
from transportd_cli.cli import main as transportd_main
from transportd_cli.localcluster import LocalCluster
from transportd_cli.replay import compare_traces, format_report, run_replay

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

JOB = "traced"
CHUNK = 4096
NBYTES = 16 * CHUNK
PUTS = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with started_clusters() as make:
        yield make(nodes=2)


def _traffic(a: Rank, b: Rank) -> int:
    """PUT_SIGNALs a -> b, a bad region, an out-of-bounds PUT, a SIGNAL SET; returns how many records."""
    for i in range(PUTS):
        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=i * CHUNK, src_region=a.src.id, src_off=i * CHUNK,
                             nbytes=CHUNK, slot=0, value=1)
    a.channel.put(peer=1, dst_region=77, dst_off=0, src_region=a.src.id, src_off=0, nbytes=CHUNK)
    a.channel.put(peer=1, dst_region=b.dst.id, dst_off=NBYTES - CHUNK + 8, src_region=a.src.id, src_off=0,
                  nbytes=CHUNK)
    a.channel.signal(peer=1, slot=1, value=5, op="set")
    return PUTS + 3


@pytest.fixture(scope="module")
def recorded(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """Rank 0 of JOB traced on nodea while it sends :func:`_traffic`; the trace file and the stop's JSON."""
    out = tmp_path_factory.mktemp("trace") / "rank0.trace"
    ranks = join_ranks(cluster, job=JOB, nbytes=NBYTES)
    a, b = ranks
    try:
        started = ctl("trace", "start", JOB, "0", "--out", str(out), "--socket", cluster.socket("nodea"), "--json")
        assert started.exit_code == 0, started.stderr
        assert started.json()["channels"] == 1
        n = _traffic(a, b)
        assert b.session.wait(slot=0, at_least=PUTS, timeout=30) == PUTS
        assert b.session.wait(slot=1, at_least=5, timeout=30) == 5
        wait_until(lambda: a.channel.ring.completion_pos >= n, what="every traced record to complete")
        stats = a.client.stats()
        stopped = ctl("trace", "stop", JOB, "0", "--socket", cluster.socket("nodea"), "--json")
        assert stopped.exit_code == 0, stopped.stderr
        yield out, {"stop": stopped.json(), "stats": stats, "records": n, "dst": b.dst.id}
    finally:
        close_ranks(ranks)


def test_the_trace_holds_every_record_with_its_outcome(recorded: tuple[Path, dict]) -> None:
    out, info = recorded
    assert info["stop"]["entries"] == info["records"] and info["stop"]["dropped"] == 0
    assert info["stop"]["out"] == str(out)
    trace = read_trace(out)
    taken = trace.taken
    assert taken["code"].tolist() == [0] * PUTS + [ErrorCode.BAD_REGION, ErrorCode.OUT_OF_BOUNDS, 0]
    assert taken["position"].tolist() == list(range(info["records"]))
    assert taken["record"]["opcode"].tolist() == [2] * PUTS + [1, 1, 3]
    assert taken["record"]["dst_off"].tolist()[:PUTS] == [i * CHUNK for i in range(PUTS)]
    assert len(trace.failed) == 0
    ctx = trace.context
    assert (ctx["job"], ctx["rank"], ctx["world"], ctx["node"]) == (JOB, 0, 2, "nodea")
    assert ctx["peers"]["1"]["connected"] and ctx["peers"]["1"]["flags"] == 64
    assert NBYTES in ctx["peers"]["1"]["regions"].values() and NBYTES in ctx["sources"].values()
    assert np.all(np.diff(taken["t_ns"].astype(np.int64)) >= 0) and taken["t_ns"][0] >= trace.start_mono_ns


def test_errors_by_code_per_rank_reach_the_metrics(recorded: tuple[Path, dict]) -> None:
    stats = recorded[1]["stats"]
    assert job_traffic(stats)[JOB]["errors_by_code"][0] == {"BAD_REGION": 1, "OUT_OF_BOUNDS": 1}
    assert stats["jobs"][JOB]["traffic"]["errors_by_code"]["0"] == {"BAD_REGION": 1, "OUT_OF_BOUNDS": 1}
    text = render_metrics(stats)
    assert f'transportd_job_command_errors_bad_region_total{{job="{JOB}",node="nodea",rank="0"}} 1.0' in text
    assert f'transportd_job_command_errors_out_of_bounds_total{{job="{JOB}",node="nodea",rank="0"}} 1.0' in text
    assert f'transportd_job_command_errors_bad_peer_total{{job="{JOB}",node="nodea",rank="0"}} 0.0' in text


def test_replay_against_the_daemons_finds_no_difference(cluster: LocalCluster, recorded: tuple[Path, dict]) -> None:
    out, info = recorded
    report = run_replay(str(out), [cluster.socket("nodea"), cluster.socket("nodeb")], pace="recorded", timeout=30)
    assert report["same"], format_report(report)
    assert report["records"] == {"recorded": info["records"], "replayed": info["records"]}
    assert report["outcomes"]["recorded"] == report["outcomes"]["replayed"] == {
        "BAD_REGION": 1, "OK": info["records"] - 2, "OUT_OF_BOUNDS": 1}
    assert report["job"] != JOB and report["replay_dropped"] == 0


def test_replay_reports_what_differed(cluster: LocalCluster, recorded: tuple[Path, dict], tmp_path: Path) -> None:
    """The same records against a smaller destination region: the PUTs past its end are now refused."""
    trace = read_trace(recorded[0])
    trace.context["peers"]["1"]["regions"][str(recorded[1]["dst"])] = 4 * CHUNK
    smaller = tmp_path / "smaller.trace"
    write_trace(smaller, trace.context, trace.entries, trace.start_mono_ns, trace.start_wall_ns)
    result = CliRunner().invoke(transportd_main, ["replay", str(smaller), "--socket", cluster.socket("nodea"),
                                                  "--socket", cluster.socket("nodeb"), "--pace", "fast", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert not report["same"] and report["differences"] == PUTS - 4
    assert [d["index"] for d in report["listed"]] == list(range(4, PUTS))
    assert {(tuple(d["recorded"]), tuple(d["replayed"])) for d in report["listed"]} == {(("OK",), ("OUT_OF_BOUNDS",))}


def test_trace_refusals_are_one_line_and_exit_1(cluster: LocalCluster, tmp_path: Path) -> None:
    socket = cluster.socket("nodea")
    missing = ctl("trace", "start", "nosuchjob", "0", "--out", str(tmp_path / "t"), "--socket", socket)
    assert missing.exit_code == 1 and "not joined" in missing.stderr
    stop = ctl("trace", "stop", "nosuchjob", "0", "--socket", socket)
    assert stop.exit_code == 1 and "not traced" in stop.stderr
    unwritable = ctl("trace", "start", JOB, "0", "--out", str(tmp_path / "no" / "such" / "dir"), "--socket", socket)
    assert unwritable.exit_code == 1 and "cannot write" in unwritable.stderr


def test_a_trace_stopped_after_its_job_ended_keeps_the_context(cluster: LocalCluster, tmp_path: Path) -> None:
    """Recording a whole run: the ranks leave before `trace stop`, and the context still holds what the job
    looked like while they were in it, so the replay takes every record as the recording did."""
    out = tmp_path / "whole-run.trace"
    ranks = join_ranks(cluster, job="ended", nbytes=NBYTES)
    a, b = ranks
    try:
        started = ctl("trace", "start", "ended", "0", "--out", str(out), "--socket", cluster.socket("nodea"))
        assert started.exit_code == 0, started.stderr
        n = _traffic(a, b)
        assert b.session.wait(slot=1, at_least=5, timeout=30) == 5
        wait_until(lambda: a.channel.ring.completion_pos >= n, what="every traced record to complete")
    finally:
        close_ranks(ranks)
    stopped = ctl("trace", "stop", "ended", "0", "--socket", cluster.socket("nodea"))
    assert stopped.exit_code == 0, stopped.stderr
    assert f"wrote {n} entries" in stopped.stdout
    ctx = read_trace(out).context
    assert sorted(ctx["sources"].values()) == [NBYTES, NBYTES]
    assert sorted(ctx["peers"]["1"]["regions"].values()) == [NBYTES, NBYTES] and ctx["peers"]["1"]["flags"] == 64
    report = run_replay(str(out), [cluster.socket("nodea"), cluster.socket("nodeb")], pace="fast", timeout=30)
    assert report["same"], format_report(report)


def test_a_trace_with_an_empty_context_is_not_reported_as_written(cluster: LocalCluster, tmp_path: Path) -> None:
    """A rank with a channel but no region and no flags: nothing a replay could rebuild; `trace stop` writes
    the file but says so and exits 1, instead of printing success."""
    out = tmp_path / "bare.trace"
    client = gpuclient.connect(cluster.socket("nodea"))
    try:
        channel = client.join("bare", rank=0, world=1).channel(capacity=64)
        assert ctl("trace", "start", "bare", "0", "--out", str(out), "--socket", cluster.socket("nodea")).exit_code == 0
        channel.signal(peer=0, slot=0, value=1)  # refused (no flags), but taken, so recorded
        wait_until(lambda: channel.status()[1] == 1, what="the refused signal")
        stopped = ctl("trace", "stop", "bare", "0", "--socket", cluster.socket("nodea"))
    finally:
        client.close()
    assert stopped.exit_code == 1 and not stopped.stdout
    assert "knows no region or flag array" in assert_one_line(stopped.stderr)
    assert read_trace(out).taken["code"].tolist() == [ErrorCode.BAD_PEER]


def test_a_refused_trace_start_leaves_no_file(cluster: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "never.trace"
    refused = ctl("trace", "start", "nosuchjob", "0", "--out", str(out), "--socket", cluster.socket("nodea"))
    assert refused.exit_code == 1 and "not joined" in refused.stderr
    assert not out.exists()


def test_a_bad_out_at_trace_stop_keeps_the_recording(cluster: LocalCluster, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`trace stop --out` to a path that cannot be written is refused before the recording stops; and when the
    path `trace start` named has gone by the stop, the trace is saved in a file of its own, named."""
    monkeypatch.chdir(tmp_path)
    socket = cluster.socket("nodea")
    ranks = join_ranks(cluster, job="kept", nbytes=NBYTES)
    a, b = ranks
    try:
        gone = tmp_path / "gone"
        gone.mkdir()
        assert ctl("trace", "start", "kept", "0", "--out", str(gone / "t.trace"), "--socket", socket).exit_code == 0
        n = _traffic(a, b)
        wait_until(lambda: a.channel.ring.completion_pos >= n, what="every traced record to complete")
        bad = ctl("trace", "stop", "kept", "0", "--out", str(tmp_path / "no" / "dir" / "t.trace"), "--socket", socket)
        assert bad.exit_code == 1 and "recording goes on" in assert_one_line(bad.stderr)
        good = ctl("trace", "stop", "kept", "0", "--out", str(tmp_path / "good.trace"), "--socket", socket, "--json")
        assert good.exit_code == 0, good.stderr
        assert good.json()["entries"] == n and len(read_trace(tmp_path / "good.trace").taken) == n
        # again, and this time the directory `trace start --out` named is removed before the stop
        assert ctl("trace", "start", "kept", "0", "--out", str(gone / "t.trace"), "--socket", socket).exit_code == 0
        n2 = _traffic(a, b)
        wait_until(lambda: a.channel.ring.completion_pos >= n + n2, what="the second traced records to complete")
        gone.rmdir()
        lost = ctl("trace", "stop", "kept", "0", "--socket", socket)
    finally:
        close_ranks(ranks)
    assert lost.exit_code == 1
    saved = re.search(r"saved it to (\S+) instead", assert_one_line(lost.stderr))
    assert saved and Path(saved.group(1)).parent == tmp_path
    assert len(read_trace(saved.group(1)).taken) == n2


def _trace(taken: list[tuple[int, int]], failed: list[tuple[int, int]] = (), channel: int = 1) -> Trace:
    """A trace of ``taken`` (position, code) TAKEN entries and ``failed`` (position, code) FAILED ones."""
    entries = np.zeros(len(taken) + len(failed), dtype=ENTRY_DTYPE)
    entries["channel"] = channel
    for i, (pos, code) in enumerate(taken):
        entries[i]["position"], entries[i]["code"], entries[i]["kind"] = pos, code, TAKEN
    for i, (pos, code) in enumerate(failed, start=len(taken)):
        entries[i]["position"], entries[i]["code"], entries[i]["kind"] = pos, code, FAILED
    return Trace({}, entries)


def test_compare_matches_records_by_order_and_counts_later_codes() -> None:
    recorded = _trace([(10, 0), (11, 3), (12, 0)], [(12, ErrorCode.REMOTE_ACCESS)])
    same = compare_traces(recorded, _trace([(0, 0), (1, 3), (2, 0)], [(2, ErrorCode.REMOTE_ACCESS)], channel=7),
                          {1: 7})
    assert same["same"] and same["records"] == {"recorded": 3, "replayed": 3}
    assert same["outcomes"]["recorded"] == {"BAD_REGION": 1, "OK": 2, "REMOTE_ACCESS": 1}
    differ = compare_traces(recorded, _trace([(0, 0), (1, 3)], channel=7), {1: 7})
    assert not differ["same"] and differ["differences"] == 1
    assert differ["listed"] == [{"channel": 1, "index": 2, "opcode": 0, "recorded": ["OK", "REMOTE_ACCESS"],
                                 "replayed": None}]
    assert "DIFFERENT" in format_report({**differ, "pace": "fast", "recorded_span_s": 0.0, "replay_push_s": 0.0})


def test_bench_proxy_trace_parts_record_every_record() -> None:
    opts = dict(batch_max=8, poll_window_us=0, inflight_cap=256)
    drain = bench_proxy._drain(1024, 2, peers=4, channels=2, opts=opts, trace=True)
    assert drain["traced"] and drain["trace_entries"] == 2 * 2 * 1024
    pp = bench_proxy._live(200, 64, peers=3, max_batch=1, interval_ns=0, opts=dict(poll_window_us=0), pingpong=True,
                           trace=True)
    assert pp["trace_entries"] == 200
