"""benchmarks/fabric_bench.py: its table and target verdicts from recorded rows, and one row run for real on
host buffers (the GPU rows need a GPU): two daemons, the NIC model set through their config, the sending
rail's schedule read back through transportctl's stats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.benchmarks import load_benchmark


def _row(backend: str, shape: str, gbps: float, configured: float | None = None, intact: bool = True) -> dict:
    row = {"backend": backend, "shape": shape, "buffers": "gpu", "gbps_best": gbps, "gbps_median": gbps * 0.95,
           "intact": intact, "direct_placed_per_write": 1.0, "nic": None}
    if configured is not None:
        row.update(nic={"nic_bandwidth": configured * 1e9}, gbps_configured=configured, of_configured=gbps / configured)
    return row


def test_the_verdict_holds_each_row_to_its_target() -> None:
    bench = load_benchmark("fabric_bench")
    rows = [_row("ib", "unshaped", 31.0), _row("efa", "unshaped", 24.0), _row("ib", "cx7-400g", 46.0, 50.0),
            _row("efa", "efa-200g", 24.4, 25.0, intact=False), _row("ib", "wire", 1.2),
            {"backend": "efa", "shape": "wire", "error": "TimeoutError: stuck"}]
    assert bench.verdict(rows) == {"ib:unshaped": True, "efa:unshaped": False, "ib:cx7-400g": True,
                                   "efa:efa-200g": False}
    table = bench.table(rows).splitlines()
    assert table[0].startswith("| backend | NIC model | GB/s best")
    assert "| ib | cx7-400g (50 GB/s) | 46.00 | 43.70 | 92.0 % | 1.00 | intact |" in table
    assert "CORRUPT" in table[5] and "failed: TimeoutError" in table[-1]


@pytest.mark.multiprocess
def test_a_shaped_row_on_host_buffers_never_beats_its_link() -> None:
    bench = load_benchmark("fabric_bench")
    nic = {"nic_bandwidth": 100e6, "nic_latency_s": 1e-3}
    row = bench.fabric_row("efa", "shaped", 16, 4, 1, buffers="host", chunk=1 << 20, nic=nic, echo=lambda *a: None)
    assert row["intact"] and row["direct_placed"] == 0  # host memory: every write crossed the wire
    assert row["gbps_modeled"] == pytest.approx(0.1)  # the sending rail's schedule, through the daemon's stats
    assert row["of_configured"] <= 1.0 + 1e-3  # nothing lands before the link has carried it


@pytest.mark.multiprocess
def test_one_write_at_a_time_never_lands_before_the_model_says() -> None:
    bench = load_benchmark("fabric_bench")
    nic = {"nic_bandwidth": 100e6, "nic_latency_s": 1e-3}
    sizes = [4096, 256 << 10]
    row = bench.fabric_row("ib", "shaped", 4, 1, 1, buffers="host", chunk=max(sizes), nic=nic,
                           echo=lambda *a: None, latency_sizes=sizes)
    assert [e["bytes"] for e in row["latency"]] == sizes
    for e in row["latency"]:
        assert e["model_us"] == pytest.approx((e["bytes"] / 100e6 + 1e-3) * 1e6)
        assert e["min_us"] >= e["model_us"] * 0.999  # a write and its acknowledgement: never under one way
        assert e["rest_us"] == pytest.approx(e["p50_us"] - e["model_us"] - e["copy_us_per_write"])
    table = bench.latency_table([row, {"backend": "efa", "shape": "x", "error": "TimeoutError: stuck"}]).splitlines()
    assert table[0].startswith("| backend | NIC model | bytes | p50 us")
    assert len(table) == 2 + len(sizes) + 1 and "failed: TimeoutError" in table[-1]


@pytest.mark.multiprocess
def test_a_traced_latency_run_summarizes_the_steps_of_every_process(tmp_path: Path, monkeypatch) -> None:
    """--trace: the daemons and their rail workers inherit SOFTVERBS_TRACE and stamp their steps; the JSON gets
    each step's median from the write's start, the sender's post before its pump and its send, and every step of
    every cycle before this process's done."""
    from click.testing import CliRunner

    from softverbs import _trace

    monkeypatch.setattr(_trace, "DIR", None)  # main sets it (and the environment) for this run only
    monkeypatch.delenv("SOFTVERBS_TRACE", raising=False)
    bench = load_benchmark("fabric_bench")
    out = tmp_path / "x.json"
    result = CliRunner().invoke(bench.main, ["--buffers", "host", "--rows", "ib:unshaped", "--latency", "4096",
                                             "--writes", "10", "--trace", str(tmp_path / "trace"), "--json",
                                             str(out)])
    assert result.exit_code == 0, result.output
    steps = json.loads(out.read_text())["trace"]["ib:unshaped:4096"]
    names = [s["step"].split("#")[0] for s in steps]
    (done,) = [s for s in steps if s["step"] == "p0:done#1"]
    assert done["n"] == 9  # 10 writes, the first left out
    # a step of every cycle comes before that cycle's done (sporadic ones, an I/O thread's wake-up, may not
    # median earlier)
    assert all(s["median_us"] <= done["median_us"] for s in steps if s["n"] == 9)
    firsts = {s["step"].split(":", 1)[1] for s in steps if s["step"].endswith("#1") and s["n"] == 9}
    assert {"post#1", "pump#1", "send 1#1", "read#1", "placed#1", "send 2#1", "polled#1"} <= firsts
    at = {s["step"]: s["median_us"] for s in steps}
    sender = next(n.split(":")[0] for n in at if n.endswith(":post#1"))
    assert at[f"{sender}:post#1"] <= at[f"{sender}:pump#1"] <= at[f"{sender}:send 1#1"]  # one post, in order
    assert len({n.split(":")[0] for n in names}) >= 3  # this process, the sending and the receiving worker
    assert "| step | n | median | p10 |" in result.output
    # both workers' I/O threads read frames after waits (the requests, their acknowledgements; one still busy
    # when the next frame came reads it without a wait)
    waits = json.loads(out.read_text())["ready_waits"]
    assert len(waits) == 2 and all(1 <= w["n"] <= 40 and w["slow"] <= w["n"] for w in waits.values()), waits
    assert "ready -> read p50" in result.output


@pytest.mark.multiprocess
def test_the_spin_decides_which_thread_sends_a_shaped_write() -> None:
    """``nic_spin_s`` reaches the daemons' soft devices. A write lands 9.04 ms after its post (9 ms of latency,
    41 us on the link): with a 10 ms spin the sending worker's posting thread sends every write itself once it
    lands; with 8 ms each is queued, and its I/O thread, woken 8 ms before the landing, waits the rest awake;
    with 0 each is queued and slept for. Never before the model lets it land.

    Which thread sends is decided at the post, from the model alone. Whether the I/O thread woke in time to
    wait awake depends on the host: a wake-up more than the spin late (a loaded two-core host, where each rail
    worker's loop takes a core, once made a 4 ms spin miss two of four) finds the write due and sends it at
    once. So that case asserts at least one awake wait, with a margin of 8 ms for the wake-up."""
    bench = load_benchmark("fabric_bench")
    nic = {"nic_bandwidth": 100e6, "nic_latency_s": 9e-3}
    for spin in (10e-3, 8e-3, 0.0):
        row = bench.fabric_row("ib", "shaped", 4, 1, 1, buffers="host", chunk=4096, nic=nic, echo=lambda *a: None,
                               latency_sizes=[4096], soft=bench.SoftOptions(nic_spin_s=spin))
        (entry,) = row["latency"]
        sent_at_post, departed, awaited = entry["sent_at_post"], entry["departed"], entry["departures_awaited"]
        if spin == 10e-3:
            assert (sent_at_post, departed, awaited) == (4, 0, 0)
        elif spin:
            assert (sent_at_post, departed) == (0, 4) and 1 <= awaited <= 4, entry
        else:
            assert (sent_at_post, departed, awaited) == (0, 4, 0)
        assert entry["min_us"] >= entry["model_us"] * 0.999


def test_trace_needs_messages_to_time() -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(load_benchmark("fabric_bench").main,
                                ["--buffers", "host", "--trace", "/tmp/unused-trace"])
    assert result.exit_code != 0 and "--trace stamps the messages of --latency or --burst" in result.output


def test_a_burst_is_a_dispatch_in_push_order() -> None:
    """What `MoE.dispatch_gemm`'s communication program pushes a peer: the count row, each group, the handle words,
    the dispatch SIGNAL; sources in the sender's first half, destinations in the peer's second."""
    from cmd_ring.record import Flag, Opcode

    bench = load_benchmark("fabric_bench")
    half = bench.BURST_GROUPS_OFFSET + 3 * 1000
    recs = bench.burst_records(1, 7, 9, 3, 1000, half)
    assert recs["opcode"].tolist() == [Opcode.PUT_SIGNAL] * 4 + [Opcode.PUT, Opcode.SIGNAL]
    assert recs["signal_slot"].tolist() == [0, 1, 2, 3, 0, 4]
    assert recs["signal_value"].tolist() == [1, 1, 1, 1, 0, 1]
    assert recs["length"].tolist() == [bench.BURST_COUNT_BYTES, 1000, 1000, 1000, bench.BURST_HANDLE_BYTES, 0]
    assert recs["src_off"].tolist()[1:4] == [bench.BURST_GROUPS_OFFSET + g * 1000 for g in range(3)]
    assert (recs["dst_off"][:5] == recs["src_off"][:5] + half).all() and (recs["peer"] == 1).all()
    assert (recs["src_region"][:5] == 7).all() and (recs["dst_region"][:5] == 9).all()
    assert (recs["flags"] == 0).all()
    now = bench.burst_records(1, 7, 9, 3, 1000, half, post_now=True)["flags"].tolist()
    assert now == [0] * 5 + [int(Flag.NO_BATCH)]
    nic = {"nic_bandwidth": 1e6, "nic_latency_s": 1e-3}
    assert bench.burst_model_us(nic, 3, 1000) == pytest.approx([1256, 2256, 3256, 4256, 5280])
    assert bench.burst_model_us({}, 3, 1000) == [0.0] * 5


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_a_burst_both_ways_lands_whole_and_never_before_its_link_carries_it(backend: str) -> None:
    """Both ranks push each other a burst at once, round after round, the flags never reset: every flag rises
    each round, no sooner than the sender's link model lets its bytes land; each rank ends with the other's
    bytes. On ib (RC) a later flag never lands before an earlier one."""
    bench = load_benchmark("fabric_bench")
    nic = {"nic_bandwidth": 100e6, "nic_latency_s": 1e-3}
    groups, nbytes = 3, 48 << 10
    row = bench.burst_row(backend, "shaped", groups, nbytes, 3, buffers="host", nic=nic, echo=lambda *a: None)
    assert row["intact"]
    model = bench.burst_model_us(nic, groups, nbytes)
    assert [m["message"] for m in row["burst"]] == ["count", "group 1", "group 2", "group 3", "dispatch"]
    for m, least in zip(row["burst"], model, strict=True):
        assert m["model_us"] == least and m["min_us"] >= least * 0.999, m
    landed = row["landed_us"]
    assert len(landed) == 3 and all(len(r) == 2 and len(r[0]) == groups + 2 for r in landed)
    if backend == "ib":
        assert all(rank == sorted(rank) for rnd in landed for rank in rnd)
    table = bench.burst_table([row]).splitlines()
    assert table[0].startswith("| backend | NIC model | flag | p50 us") and len(table) == 2 + groups + 2


@pytest.mark.parametrize(("args", "says"), [
    (["--burst", "4"], "--burst takes GROUPS,BYTES"), (["--burst", "0,4096"], "GROUPS in [1, 64]"),
    (["--burst", "4,0"], "BYTES in [1,"), (["--burst", "4,4096", "--latency", "4096"], "give one"),
    (["--post-now"], "--post-now marks the last record of a --burst"),
    (["--gap-ms", "5"], "--gap-ms spaces the rounds of a --burst"),
    (["--burst", "4,4096", "--gap-ms", "-1"], "--gap-ms"), (["--burst", "4,4096", "--gap-ms", "nan"], "--gap-ms")])
def test_burst_refuses_what_it_cannot_run_before_any_work(args: list[str], says: str) -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(load_benchmark("fabric_bench").main, ["--buffers", "host", *args])
    assert result.exit_code == 2 and says in result.output


@pytest.mark.parametrize(("value", "says"), [("abc", "--latency takes byte counts"), ("4096,0", "must be in [1,"),
                                             (str((64 << 20) + 1), "must be in [1,")])
def test_latency_refuses_what_is_not_a_size_before_any_work(value: str, says: str) -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(load_benchmark("fabric_bench").main, ["--buffers", "host", "--latency", value])
    assert result.exit_code == 2 and says in result.output


def test_the_gil_switch_interval_and_the_streaming_reach_the_daemons_config(tmp_path: Path) -> None:
    from transportd.config import load_config
    from transportd_cli.localcluster import render_toml

    soft = load_benchmark("fabric_bench").SoftOptions.from_options("device", 0.0, None, gil_switch_us=50,
                                                                  nic_streaming=False)
    overrides = soft.daemon_config({})
    path = tmp_path / "node.toml"
    path.write_text(render_toml(overrides))
    config = load_config(path, env={}).softverbs
    assert (config.gil_switch_interval_s, config.nic_streaming) == (5e-5, False)


@pytest.mark.parametrize("given", [
    {"copy_via": "host", "io_spin_us": 7.7, "nic_spin_us": 15.3, "gil_switch_us": 50.0, "nic_streaming": False},
    {"copy_via": "device", "io_spin_us": 0.0, "nic_spin_us": None, "gil_switch_us": 0.1, "nic_streaming": True}])
def test_the_soft_options_record_what_the_command_line_gave(given: dict[str, Any]) -> None:
    """A results file names the options as given, in their own units, whatever their trip through seconds."""
    bench = load_benchmark("fabric_bench")
    soft = bench.SoftOptions.from_options(**given)
    assert soft.as_options() == given
    config = soft.daemon_config({})["softverbs"]
    assert config["io_spin_s"] == pytest.approx(given["io_spin_us"] / 1e6)
    assert ("nic_spin_s" in config) == (given["nic_spin_us"] is not None)


@pytest.mark.parametrize("option", ["--io-spin-us", "--nic-spin-us", "--gil-switch-us"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "2e6", "x"])
def test_the_wait_options_refuse_what_is_not_a_finite_time_in_range(option: str, value: str) -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(load_benchmark("fabric_bench").main,
                                ["--buffers", "host", "--latency", "4096", option, value])
    assert result.exit_code == 2 and option in result.output


@pytest.mark.parametrize(("args", "gap_s", "streaming"),
                         [([], 2e-3, True), (["--gap-ms", "20", "--no-nic-streaming"], 20e-3, False)])
def test_the_burst_rounds_are_spaced_and_modeled_as_asked_and_the_json_says_so(tmp_path, monkeypatch, args, gap_s,
                                                                               streaming) -> None:
    from click.testing import CliRunner

    bench = load_benchmark("fabric_bench")
    seen: list[tuple[float, bool]] = []

    def row(backend, shape, groups, group_bytes, rounds, **kw):
        seen.append((kw["gap_s"], kw["soft"].nic_streaming))
        return {"backend": backend, "shape": shape, "burst": []}

    monkeypatch.setattr(bench, "burst_row", row)
    out = tmp_path / "burst.json"
    result = CliRunner().invoke(bench.main, ["--buffers", "host", "--rows", "ib:unshaped", "--burst", "2,4096",
                                             "--json", str(out), *args])
    assert result.exit_code == 0, result.output
    assert seen == [(pytest.approx(gap_s), streaming)]
    saved = json.loads(out.read_text())
    assert (saved["gap_ms"], saved["nic_streaming"]) == (pytest.approx(gap_s * 1e3), streaming)
