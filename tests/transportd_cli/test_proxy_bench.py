"""Smoke runs of `transportd bench proxy` / `bench signals` pieces at tiny sizes (no timings asserted)."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
from click.testing import CliRunner

from cmd_ring.record import Opcode
from transportd_cli import bench_proxy
from transportd_cli.cli import main


def test_signal_stream_is_put_signals_with_fences() -> None:
    recs = bench_proxy.signal_records(16, dests=4, slots=2, fence_every=8)
    assert (recs["opcode"] == Opcode.FENCE).sum() == 2 and recs["opcode"][7] == Opcode.FENCE
    assert set(recs["peer"].tolist()) == {1, 2, 3, 4} and set(recs["signal_slot"].tolist()) == {0, 1}


def test_signals_benchmark_shows_the_reduction_and_equal_flags(tmp_path) -> None:
    out = tmp_path / "signals.json"
    result = CliRunner().invoke(main, ["bench", "signals", "--records", "2048", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["flags_match"] is True
    assert s["decoupled_signals_per_dest_batch"] == 1.0 < s["naive_signals_per_dest_batch"]
    assert s["proxy_stalls"] == 0
    assert "signals_per_dest_batch" in result.output


@pytest.mark.parametrize("engine", bench_proxy.ENGINES)
def test_proxy_drain_and_live_parts_run(engine: str) -> None:
    opts = dict(batch_max=8, poll_window_us=0, inflight_cap=256)
    drain = bench_proxy._drain(1024, 1, peers=4, channels=2, opts=opts, engine=engine)
    assert drain["records_per_s"] > 0 and sum(drain["batch_hist"]) == 2 * 1024 // 8
    live = bench_proxy._live(2000, 256, peers=4, max_batch=16, interval_ns=0, opts=opts, engine=engine)
    assert live["records"] == 2000 and np.isfinite(live["p99_us"])


def test_the_bare_c_consumer_takes_the_whole_ring() -> None:
    assert bench_proxy._bare_c_drain(1024, 2, peers=4) > 0


@pytest.mark.parametrize("engine", ["core", "model"])
def test_pingpong_posts_every_record_once(engine: str) -> None:
    """The compiled producer's one-record-at-a-time run: every chunk posted once, latencies finite."""
    pp = bench_proxy._live(300, 64, peers=3, max_batch=1, interval_ns=0, opts=dict(poll_window_us=0),
                           engine=engine, pingpong=True)
    assert pp["records"] == 300 and pp["batch_hist"][0] == 300 and 0 < pp["p50_us"] <= pp["p99_us"]


def test_bench_group_lists_both_commands() -> None:
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert "proxy" in result.output and "signals" in result.output


def test_idle_part_posts_each_record_after_its_silence() -> None:
    """The rail worker's own loop, idle between records: every record posted once, the CPU share measured."""
    idle = bench_proxy._idle(2, 0.2, peers=3, opts=dict(poll_window_us=0))
    assert idle["records"] == 2 and len(idle["first_record_us"]) == 2
    assert 0 < idle["cpu_fraction"] < 1.05 and all(x > 0 for x in idle["first_record_us"])


def test_a_negative_idle_nap_is_refused_before_anything_runs() -> None:
    result = CliRunner().invoke(main, ["bench", "proxy", "--idle-nap-us", "-1"])
    assert result.exit_code == 2 and "--idle-nap-us" in result.output and "x>=0" in result.output


@pytest.mark.parametrize("consumer", bench_proxy.BURST_CONSUMERS)
@pytest.mark.parametrize("burst", [1, 32])
def test_bursts_complete_through_the_worker_loop_and_the_bare_consumer(consumer: str, burst: int) -> None:
    """Every burst's round trip is measured (none timed out); the worker loop took each burst as it came."""
    out = bench_proxy._bursts(burst, 200, peers=4, opts=dict(poll_window_us=0), consumer=consumer)
    assert out["rounds"] == 200 and 0 < out["p50_us"] <= out["p99_us"] and out["records_per_s"] > 0
    if consumer == "worker":
        assert 1 <= out["records_per_busy_pass"] <= burst


def test_bursts_refuse_an_unknown_consumer() -> None:
    with pytest.raises(ValueError, match="consumer"):
        bench_proxy._bursts(1, 10, peers=2, opts={}, consumer="nobody")


def test_burst_producer_refuses_what_it_cannot_run() -> None:
    from cmd_ring.ring import RingFile
    from transportd import _core

    with RingFile.create(bench_proxy._ring_name("refuse"), 64) as ring:
        out = np.zeros(4, dtype=np.int64)
        for bursts, burst, peers, into in ((4, 0, 2, out), (4, 65, 2, out), (4, 1, 0, out), (5, 1, 2, out)):
            with pytest.raises(ValueError, match="burst_produce"):
                _core.burst_produce(ring._bytes, bursts, burst, peers, 64, into, 1.0)
        # nobody consumes: the first burst waits out its timeout and none is counted as done; its records are
        # committed, so the ring's producer position says so
        assert _core.burst_produce(ring._bytes, 4, 8, 2, 64, out, 0.01) == 0
        assert ring.producer_pos == 8
    with RingFile.create(bench_proxy._ring_name("credit"), 64) as ring:
        # completions come (published here by hand) but no slot is released: the second burst of 40 has no
        # credit, times out, and the first one's records are still in the producer position
        ring.publish_completion(1 << 40)
        assert _core.burst_produce(ring._bytes, 4, 40, 2, 64, out, 0.01) == 1
        assert ring.producer_pos == 40 and out[0] > 0


@pytest.mark.parametrize("max_take", [4096, 16])
def test_the_worker_loop_drain_posts_every_record_once(max_take: int) -> None:
    out = bench_proxy._drain_loop(2048, 2, peers=4, opts=dict(poll_window_us=0, max_take=max_take))
    assert out["max_take"] == max_take and out["records_per_s"] > 0


def test_a_max_take_outside_its_range_is_refused_before_anything_runs() -> None:
    result = CliRunner().invoke(main, ["bench", "proxy", "--max-take", "0"])
    assert result.exit_code == 2 and "--max-take" in result.output


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a loop CPU of its own needs two CPUs to choose from")
def test_the_worker_loop_runs_alone_on_its_cpu_and_gives_the_rest_back() -> None:
    """gpu_bench's pinned sweep: the loop's thread on its CPU alone, this thread off it meanwhile, and this
    thread's CPUs as they were once the loop has stopped; records still complete through the pinned loop."""
    from cmd_ring.ring import RingFile
    from transportd import _core
    from transportd.dataplane.proxy import Proxy

    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    with RingFile.create(bench_proxy._ring_name("pinned"), 64) as ring:
        proxy = Proxy(None, poll_window_us=0)
        bench_proxy._setup(proxy, 2)
        proxy.add_channel(0, ring, bench_proxy.JOB, 0, 3)
        with bench_proxy._worker_loop(proxy, cpu=cpu) as loop:
            assert os.sched_getaffinity(loop.native_id) == {cpu}
            assert os.sched_getaffinity(0) == mine - {cpu}
            rtt = np.zeros(50, dtype=np.int64)
            assert _core.burst_produce(ring._bytes, 50, 4, 2, 64, rtt, 30.0) == 50
    assert os.sched_getaffinity(0) == mine and (rtt > 0).all()


def _parity_words(ring, pos: int, parities: tuple[int, ...]) -> None:
    """Write slot ``pos``'s six words with byte 0 of word k = parities[k] (the rest: the position)."""
    capacity = ring.capacity
    words = np.frombuffer(ring._bytes, dtype="<u8")
    first = 4096 // 8 + (pos % capacity) * 6
    words[first:first + 6] = [(pos << 8) | p for p in parities]


def test_the_bare_parity_consumer_takes_a_slot_only_when_all_six_words_carry_its_laps_parity() -> None:
    """gpu_bench's per-word-parity sweep: a slot is committed when every word's byte 0 is its lap's parity (1
    on even laps, 2 on odd); a slot with one word of the old lap, or a zeroed one, stops the drain there."""
    from cmd_ring.ring import RingFile
    from transportd import _core

    with RingFile.create(bench_proxy._ring_name("parity"), 4) as ring:
        for pos in range(3):
            _parity_words(ring, pos, (1,) * 6)
        _parity_words(ring, 3, (1, 1, 1, 2, 1, 1))  # word 3 not landed yet (still another lap's parity)
        assert _core.bare_drain(ring._bytes, 8, 0.01, True) == 3
        assert ring.consumer_pos == 3 and ring.completion_pos == 3
        _parity_words(ring, 3, (1,) * 6)
        for pos in (4, 5):  # the second lap: parity 2; slot 6 still holds lap one's parity 1
            _parity_words(ring, pos, (2,) * 6)
        assert _core.bare_drain(ring._bytes, 8, 0.01, True) == 6


def test_the_bare_consumer_with_idle_pauses_still_takes_what_is_committed() -> None:
    from cmd_ring.ring import RingFile
    from transportd import _core

    with RingFile.create(bench_proxy._ring_name("pauses"), 64) as ring:
        rtt = np.zeros(20, dtype=np.int64)
        drain = threading.Thread(target=_core.bare_drain, args=(ring._bytes, 80, 30.0, False, 64))
        drain.start()
        assert _core.burst_produce(ring._bytes, 20, 4, 2, 64, rtt, 30.0) == 20
        drain.join()
        assert ring.consumer_pos == 80 and (rtt > 0).all()
