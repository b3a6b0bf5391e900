"""`transportctl` against real daemons: every command, JSON checked against the known traffic, human output
readable, and the failure modes (no daemon, stale socket, no permission) as one line and exit status 2."""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.cluster import close_ranks, join_ranks, started_clusters
from tests.support.ctl import assert_one_line, ctl, ctl_process
from tests.support.ops_cluster import BACK, CHUNK, INFLIGHT_CAP, JOB, PUTS, SET_VALUE, OpsCluster
from tests.support.waiting import process_state, wait_until
from transportd.control.client import ControlConnection
from transportd.control.protocol import Stats
from transportd.ops.metrics import render_metrics
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def _json(node: str, ops: OpsCluster, *args: str) -> dict:
    result = ctl(*args, "--json", "--socket", ops.socket(node))
    assert result.exit_code == 0, result.stderr
    return result.json()


def _human(node: str, ops: OpsCluster, *args: str) -> str:
    result = ctl(*args, "--socket", ops.socket(node))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() and not result.stdout.lstrip().startswith("{")
    return result.stdout


def test_status(ops_cluster: OpsCluster) -> None:
    s = _json("nodea", ops_cluster, "status")
    assert s["node"] == "nodea" and s["ready"] is True and s["backend"] == "ib"
    job = s["jobs"][JOB]
    assert s["clients"] == 1 and {k: job[k] for k in ("world", "local", "remote")} == {
        "world": 2, "local": [0], "remote": [1]}
    assert job["traffic"]["ranks"]["0"]["commands"] > 0 and job["traffic"]["bytes"] > 0  # the job's own traffic
    assert s["peers"]["nodeb"]["up"] is True
    (rail,) = s["rails"]
    assert rail["pid"] > 0 and rail["pid"] != s["pid"] and rail["channels"] == 1
    assert rail["flag_publication"] == "nic"  # ib: the sender's NIC writes the flags
    text = _human("nodea", ops_cluster, "status")
    assert "node      nodea" in text and "ready" in text and "1 up, 0 down" in text
    assert f"worker pid {rail['pid']}" in text and f"{JOB} (1/2 local)" in text


def test_peers(ops_cluster: OpsCluster) -> None:
    p = _json("nodea", ops_cluster, "peers")
    peer = p["peers"]["nodeb"]
    assert peer["up"] is True and peer["rtt_us"] > 0
    assert peer["bytes"] >= PUTS * CHUNK and peer["connections"] == 1
    (conn,) = [c for c in p["connections"] if c["job"] == JOB]
    assert conn["node"] == "nodeb" and conn["state"] == "up" and conn["bytes"] == peer["bytes"]
    back = _json("nodeb", ops_cluster, "peers")["peers"]["nodea"]
    assert back["bytes"] >= BACK * CHUNK
    text = _human("nodea", ops_cluster, "peers")
    header, row = text.strip().splitlines()
    assert header.split() == ["peer", "state", "rtt_ms", "sent", "connections"]
    assert row.split()[:2] == ["nodeb", "up"] and row.split()[-1] == "1"


def test_queues(ops_cluster: OpsCluster) -> None:
    q = _json("nodea", ops_cluster, "queues")
    (ring,) = [r for r in q["rings"] if r["job"] == JOB]
    assert ring["rank"] == 0 and ring["depth"] == 0 and ring["credits"] == ring["capacity"] == 256
    assert ring["oldest_age_us"] == 0 and ring["outstanding"] == 0 and ring["gone"] is False
    assert ring["taken"] >= PUTS + 3  # puts, fence, signal, quiet
    (conn,) = [c for c in q["connections"] if c["node"] == "nodeb"]
    assert conn["inflight"] == 0 and conn["pending"] == 0 and conn["bytes"] >= PUTS * CHUNK
    assert len(conn["batch_hist"]) == q["batch_max"] == 8
    assert sum(conn["batch_hist"]) == conn["batches_full"] + conn["batches_partial"] > 0
    assert conn["batches_full"] == conn["batch_hist"][-1]
    text = _human("nodea", ops_cluster, "queues")
    assert "depth" in text and "credits" in text and "oldest_ms" in text
    assert "inflight" in text and "full" in text and "partial" in text and "batch sizes" in text
    assert f"{JOB}/0" in text


def test_queues_show_backpressure_from_a_stalled_peer(ops_cluster: OpsCluster) -> None:
    """Stop nodeb's rail worker (its NIC stops acknowledging): a's connection fills its inflight cap, the
    rest of a's records wait in the ring (depth, credits, a growing oldest age), nothing is dropped."""
    a, b = ops_cluster.a, ops_cluster.b
    worker_pid = _json("nodeb", ops_cluster, "status")["rails"][0]["pid"]
    before = _json("nodea", ops_cluster, "queues")
    (ring0,) = [r for r in before["rings"] if r["job"] == JOB]
    n, base, slot = 24, 256 << 10, 3

    def snapshot() -> tuple[dict, dict]:
        q = _json("nodea", ops_cluster, "queues")
        (ring,) = [r for r in q["rings"] if r["job"] == JOB]
        (conn,) = [c for c in q["connections"] if c["node"] == "nodeb"]
        return ring, conn

    os.kill(worker_pid, signal.SIGSTOP)
    try:
        # stopped before the first push: no record may be answered, or the in-flight counts below would move
        wait_until(lambda: process_state(worker_pid) == "T", "node b's rail worker to stop")
        for i in range(n):
            a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=base + i * CHUNK, src_region=a.src.id,
                                 src_off=base + i * CHUNK, nbytes=CHUNK, slot=slot, value=1)
        ring, conn = wait_until(lambda: (lambda r, c: (r, c) if r["depth"] and c["inflight"] else None)(*snapshot()),
                                timeout=3.0, what="records waiting behind a full connection")
        # the stall has lasted another 100 ms: the oldest record aged, nothing moved meanwhile
        later, conn_later = wait_until(lambda: (lambda r, c: (r, c) if r["oldest_age_us"] >= ring["oldest_age_us"]
                                                + 100_000 else None)(*snapshot()), "the stall to last 100 ms more")
        text = _human("nodea", ops_cluster, "queues")
        stalls = _json("nodea", ops_cluster, "stats")["stalls"]
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    assert 0 < conn["inflight"] <= INFLIGHT_CAP and conn_later["inflight"] == conn["inflight"]
    assert ring["taken"] - ring0["taken"] + ring["depth"] == n  # every record is either taken or waiting
    assert ring["credits"] == ring["capacity"] - ring["depth"]
    assert later["depth"] == ring["depth"] and later["oldest_age_us"] > ring["oldest_age_us"] > 0
    assert stalls > 0
    row = next(line for line in text.splitlines() if f"{JOB}/0" in line).split()
    assert int(row[3]) == later["depth"] and int(row[4]) == later["credits"]
    # resumed: everything is delivered, in full, and the queues empty
    assert b.session.wait(slot=slot, at_least=n, timeout=30) == n
    assert np.array_equal(b.recv[base:base + n * CHUNK], a.send[base:base + n * CHUNK])
    ring, conn = wait_until(lambda: (lambda r, c: (r, c) if not r["depth"] and not c["inflight"] else None)(
        *snapshot()), timeout=10.0, what="the queues to drain")
    assert ring["oldest_age_us"] == 0 and ring["credits"] == ring["capacity"]


def test_stats(ops_cluster: OpsCluster) -> None:
    a = _json("nodea", ops_cluster, "stats")
    assert a["commands"] >= PUTS + 3 and a["bytes"] >= PUTS * CHUNK
    assert a["signals"] >= PUTS + 1 and a["fences"] >= 1 and a["wrs"] >= 2 * PUTS
    assert a["errors"] == {} and a["rejected"] == 0
    b = _json("nodeb", ops_cluster, "stats")
    assert b["errors"] == {"BAD_REGION": 1} and b["rejected"] == 1
    assert b["commands"] >= BACK and b["bytes"] >= BACK * CHUNK
    text = _human("nodeb", ops_cluster, "stats")
    lines = dict(line.split(None, 1) for line in text.splitlines() if not line.startswith("errors by code"))
    assert int(lines["commands"]) == b["commands"] and int(lines["fences"]) == b["fences"]
    assert "errors by code    BAD_REGION=1" in text


def test_flags(ops_cluster: OpsCluster) -> None:
    f = _json("nodeb", ops_cluster, "flags", JOB, "1")
    assert f["job"] == JOB and f["rank"] == 1 and len(f["values"]) == 64
    assert f["values"][0] >= PUTS and f["values"][1] == SET_VALUE and f["status"] == 0
    text = _human("nodeb", ops_cluster, "flags", JOB, "1")
    assert f"1     {SET_VALUE}" in text and "64 slots" in text and "status 0 OK" in text
    refused = ctl("flags", JOB, "0", "--socket", ops_cluster.socket("nodeb"))  # rank 0 lives on nodea
    assert refused.exit_code == 1
    assert "not joined on node nodeb" in assert_one_line(refused.stderr)


@pytest.mark.parametrize(("args", "says"), [
    (["flags", "", "0"], "field 'job'"),
    (["flags", "no such job", "0"], "field 'job'"),
    (["flags", JOB, "99999999999"], "field 'rank'"),
    (["trace", "start", "bad name", "0", "--out", "{tmp}/t.trace"], "field 'job'"),
    (["trace", "stop", "bad name", "0"], "field 'job'"),
])
def test_a_job_or_rank_the_protocol_refuses_is_one_line_and_exit_1(ops_cluster: OpsCluster, tmp_path,
                                                                     args: list[str], says: str) -> None:
    """Refused before it is sent (not a traceback, and not exit 2, which says the daemon is unreachable)."""
    result = ctl(*[a.format(tmp=tmp_path) for a in args], "--socket", ops_cluster.socket("nodea"))
    assert result.exit_code == 1 and result.stdout == "", result
    assert says in assert_one_line(result.stderr)
    assert not (tmp_path / "t.trace").exists()  # a refused trace start leaves no empty file behind


def test_top(ops_cluster: OpsCluster) -> None:
    result = ctl("top", "--iterations", "2", "--interval", "0.1", "--json", "--socket", ops_cluster.socket("nodea"))
    assert result.exit_code == 0, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(frames) == 2 and frames[0]["node"] == "nodea"
    assert frames[1]["totals"]["commands"] >= PUTS and set(frames[1]["rates"]) >= {"commands", "bytes", "stalls"}
    assert frames[1]["queues"]["rings"][0]["job"] == JOB
    text = _human("nodea", ops_cluster, "top", "--iterations", "1")
    assert "per_s" in text and "node      nodea" in text and "depth" in text and "rtt_ms" in text


def test_the_installed_script_prints_json(ops_cluster: OpsCluster) -> None:
    result = ctl_process("stats", "--json", "--socket", ops_cluster.socket("nodea"))
    assert result.exit_code == 0, result.stderr
    assert result.json()["commands"] >= PUTS


# --- unreachable daemons: one line on stderr, exit status 2 ---------------------------------------------------

def test_missing_socket(tmp_path) -> None:
    result = ctl("status", "--socket", f"ipc://{tmp_path}/control.sock")
    assert result.exit_code == 2 and result.stdout == ""
    line = assert_one_line(result.stderr)
    assert "transportd is not running" in line and "does not exist" in line and "systemctl start" in line
    # the real script too (exit status through the console entry point)
    real = ctl_process("peers", "--socket", f"ipc://{tmp_path}/control.sock")
    assert real.exit_code == 2 and assert_one_line(real.stderr) == line


def test_stale_socket_of_a_dead_daemon(tmp_path) -> None:
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # what a killed daemon leaves: the file, nobody listening
    result = ctl("queues", "--socket", f"ipc://{path}")
    assert result.exit_code == 2
    line = assert_one_line(result.stderr)
    assert "nothing listens" in line and "journalctl -u transportd" in line


def test_socket_without_permission(ops_cluster: OpsCluster) -> None:
    """The daemon's socket, mode 000: the error names the mode and the group to join."""
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        # root passes permission checks through CAP_DAC_OVERRIDE: drop it (and DAC_READ_SEARCH) for the child
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and setpriv (util-linux) is missing")
        prefix = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search")
    path = ops_cluster.socket("nodeb").removeprefix("ipc://")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    os.chmod(path, 0)
    try:
        result = ctl_process("status", "--socket", ops_cluster.socket("nodeb"), prefix=prefix)
    finally:
        os.chmod(path, mode)
    assert result.exit_code == 2, result
    line = assert_one_line(result.stderr)
    assert "no permission to use control socket" in line and "mode 0000" in line and "control.group" in line
    assert f"group {ops_cluster.group}" in line


def test_control_group_owns_the_socket_and_rings_and_flags_come_by_descriptor(ops_cluster: OpsCluster) -> None:
    """A client in control.group uses the sockets (the group's, 0660) and maps its ring and flags from
    the descriptors the daemon handed it: memfds, with no name in /dev/shm another process could open."""
    gid = grp.getgrnam(ops_cluster.group).gr_gid
    socket_path = Path(ops_cluster.socket("nodeb").removeprefix("ipc://"))
    for path in (socket_path, Path(f"{socket_path}.fds")):
        st = os.stat(path)
        assert st.st_gid == gid and stat.S_IMODE(st.st_mode) == 0o660, path
    ring = ops_cluster.b.channel.ring
    assert ring.path is None and ops_cluster.b.session.flag_array._file.path is None
    maps = Path("/proc/self/maps").read_text()
    assert f"/memfd:tpd-ring-{JOB}-1-" in maps and f"/memfd:tpd-flags-{JOB}-1 " in maps
    # nothing of the job's is named anywhere in /dev/shm (another test's or run's files do not matter)
    assert [name for name in os.listdir("/dev/shm") if name.startswith("tpd-") and f"-{JOB}-" in name] == []
    # and transportctl still reads the flags through the daemon, which maps the same memory
    result = ctl("flags", JOB, "1", "--json", "--socket", ops_cluster.socket("nodeb"))
    assert result.exit_code == 0 and result.json()["rank"] == 1, result


def test_a_directory_or_the_peer_port_is_not_called_not_running(ops_cluster: OpsCluster, tmp_path) -> None:
    """`--socket` naming a directory, or the peers' port: one line saying what is wrong, not "not running"."""
    directory = ctl("status", "--socket", f"ipc://{tmp_path}")
    assert directory.exit_code == 2 and f"{tmp_path} is a directory" in assert_one_line(directory.stderr)
    port = ops_cluster.cluster.nodes["nodea"].peer_port
    peer = ctl("status", "--socket", f"tcp://127.0.0.1:{port}")
    line = assert_one_line(peer.stderr)
    assert peer.exit_code == 2 and "not running" not in line and "peer port" in line


@pytest.mark.parametrize("endpoint", ["foo", "/run/transportd/control.sock", "tcp://nohost"])
def test_a_socket_that_is_not_an_endpoint(endpoint: str) -> None:
    """A mistyped --socket is one line naming what an endpoint looks like, exit 2, through the real script."""
    result = ctl_process("status", "--socket", endpoint)
    assert result.exit_code == 2 and result.stdout == ""
    line = assert_one_line(result.stderr)
    assert "not a control endpoint: expected" in line and "Traceback" not in result.stderr


def test_top_fits_an_80x24_terminal(ops_cluster: OpsCluster) -> None:
    """No line wraps and the header stays on screen: at most 23 lines of at most 80 characters."""
    from click.testing import CliRunner

    from transportd_cli.ctl import main as ctl_main

    result = CliRunner().invoke(ctl_main, ["top", "--iterations", "1", "--socket", ops_cluster.socket("nodea")],
                                env={"COLUMNS": "80", "LINES": "24", "TRANSPORTD_SOCKET": None},
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.replace("\x1b[2J\x1b[1;1H", "").strip("\n").splitlines()
    assert lines[0].startswith("transportctl top") and len(lines) <= 23, lines
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert any(line.startswith("node      nodea") for line in lines) and any("per_s" in line for line in lines)


# --- counters and sessions over jobs that end (a cluster of their own) -----------------------------------------

@pytest.fixture(scope="module")
def brief_cluster() -> Iterator[LocalCluster]:
    """Two daemons that reclaim a silent session after 1 s (the default is 30 s)."""
    with started_clusters() as make:
        yield make(nodes=2, overrides={"control": {"client_timeout_s": 1.0}})


def _sent_to_nodeb(cluster: LocalCluster) -> int:
    result = ctl("peers", "--json", "--socket", cluster.socket("nodea"))
    assert result.exit_code == 0, result.stderr
    return result.json()["peers"]["nodeb"]["bytes"]


def test_a_peers_sent_bytes_outlive_the_job(brief_cluster: LocalCluster) -> None:
    """`transportctl peers` (and the metric) showed 0 B once the job that sent them had ended."""
    before = _sent_to_nodeb(brief_cluster)
    ranks = join_ranks(brief_cluster, job="finished", nbytes=PUTS * CHUNK)
    a, b = ranks
    try:
        for i in range(PUTS):
            a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=i * CHUNK, src_region=a.src.id,
                                 src_off=i * CHUNK, nbytes=CHUNK, slot=0, value=1)
        assert b.session.wait(slot=0, at_least=PUTS, timeout=30) == PUTS
        a.channel.quiet(timeout=30)
        during = _sent_to_nodeb(brief_cluster)
    finally:
        close_ranks(ranks)
    assert during >= before + PUTS * CHUNK

    def stats() -> dict:
        with ControlConnection(brief_cluster.socket("nodea"), timeout_ms=5000) as conn:
            return conn.request(Stats())

    wait_until(lambda: not [c for c in stats()["connections"] if c["job"] == "finished"],
               what="the finished job's connections to close")
    assert _sent_to_nodeb(brief_cluster) == during
    assert f'transportd_peer_sent_bytes_total{{node="nodea",peer="nodeb"}} {float(during)}' in render_metrics(stats())


def test_a_transportctl_session_ends_with_its_process(brief_cluster: LocalCluster) -> None:
    """Each call (and each `top` refresh) ended its session only once it had been silent for
    control.client_timeout_s; it ends when the process (its descriptor connection) goes."""
    socket = brief_cluster.socket("nodea")
    before = brief_cluster.log("nodea").count("silent for more than")
    assert ctl_process("status", "--socket", socket).exit_code == 0
    assert ctl("top", "--iterations", "3", "--interval", "0.1", "--json", "--socket", socket).exit_code == 0
    time.sleep(2.5)  # past the 1 s timeout, twice the daemon's look at its clients
    assert brief_cluster.log("nodea").count("silent for more than") == before
