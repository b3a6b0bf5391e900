"""Operations tests: real daemons (``LocalCluster``) inspected with ``transportctl``, metrics and systemd notify.

One two-node cluster (:func:`ops_cluster`) serves every test that only looks: it is started once, carries
known traffic (so every counter the tests read has a known lower bound) and keeps its two clients joined.
"""

from __future__ import annotations

import grp
import inspect
import json
import os
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.e2e.conftest import Rank, close_ranks, join_ranks
from tests.support.waiting import wait_until  # noqa: F401  (the ops tests import it from here)
from transportd_cli.ctl import main as ctl_main
from transportd_cli.localcluster import LocalCluster, free_port

JOB = "ops"
CHUNK = 4096
PUTS = 16  # PUT_SIGNAL a -> b, each adds 1 to b's flag 0
SET_VALUE = 99  # then a FENCE and a SIGNAL SET of b's flag 1
BACK = 3  # PUT_SIGNAL b -> a, each adds 1 to a's flag 2
INFLIGHT_CAP = 8  # small, so a stalled peer fills the cap after four PUT_SIGNALs


def control_group() -> str:
    """A group nodeb gives its socket, rings and flag files to: not our own when we may (root), else ours."""
    if os.geteuid() == 0:
        for name in ("nogroup", "nobody", "users"):
            try:
                return grp.getgrnam(name).gr_name
            except KeyError:
                pass
    return grp.getgrgid(os.getegid()).gr_name


@dataclass
class OpsCluster:
    cluster: LocalCluster
    a: Rank  # rank 0 on nodea
    b: Rank  # rank 1 on nodeb
    metrics: dict[str, str]  # node -> host:port
    group: str  # nodeb's control.group

    def socket(self, node: str) -> str:
        return self.cluster.socket(node)


def installed_script(name: str) -> str | None:
    """The console script ``name`` installed next to this interpreter (a venv's bin/), else on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


@dataclass
class CtlResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def ctl(*args: str) -> CtlResult:
    """Run ``transportctl ARGS`` in this process (click's runner): fast, and exercises the same code."""
    kwargs = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {}
    runner = CliRunner(**kwargs)
    result = runner.invoke(ctl_main, list(args), catch_exceptions=False, env={"TRANSPORTD_SOCKET": None})
    return CtlResult(result.exit_code, result.stdout, result.stderr)


def ctl_process(*args: str, prefix: tuple[str, ...] = ()) -> CtlResult:
    """Run the installed ``transportctl`` script in a child process (the real entry point and exit status)."""
    script = installed_script("transportctl")
    if script is None:
        pytest.skip("the transportctl console script is not installed (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k != "TRANSPORTD_SOCKET"}
    proc = subprocess.run([*prefix, script, *args], capture_output=True, text=True, timeout=60, env=env)
    return CtlResult(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def ops_cluster() -> Iterator[OpsCluster]:
    metrics = {name: f"127.0.0.1:{free_port()}" for name in ("nodea", "nodeb")}
    per_node: dict[str, dict[str, Any]] = {name: {"metrics": {"listen": listen}} for name, listen in metrics.items()}
    group = control_group()
    per_node["nodeb"]["control"] = {"group": group}
    cluster = LocalCluster(
        2,
        overrides={"proxy": {"inflight_cap": INFLIGHT_CAP},
                   # the backpressure test stops nodeb's rail worker for a moment: keep the peer "up" meanwhile
                   "peers": {"heartbeat_timeout_s": 15.0}},
        per_node=per_node,
    )
    cluster.start()
    ranks: list[Rank] = []
    try:
        ranks = join_ranks(cluster, job=JOB, nbytes=1 << 20)
        a, b = ranks
        for i in range(PUTS):
            a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=i * CHUNK, src_region=a.src.id,
                                 src_off=i * CHUNK, nbytes=CHUNK, slot=0, value=1)
        a.channel.fence(peer=1)
        a.channel.signal(peer=1, slot=1, value=SET_VALUE, op="set")
        for i in range(BACK):
            b.channel.put_signal(peer=0, dst_region=a.dst.id, dst_off=i * CHUNK, src_region=b.src.id,
                                 src_off=i * CHUNK, nbytes=CHUNK, slot=2, value=1)
        assert b.session.wait(slot=0, at_least=PUTS, timeout=30) == PUTS
        assert b.session.wait(slot=1, at_least=SET_VALUE, timeout=30) == SET_VALUE
        assert a.session.wait(slot=2, at_least=BACK, timeout=30) == BACK
        a.channel.quiet(timeout=30)
        # one bad record on b's channel: region 77 was never registered -> BAD_REGION, counted by code
        b.channel.put(peer=0, dst_region=77, dst_off=0, src_region=b.src.id, src_off=0, nbytes=CHUNK)
        wait_until(lambda: b.channel.status()[0] != 0, what="the bad record's error word")
        yield OpsCluster(cluster, a, b, metrics, group)
    finally:
        try:
            if ranks:
                close_ranks(ranks)
        finally:
            cluster.stop()


def assert_one_line(text: str) -> str:
    lines = text.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip(), f"expected one line, got {text!r}"
    return lines[0]

