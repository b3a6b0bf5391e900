"""systemd's notify protocol and a clean stop, with real daemons and a real NOTIFY_SOCKET datagram listener.

The listener plays systemd's part: it binds an AF_UNIX datagram socket, passes its path in NOTIFY_SOCKET
(with WATCHDOG_USEC) to the daemon, and reads each datagram with the sender's credentials, accepting
only the daemon's main process (what NotifyAccess=main does).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import gpuclient
from cmd_ring import RingFullError
from tests.support.cluster import join_ranks
from tests.support.ctl import assert_one_line, ctl
from tests.support.ops_cluster import CHUNK
from tests.support.waiting import wait_until
from transportd.control.client import ControlConnection
from transportd.control.protocol import Stats
from transportd.daemon.sdnotify import Notifier
from transportd.errors import DaemonUnavailableError
from transportd_cli.localcluster import LocalCluster, LocalNode

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

WATCHDOG_USEC = 200_000  # the daemon must pet every 0.1 s


class NotifyListener:
    """systemd's end of the notify protocol: a thread reads every datagram with its sender's pid (SO_PASSCRED)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[int, list[str]]] = []  # (sender pid, lines)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data, ancillary, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            pid = -1
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", payload[:12])[0]
            with self._lock:
                self.messages.append((pid, data.decode().split("\n")))

    def lines(self, pid: int) -> list[str]:
        """Every line ``pid`` sent, in order (a datagram may hold several)."""
        with self._lock:
            return [line for sender, lines in self.messages if sender == pid for line in lines]

    def senders(self) -> set[int]:
        with self._lock:
            return {sender for sender, _ in self.messages}

    def lines_if(self, pid: int, predicate: Callable[[list[str]], bool]) -> list[str] | None:
        """``pid``'s lines once ``predicate`` holds for them, else None (a condition for ``wait_until``)."""
        lines = self.lines(pid)
        return lines if predicate(lines) else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _start(node: LocalNode, **extra_env: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRANSPORTD_SOCKET", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.update(PYTHONUNBUFFERED="1", **extra_env)
    node.log_file = open(node.log_path, "ab")  # LocalCluster.stop() closes it and stops the process
    node.process = subprocess.Popen([sys.executable, "-m", "transportd", "run", "--config", str(node.config_path)],
                                    stdout=node.log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return node.process


def _answers_with_peers(node: LocalNode) -> bool:
    try:
        with ControlConnection(node.socket, timeout_ms=2000, handshake_timeout_ms=500) as conn:
            return any(p["up"] for p in conn.request(Stats())["peers"].values())
    except DaemonUnavailableError:
        return False


def test_notify_protocol_and_sigterm_drains_a_streaming_client(tmp_path) -> None:
    cluster = LocalCluster(2, overrides={"peers": {"ready_wait_s": 60.0}})
    listener = NotifyListener(tmp_path / "notify.sock")
    try:
        node_a, node_b = cluster.nodes["nodea"], cluster.nodes["nodeb"]
        proc_a = _start(node_a, NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC=str(WATCHDOG_USEC))
        pid = proc_a.pid

        # alone, nodea pets the watchdog and says what it waits for, but is not ready: its static peer is down
        lines = wait_until(lambda: listener.lines_if(pid, lambda ls: ls.count("WATCHDOG=1") >= 3 and any(
            x.startswith("STATUS=waiting for static peers") for x in ls)), "nodea's watchdog and waiting status", 30)
        assert "READY=1" not in lines
        assert any("peers 0 up" in x for x in lines if x.startswith("STATUS="))

        _start(node_b)  # the peer comes up: READY=1 follows, with a status line
        lines = wait_until(lambda: listener.lines_if(pid, lambda ls: "READY=1" in ls), "READY=1", 30)
        ready_at = lines.index("READY=1")
        assert lines[ready_at + 1].startswith("STATUS=") and "peers 1 up" in lines[ready_at + 1]
        wait_until(lambda: _answers_with_peers(node_b), timeout=30, what="nodeb")

        try:
            a, b = join_ranks(cluster, job="drain", nbytes=1 << 20)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n--- nodea ---\n{cluster.log('nodea')}\n--- nodeb ---\n"
                                 f"{cluster.log('nodeb')}") from exc
        wait_until(lambda: listener.lines_if(pid, lambda ls: any("1 client(s)" in x for x in ls[ready_at:])),
                   "a STATUS line for the joined client", 10)

        # a client streams PUT_SIGNALs (each adds 1 to b's flag 0) while the daemon is told to stop
        a.channel.timeout = 0.05
        lock, stop, committed = threading.Lock(), threading.Event(), [0]

        def stream() -> None:
            i = 0
            while not stop.is_set():
                with lock:
                    try:
                        off = (i % 256) * CHUNK
                        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=off, src_region=a.src.id,
                                             src_off=off, nbytes=CHUNK, slot=0, value=1)
                    except RingFullError:
                        pass  # the daemon stopped taking records
                    else:
                        i += 1
                        committed[0] = i

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        wait_until(lambda: committed[0] >= 1000, timeout=30, what="the stream to get going")
        with lock:  # nothing is committed between reading the count and the signal's delivery
            before_signal = committed[0]
            os.kill(pid, signal.SIGTERM)
        try:
            code = proc_a.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, cluster.log("nodea")
        stop.set()
        streamer.join(10)

        # every record committed before the signal was taken, and every record taken was delivered
        taken = a.channel.ring.consumer_pos
        assert taken >= before_signal
        assert a.channel.ring.completion_pos == taken
        assert b.session.wait(slot=0, at_least=taken, timeout=10) == taken
        time.sleep(0.2)  # a duplicate would land in this window: an absence has no condition to poll for
        assert b.session.wait(slot=0, at_least=0) == taken, "no record delivered twice"
        touched = min(taken, 256) * CHUNK
        assert np.array_equal(b.recv[:touched], a.send[:touched])

        lines = wait_until(lambda: listener.lines_if(pid, lambda ls: "STOPPING=1" in ls), "STOPPING=1", 5)
        stopping_at = lines.index("STOPPING=1")
        assert ready_at < stopping_at and "WATCHDOG=1" in lines[ready_at:stopping_at]
        assert all(x.startswith("STATUS=") for x in lines[stopping_at + 1:]), "nothing but status after STOPPING"
        assert listener.senders() == {pid}  # only the main process spoke (what NotifyAccess=main accepts)

        # a stopped daemon: transportctl says so in one line, exit status 2
        result = ctl("status", "--socket", node_a.socket)
        assert result.exit_code == 2 and "transportd is not running" in assert_one_line(result.stderr)
        b.session.leave()
        b.client.close()
        a.client.close()
    finally:
        listener.close()
        cluster.stop()


def test_notifier_honours_watchdog_pid_and_abstract_sockets() -> None:
    name = f"tpd-notify-test-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("\0" + name)
    server.settimeout(2)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())})
        assert n.enabled and n.watchdog_interval_s == 0.5
        n.ready("up")
        assert server.recv(4096) == b"READY=1\nSTATUS=up"
        n.status("up")  # unchanged: not repeated
        n.tick()
        assert server.recv(4096) == b"WATCHDOG=1"
        n.stopping("bye")
        assert server.recv(4096) == b"STOPPING=1\nSTATUS=bye"
        time.sleep(0.6)  # a watchdog ping is due again, but systemd no longer watches a stopping service
        n.tick()
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.recv(4096)
        server.settimeout(2)
        n.close()
        # a manager that stops reading never holds the sender (a blocking send would hang this test): status
        # and watchdog are dropped once its queue is full, READY=1 gives up after a bounded wait
        busy = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "2", "WATCHDOG_PID": str(os.getpid())})
        busy.important_wait_s = 0.2
        assert sum(busy.notify(f"STATUS={i}") for i in range(2000)) < 2000
        busy.tick()
        assert busy.notify("READY=1", wait_s=0.2) is False
        busy.ready("late")
        busy.close()
        other = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
        assert other.watchdog_interval_s == 0  # the watchdog is another process's
        assert not Notifier({}).enabled  # not under systemd: every call is a no-op
        Notifier({}).ready()
    finally:
        server.close()


def test_sighup_hands_the_jobs_to_a_successor_that_systemd_takes_for_the_main_process(tmp_path) -> None:
    """The unit's ExecReload (SIGHUP): the daemon starts its successor, hands over once it is ready, says
    RELOADING=1 and MAINPID=<successor>; the successor says READY=1, and the session re-attached to it."""
    cluster = LocalCluster(1, overrides={"peers": {"restart_grace_s": 120.0}})
    listener = NotifyListener(tmp_path / "notify.sock")
    try:
        node = cluster.nodes["nodea"]
        old = _start(node, NOTIFY_SOCKET=str(listener.path), WATCHDOG_USEC=str(WATCHDOG_USEC)).pid
        wait_until(lambda: listener.lines_if(old, lambda ls: "READY=1" in ls), "READY=1", 60)
        client = gpuclient.connect(node.socket)
        session = client.join("reload", rank=0, world=1)
        flags = session.flags(4)
        ch = session.channel(capacity=64)
        os.kill(old, signal.SIGHUP)
        new = cluster.follow("nodea")
        lines = wait_until(lambda: listener.lines_if(old, lambda ls: f"MAINPID={new}" in ls), "MAINPID=", 60)
        assert "RELOADING=1" in lines and lines.index("RELOADING=1") < lines.index(f"MAINPID={new}")
        wait_until(lambda: listener.lines_if(new, lambda ls: "READY=1" in ls), "the successor's READY=1", 60)
        wait_until(lambda: session.reattach.count == 1, "the session to re-attach", 120)
        ch.put(peer=0, dst_region=0, dst_off=0, src_region=0, src_off=0, nbytes=8)  # to itself: refused
        wait_until(lambda: ch.status()[0] != 0, "the successor to take the record")
        assert flags.status == 0
        client.close()
    finally:
        listener.close()
        cluster.stop()
