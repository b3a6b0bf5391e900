"""The metrics endpoint: served by a real daemon after real traffic, parsed by a strict OpenMetrics parser,
names and labels within the conventions, counters that match the traffic."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.openmetrics import parser

from tests.support.cluster import close_ranks, join_ranks
from tests.support.ctl import ctl
from tests.support.ops_cluster import BACK, CHUNK, JOB, PUTS, OpsCluster
from tests.support.waiting import wait_until
from transportd.config import default_config, load_config
from transportd.errors import ErrorCode
from transportd.ops.metrics import CONTENT_TYPE, job_traffic, render_metrics
from transportd_cli.localcluster import LocalCluster, free_port

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

ALLOWED_LABELS = {"node", "job", "rank", "peer"}
NAME = re.compile(r"transportd_[a-z][a-z0-9_]*")


def _scrape(listen: str, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://{listen}{path}", timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def _parse(text: str) -> dict[str, object]:
    """Strict parse (raises on any violation of the format); checks the naming and label rules."""
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for family in families.values():
        assert NAME.fullmatch(family.name), family.name
        assert family.type in ("counter", "gauge"), family.type
        assert not family.name.endswith("_total"), f"{family.name}: a counter's family has no _total"
        if family.unit:
            assert family.name.endswith("_" + family.unit)
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
            assert sample.labels["node"], sample
            if family.type == "counter":
                assert sample.name == family.name + "_total" and sample.value >= 0
    return families


def _value(families: dict, name: str, **labels: str) -> float:
    for sample in families[name].samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError((name, labels))


def test_metrics_of_a_real_daemon_after_traffic(ops_cluster: OpsCluster) -> None:
    listen = ops_cluster.metrics["nodea"]

    def scraped() -> dict | None:  # the daemon refreshes its snapshot every second
        content_type, text = _scrape(listen)
        assert content_type == CONTENT_TYPE
        assert text.endswith("# EOF\n")
        families = _parse(text)
        return families if _value(families, "transportd_commands") >= PUTS else None

    families = wait_until(scraped, timeout=10.0, interval=0.3, what="the metrics snapshot to show the traffic")
    assert _value(families, "transportd_up", node="nodea") == 1
    assert _value(families, "transportd_ready") == 1
    assert _value(families, "transportd_payload_bytes") >= PUTS * CHUNK
    assert _value(families, "transportd_signals") >= PUTS and _value(families, "transportd_fences") >= 1
    assert _value(families, "transportd_batches_full") + _value(families, "transportd_batches_partial") > 0
    assert _value(families, "transportd_peer_up", peer="nodeb") == 1
    assert _value(families, "transportd_peer_rtt_seconds", peer="nodeb") > 0
    assert _value(families, "transportd_peer_sent_bytes", peer="nodeb") >= PUTS * CHUNK
    assert _value(families, "transportd_ring_depth", job=JOB, rank="0") == 0
    assert _value(families, "transportd_job_local_ranks", job=JOB) == 1
    assert families["transportd_uptime_seconds"].unit == "seconds"
    for code in ErrorCode:  # one family per code, present before any error happened
        if code is not ErrorCode.OK:
            assert _value(families, f"transportd_command_errors_{code.name.lower()}") == 0
    for why in ("left", "exited", "silent", "shutdown"):  # one family per way a session ends, from the start
        name = f"transportd_sessions_ended_{why}"
        assert name in families and _value(families, name) >= 0
    assert _value(families, "transportd_queue_pairs") >= 2 and _value(families, "transportd_responder_queue_pairs") >= 1

    # nodeb saw the bad record: counted under its code
    b = wait_until(lambda: (lambda f: f if _value(f, "transportd_command_errors") else None)(
        _parse(_scrape(ops_cluster.metrics["nodeb"])[1])), timeout=10.0, interval=0.3, what="nodeb's error count")
    assert _value(b, "transportd_command_errors_bad_region") == 1
    assert _value(b, "transportd_peer_sent_bytes", peer="nodea") >= BACK * CHUNK

    # per job and rank: nodea's rank 0 sent the puts, nodeb's rank 1 the bad record
    assert _value(families, "transportd_job_commands", job=JOB, rank="0") >= PUTS + 2  # + fence, signal
    assert _value(families, "transportd_job_payload_bytes", job=JOB) >= PUTS * CHUNK
    assert _value(families, "transportd_job_rank_payload_bytes", job=JOB, rank="0") >= PUTS * CHUNK
    assert _value(families, "transportd_job_command_errors", job=JOB, rank="0") == 0
    assert _value(b, "transportd_job_command_errors", job=JOB, rank="1") == 1
    assert _value(b, "transportd_job_first_error_code", job=JOB, rank="1") == ErrorCode.BAD_REGION

    with pytest.raises(urllib.error.HTTPError) as err:
        _scrape(listen, "/")
    assert err.value.code == 404


def test_the_command_the_metrics_page_names_for_per_job_traffic_gives_it(ops_cluster: OpsCluster) -> None:
    """docs/metrics.md named `transportctl stats --json` (totals only); the per-job data is `status --json`'s."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    named = re.findall(r"`transportctl (\w+) --json` carries|the same data `transportctl (\w+) --json`", text)
    commands = {c for pair in named for c in pair if c}
    assert commands, "docs/metrics.md names no transportctl command"
    for command in commands:
        result = ctl(command, "--json", "--socket", ops_cluster.socket("nodea"))
        assert result.exit_code == 0, result.stderr
        assert "traffic" in result.json().get("jobs", {}).get(JOB, {}), f"transportctl {command} --json has no jobs"


def test_render_is_exact_and_strict_for_any_snapshot() -> None:
    big = 12_345_678_901_234  # counters print exactly, not as a rounded float
    stats = {
        "node": "n1", "ready": True, "uptime_s": 12.5, "clients": 2,
        "peers": {"n2": {"up": True, "rtt_us": 250.0}, "n3": {"up": False, "rtt_us": None}},
        "connections": [{"node": "n2", "bytes": big, "inflight": 4}, {"node": "n2", "bytes": 1, "inflight": 0}],
        "jobs": {'we"ird\\job': {"local": [0, 1]}},
        "rails": [{"commands": big, "bytes": 7, "errors": {"BAD_PEER": 2},
                   "queues": {"rings": [{"job": 'we"ird\\job', "rank": 0, "depth": 3, "oldest_age_us": 2500.0}]},
                   "flag_loopback": {"writes": 40, "batches": 9, "wait_ns": 1_500_000}, "flag_copies": 0},
                  {"flag_loopback": None, "flag_copies": 12}, {"error": "rail 1 worker died"}],
    }
    text = render_metrics(stats)
    families = _parse(text)
    assert _value(families, "transportd_commands") == big  # exact: below 2**53, a float64 holds it
    assert _value(families, "transportd_peer_sent_bytes", peer="n2") == big + 1
    assert _value(families, "transportd_peer_up", peer="n3") == 0
    assert _value(families, "transportd_command_errors_bad_peer") == 2
    assert _value(families, "transportd_ring_oldest_age_seconds", job='we"ird\\job', rank="0") == 0.0025
    assert _value(families, "transportd_rails") == 2
    assert _value(families, "transportd_flag_loopback_writes") == 40
    assert _value(families, "transportd_flag_loopback_seconds") == 0.0015
    assert _value(families, "transportd_flag_copies") == 12
    _parse(render_metrics({"node": "n1"}))  # the daemon's snapshot before its first refresh is still valid


def test_job_series_go_when_the_job_ends() -> None:
    """Bounded cardinality: a job's per-job and per-rank series exist while it runs here, not after."""
    listen = f"127.0.0.1:{free_port()}"
    with LocalCluster(2, per_node={"nodea": {"metrics": {"listen": listen}}}) as cluster:
        ranks = join_ranks(cluster, job="short-lived", nbytes=1 << 16)
        a, b = ranks
        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0,
                             nbytes=CHUNK, slot=0, value=1)
        b.session.wait(slot=0, at_least=1, timeout=30)

        def job_series() -> set[str]:
            families = _parse(_scrape(listen)[1])
            return {f.name for f in families.values() for s in f.samples if s.labels.get("job") == "short-lived"}

        wait_until(lambda: {"transportd_job_commands", "transportd_job_payload_bytes"} <= job_series(),
                   timeout=10.0, interval=0.3, what="the job's series")
        close_ranks(ranks)
        wait_until(lambda: not job_series(), timeout=10.0, interval=0.3, what="the job's series to go")


def test_job_traffic_from_a_snapshot() -> None:
    def ring(channel: int, rank: int, taken: int, error: int, count: int | None) -> dict:
        r = {"channel": channel, "job": "j", "rank": rank, "taken": taken, "depth": 0, "oldest_age_us": 0.0,
             "error": error}
        return r if count is None else {**r, "error_count": count}

    stats = {"node": "n1", "jobs": {"j": {"local": [0, 1, 2]}},
             "connections": [{"job": "j", "node": "n2", "rail": 0, "bytes": 100},
                             {"job": "j", "node": "n3", "rail": 0, "bytes": 20},
                             {"job": "j", "node": "n2", "rail": 1, "bytes": 7}],
             "rails": [{"rail": 0, "queues": {"rings": [ring(1, 0, 5, 0, 0), ring(2, 0, 3, 3, 2)]}},
                       {"rail": 1, "queues": {"rings": [ring(3, 1, 4, 0, None), ring(4, 2, 1, 5, 1)]}}]}
    traffic = job_traffic(stats)["j"]
    assert traffic["bytes"] == 127
    assert traffic["ranks"][0] == {"commands": 8, "errors": 2, "first_error": 3, "bytes": 120}  # alone on rail 0
    assert traffic["ranks"][1]["bytes"] is None and traffic["ranks"][2]["bytes"] is None  # rail 1 is shared
    families = _parse(render_metrics(stats))
    assert _value(families, "transportd_job_command_errors", job="j", rank="2") == 1
    assert _value(families, "transportd_job_rank_payload_bytes", job="j", rank="0") == 120
    with pytest.raises(KeyError):
        _value(families, "transportd_job_rank_payload_bytes", job="j", rank="1")


def test_metrics_are_off_by_default(tmp_path) -> None:
    assert default_config(env={}).metrics.listen == ""
    path = tmp_path / "m.toml"
    path.write_text('[metrics]\nlisten = "127.0.0.1:9464"\n')
    assert load_config(path, env={}).metrics.listen == "127.0.0.1:9464"
