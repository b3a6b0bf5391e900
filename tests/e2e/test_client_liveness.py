"""Sessions of clients that die without leaving are reclaimed; live ones are kept, however idle.

Over ipc the kernel names the client's pid (``SO_PEERCRED`` on the descriptor socket), and the daemon
watches that pid and that connection; what a client says in ``hello`` counts for nothing. Over tcp the
client library's keepalives decide, and a session silent past ``control.client_timeout_s`` is reclaimed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import gpuclient
from tests.support.cluster import VICTIM_CLIENT
from tests.support.waiting import wait_until
from transportd.control.client import ControlConnection
from transportd.control.protocol import Hello, Join
from transportd.errors import RequestError, SessionLostError, TransportdError
from transportd_cli.localcluster import free_port

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def test_over_tcp_a_killed_client_is_reclaimed_and_an_idle_one_is_kept(cluster_factory) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cluster_factory(nodes=1, per_node={"nodea": {"control": {"socket": endpoint, "client_timeout_s": 1.0}}})
    live = gpuclient.connect(endpoint)
    try:
        assert live.info["keepalive_s"] == 0.25  # the daemon asks for a quarter of its timeout
        session = live.join("idle", rank=0, world=1)
        with pytest.raises(TransportdError, match="host memory cannot be registered over tcp"):
            session.register(gpuclient.host_array(4096))  # a descriptor cannot travel over tcp
        # nor the rings and flag arrays the daemon makes: anonymous memfds, handed over by descriptor only
        for what, ask in (("a flag array", lambda: session.flags(4)), ("a ring", lambda: session.channel(64))):
            with pytest.raises(RequestError, match="by descriptor on the local ipc descriptor socket") as info:
                ask()
            assert info.value.code == "unsupported", what
        victim = subprocess.Popen([sys.executable, "-c", VICTIM_CLIENT, endpoint], stdout=subprocess.PIPE, text=True)
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "joined"
        assert "victim" in live.stats()["jobs"]  # tcp without CURVE: one anonymous owner for both
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        t0 = time.monotonic()
        wait_until(lambda: "victim" not in live.stats()["jobs"], "the killed tcp client to be reclaimed")
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))  # the live client has now been idle for 3 timeouts
        stats = live.stats()
        assert "victim" not in stats["jobs"] and "idle" in stats["jobs"], stats["jobs"]
        session.leave()
    finally:
        live.close()


SILENT_CLIENT = """
import sys, time
from transportd.control.client import ControlConnection
from transportd.control.protocol import Hello, Join
conn = ControlConnection(sys.argv[1], handshake=False)   # a raw hello: no keepalive thread
conn.request(Hello(name="exits"))
conn.vouch()
conn.request(Join(job="exits", rank=0, world=1, device=-1))
print("joined", flush=True)
time.sleep(600)
"""


def test_an_ipc_client_is_judged_by_the_kernels_pid_not_by_its_silence(cluster_factory) -> None:
    cluster = cluster_factory(nodes=1, per_node={"nodea": {"control": {"client_timeout_s": 3.0}}})
    socket = cluster.socket("nodea")
    observer = gpuclient.connect(socket)
    # alive but silent (stopped in a debugger, say): no keepalives, yet its process exists
    silent = ControlConnection(socket, handshake=False)
    exits = subprocess.Popen([sys.executable, "-c", SILENT_CLIENT, socket], stdout=subprocess.PIPE, text=True)
    try:
        silent.request(Hello(name="stopped"))
        assert silent.vouch()["pid"] == os.getpid()
        silent.request(Join(job="stopped", rank=0, world=1, device=-1))
        assert exits.stdout is not None and exits.stdout.readline().strip() == "joined"
        jobs = lambda: observer.stats()["jobs"]  # noqa: E731
        exits.send_signal(signal.SIGKILL)
        exits.wait(10)
        wait_until(lambda: "exits" not in jobs(), "the killed client to be reclaimed", 2.0)  # at once
        time.sleep(4.0)  # past client_timeout_s, silent all along: the silence is what this test is about
        assert "stopped" in jobs(), "a silent client whose process is alive was reclaimed"
        assert observer.stats()["sessions_ended"] == {"left": 0, "exited": 1, "silent": 0, "shutdown": 0}
    finally:
        exits.kill()
        exits.wait(10)
        silent.close()
        observer.close()


def test_a_client_whose_daemon_stops_for_good_hears_once_its_grace_period_is_over_and_is_told_to_join_again(
        cluster_factory) -> None:
    """A stopping daemon hands its sessions over (docs/restart.md): its clients wait peers.restart_grace_s for
    the next one. None comes within it here: the session is over, and a daemon started later knows nothing
    of it. (tests/e2e/test_restart.py: one that does come back takes the same session over.)"""
    cluster = cluster_factory(nodes=1, overrides={"peers": {"restart_grace_s": 1.0}})
    client = gpuclient.connect(cluster.socket("nodea"))
    try:
        session = client.join("j", rank=0, world=1)
        session.flags(4)
        assert cluster.terminate("nodea") == 0
        with pytest.raises(gpuclient.ChannelError, match="CLIENT_GONE: this session is over") as info:
            session.wait(slot=0, at_least=1, timeout=30)
        assert "command(s) failed" not in str(info.value)  # no command failed: the session ended
        assert session.reattach.state == "gone"  # the grace period ended it, not the wait's timeout
        cluster.restart("nodea")  # the same socket: the client's connection reaches the new daemon
        with pytest.raises(SessionLostError, match="join again") as lost:
            session.register(gpuclient.host_array(4096))
        assert "session state" not in str(lost.value) and "the daemon no longer knows this session" in str(lost.value)
        again = gpuclient.connect(cluster.socket("nodea"))  # and starting over works
        again.join("j", rank=0, world=1).leave()
        again.close()
    finally:
        client.close()
