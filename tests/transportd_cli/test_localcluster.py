"""`transportd localcluster N`: daemons that stay up until Ctrl-C, their sockets and environment printed, and
nothing left behind (daemons, work directory) when it is interrupted, also during start-up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import gpuclient
from tests.support.ctl import ctl, installed_script
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


@contextmanager
def _running(*args: str) -> Iterator[subprocess.Popen[str]]:
    """The command, started; killed on the way out if a test left it running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSPORTD_")}
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _workdir(proc: subprocess.Popen[str]) -> Path:
    assert proc.stdout is not None
    first = proc.stdout.readline()
    match = re.fullmatch(r"starting 2 daemon\(s\) \(ib over softverbs\) in (\S+)\n", first)
    assert match, first + proc.stderr.read() if proc.stderr else first
    return Path(match.group(1))


def test_module_runs_daemons_until_ctrl_c_and_prints_what_to_use() -> None:
    with _running(sys.executable, "-m", "transportd_cli.localcluster", "2") as proc:
        workdir = _workdir(proc)
        assert proc.stdout is not None
        lines = []
        while not (line := proc.stdout.readline()).startswith("Ctrl-C"):
            assert line, "".join(lines) + (proc.stderr.read() if proc.stderr else "")
            lines.append(line)
        exports = [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in lines
                   if line.strip().startswith("export ")]
        assert [e["TRANSPORTD_RANK"] for e in exports] == ["0", "1"]
        for env in exports:
            assert ctl("status", "--socket", env["TRANSPORTD_SOCKET"]).exit_code == 0
        # the README's Python example, ranks from the printed variables
        clients = [gpuclient.connect(env["TRANSPORTD_SOCKET"]) for env in exports]
        try:
            sessions = [c.join(env=env) for c, env in zip(clients, exports, strict=True)]
            for s in sessions:
                s.register(gpuclient.host_array(4096))
                s.flags(4)
            gpuclient.exchange_all(sessions)
            assert [(s.job, s.rank, s.world) for s in sessions] == [("local", 0, 2), ("local", 1, 2)]
        finally:
            for c in clients:
                c.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopping" in out and "Traceback" not in err
    assert not workdir.exists()


def test_ctrl_c_during_start_up_leaves_nothing_behind() -> None:
    script = installed_script("transportd")
    with _running(*([script] if script else [sys.executable, "-m", "transportd_cli"]), "localcluster", "2") as proc:
        workdir = _workdir(proc)
        proc.send_signal(signal.SIGINT)  # the daemons are starting now
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert not workdir.exists()


def test_ctrl_c_while_a_daemon_is_forked_is_acted_on_once_its_handle_is_kept(monkeypatch: pytest.MonkeyPatch,
                                                                             capfd: pytest.CaptureFixture) -> None:
    """A Ctrl-C that lands while a daemon is being started (here: just before the fork) is held until the
    daemon's handle is kept, then raised: every daemon started is stopped, nothing is printed about the
    logging module's fork hook, and the work directory goes."""
    import transportd_cli.localcluster as lc

    real_popen = subprocess.Popen
    forked: list[subprocess.Popen] = []

    def popen_after_ctrl_c(*args: object, **kwargs: object) -> subprocess.Popen:
        os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at the next bytecode: here, unless held
        forked.append(real_popen(*args, **kwargs))
        return forked[-1]

    monkeypatch.setattr(lc.subprocess, "Popen", popen_after_ctrl_c)
    cluster = LocalCluster(2)
    with pytest.raises(KeyboardInterrupt):
        cluster.start()
    assert len(forked) == 1 and cluster.nodes[cluster.names[0]].process is forked[0]
    assert forked[0].poll() is not None and not cluster.workdir.exists()
    assert "Traceback" not in capfd.readouterr().err


def test_a_local_cluster_interrupted_while_starting_stops_its_daemons(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = LocalCluster(2)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cluster, "_wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cluster.start()
    assert all(node.process is not None and node.process.poll() is not None for node in cluster.nodes.values())
    assert not cluster.workdir.exists()


def test_a_started_cluster_is_ready_as_every_daemon_says_it() -> None:
    """``start`` returns once each daemon reports ready (``status``, systemd's READY=1), not only once it sees
    its peers: a daemon decides it is ready on its next liveness check after that, and a test that asked at
    once found it not ready (test_ctl's test_status, about one run in a dozen)."""
    cluster = LocalCluster(2, backend="ib").start()
    try:
        for name in cluster.names:
            result = ctl("status", "--json", "--socket", cluster.socket(name))
            assert result.exit_code == 0, result.stderr
            assert result.json()["ready"] is True
    finally:
        cluster.stop()
