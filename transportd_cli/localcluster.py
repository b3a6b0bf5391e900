"""Several transportd nodes on one machine: real daemon processes, real sockets, softverbs rails.

Used by ``transportd demo``, the multi-process tests and ``transportd bench e2e``; ``transportd localcluster
N`` (or ``python -m transportd_cli.localcluster N``) starts N of them and leaves them running until Ctrl-C,
to try the client library against. Each node gets its own control socket in a work directory and a peer
port on 127.0.0.1; every node lists every other one as a static peer.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from transportd.config import load_config
from transportd.control.client import ControlConnection
from transportd.control.curve import generate_keypair
from transportd.control.protocol import Stats
from transportd.errors import DaemonUnavailableError, TransportdError
from transportd.lifetime import die_with_parent
from transportd_cli.errors import Stopped

__all__ = ["LocalCluster", "free_port", "localcluster"]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM this daemon when the process that started it dies (Linux)."""
    die_with_parent(signal.SIGTERM)


@contextlib.contextmanager
def _signals_held(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Ctrl-C or SIGTERM that arrives inside the block is held and delivered once it ends, to the handler that
    was there before (main thread only: Python runs signal handlers there). Starting a daemon forks, and a
    handler that raises in the middle of it does harm: inside the logging module's at-fork hook it skips the
    lock's acquire, so the hook's release after the fork fails (a traceback on stderr); inside ``Popen``
    after the fork it loses the handle of a daemon that is already running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind-to-0 and outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A 127.0.0.1 TCP port that binds now and that no other caller in this process was given.

    Picked below the ephemeral range: a port taken from that range (bind to 0) is free only until the
    next outgoing connection on the machine, which the kernel may give that very port before the daemon
    binds it.
    """
    low = _ephemeral_low()
    candidates = list(range(max(1024, low - 20000), low)) if low > 2048 else []
    random.shuffle(candidates)
    for port in candidates[:200]:
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range: fall back to the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, e.g. one of backend.rails
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def render_toml(sections: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(v)}" for key, v in values.items()]
        lines.append("")
    return "\n".join(lines)


class Successor:
    """A daemon that took over from one this cluster started (``transportctl restart``: the running daemon
    starts its successor, which outlives it): what the cluster needs of a ``Popen``, by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                running = f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError, IndexError):
            running = False
        if not running and self.returncode is None:
            self.returncode = 0  # not our child: its status is its reaper's
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.01)
        return self.returncode or 0

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class LocalNode:
    name: str
    config_path: Path
    socket: str
    peer_port: int
    log_path: Path
    process: subprocess.Popen | Successor | None = None
    log_file: Any = field(default=None, repr=False)
    groups: set[int] = field(default_factory=set)  # process groups its daemons started in (successors too)


class LocalCluster:
    """Start ``nodes`` daemons with ``backend`` over softverbs; ``overrides`` are extra config sections."""

    def __init__(self, nodes: int = 2, *, backend: str = "ib", workdir: str | None = None, curve: bool = False,
                 overrides: dict[str, dict[str, Any]] | None = None, per_node: dict[str, dict[str, Any]] | None = None,
                 ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="tpd-cluster-"))
        self.nodes: dict[str, LocalNode] = {}
        names = [f"node{chr(ord('a') + i)}" for i in range(nodes)]
        ports = {name: free_port() for name in names}
        keys_dir = self.workdir / "authorized"
        if curve:
            keys_dir.mkdir(exist_ok=True)
            for name in names:
                public, _secret = generate_keypair(self.workdir / "keys", name)
                shutil.copy(public, keys_dir / f"127.0.0.1_{ports[name]}.key")
        for name in names:
            sections: dict[str, dict[str, Any]] = {
                "node": {"name": name},
                "control": {"socket": f"ipc://{self.workdir}/{name}.sock"},
                "peers": {"listen": f"tcp://127.0.0.1:{ports[name]}",
                          "static": [f"127.0.0.1:{ports[o]}" for o in names if o != name],
                          "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "restart_grace_s": 5.0},
                "backend": {"kind": backend, "verbs": "soft"},
                "logging": {"level": "info", "format": "text"},
            }
            if curve:
                sections["security"] = {
                    "curve_secret_key_file": str(self.workdir / "keys" / f"{name}.key_secret"),
                    "curve_public_key_file": str(self.workdir / "keys" / f"{name}.key"),
                    "curve_authorized_keys_dir": str(keys_dir)}
            for source in (overrides or {}, (per_node or {}).get(name, {})):
                for section, values in source.items():
                    sections.setdefault(section, {}).update(values)
            path = self.workdir / f"{name}.toml"
            try:
                path.write_text(render_toml(sections))
                load_config(path, env={})  # a ConfigError here, naming the key, not a daemon's exit 78 later
            except BaseException:  # ConfigError, or Ctrl-C: a work directory of ours does not stay behind
                if self._own_dir:
                    shutil.rmtree(self.workdir, ignore_errors=True)
                raise
            self.nodes[name] = LocalNode(name, path, sections["control"]["socket"], ports[name],
                                         self.workdir / f"{name}.log")

    @property
    def names(self) -> list[str]:
        return list(self.nodes)

    def socket(self, name: str) -> str:
        return self.nodes[name].socket

    def start(self, timeout_s: float = 60.0, *, peers_up: int | None = None) -> LocalCluster:
        """Start every daemon and wait until each answers on its control socket and sees ``peers_up`` peers
        (default: all the others; fewer for a test where some link is meant to fail)."""
        try:
            for node in self.nodes.values():
                self._launch(node)
            deadline = time.monotonic() + timeout_s
            for node in self.nodes.values():
                self._wait_ready(node, deadline, peers_up)
        except BaseException:  # a daemon that failed, a timeout, Ctrl-C: none is left running, nor its files
            self.stop()
            raise
        return self

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a stopped or killed daemon again with its config (a node coming back) and wait until ready."""
        node = self.nodes[name]
        if node.process is not None and node.process.poll() is None:
            raise RuntimeError(f"daemon {name} is still running")
        if node.log_file:
            node.log_file.close()
        self._launch(node)
        self._wait_ready(node, time.monotonic() + timeout_s)

    def follow(self, name: str, timeout_s: float = 120.0) -> int:
        """After a restart request (``transportctl restart``) the node is served by a successor of the daemon
        started here: wait until it answers, and track it from now on (stop, kill, restart); its pid."""
        node = self.nodes[name]
        old = node.process.pid if node.process is not None else -1
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with ControlConnection(node.socket, timeout_ms=2000, handshake_timeout_ms=500) as conn:
                    pid = int(conn.request(Stats())["pid"])
                if pid != old:
                    if isinstance(node.process, subprocess.Popen):
                        node.process.wait(30)  # the predecessor exits once it handed over
                    node.process = Successor(pid)
                    return pid
            except TransportdError:  # none answering yet, or the old one closing as we greet it
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no successor of daemon {name} answered in time:\n{self.log(name)}")
            time.sleep(0.05)

    def _launch(self, node: LocalNode) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("TRANSPORTD_SOCKET", None)
        node.log_file = open(node.log_path, "ab")
        with _signals_held():  # an interrupt now is acted on once the daemon's handle is kept
            node.process = subprocess.Popen(
                [sys.executable, "-m", "transportd", "run", "--config", str(node.config_path)],
                stdout=node.log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=_die_with_parent)
            node.groups.add(node.process.pid)  # its own session and group: a successor it starts stays in it

    def _wait_ready(self, node: LocalNode, deadline: float, peers_up: int | None = None) -> None:
        want = len(self.nodes) - 1 if peers_up is None else peers_up
        # with every peer up, also ready as the daemon says it (systemd's READY=1, `status`): it decides that
        # on its next liveness check after the peers are up, and a test that asks at once must find it so
        # (with fewer peers it would say so only after peers.ready_wait_s)
        want_ready = peers_up is None
        while True:
            if node.process is not None and node.process.poll() is not None:
                raise RuntimeError(f"daemon {node.name} exited with {node.process.returncode}:\n{self.log(node.name)}")
            try:
                with ControlConnection(node.socket, timeout_ms=2000, handshake_timeout_ms=500) as conn:
                    stats = conn.request(Stats())
                if (stats["ready"] or not want_ready) and sum(1 for p in stats["peers"].values() if p["up"]) >= want:
                    return
            except DaemonUnavailableError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon {node.name} not ready in time:\n{self.log(node.name)}")
            time.sleep(0.05)

    def log(self, name: str) -> str:
        try:
            return self.nodes[name].log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self, name: str) -> None:
        """SIGKILL one daemon (a node failing without goodbye)."""
        proc = self.nodes[name].process
        if proc and proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)  # a successor is in its predecessor's group
            proc.wait(10)

    def terminate(self, name: str, timeout_s: float = 20.0) -> int:
        """SIGTERM one daemon and wait for it; returns its exit status."""
        proc = self.nodes[name].process
        assert proc is not None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
                proc.wait(5)
        return proc.returncode

    def stop(self) -> None:
        for name, node in self.nodes.items():
            if node.process is not None:
                self.terminate(name)
            for group in node.groups:  # a successor nobody followed (a restart request), and its workers
                try:
                    os.killpg(group, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for node in self.nodes.values():
            if node.log_file:
                node.log_file.close()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- `transportd localcluster N` ----------------------------------------------------------------------------
class _StopRequest:
    """Ctrl-C or SIGTERM, remembered as well as raised: a signal that lands inside a callback whose
    exceptions Python ignores (a finalizer, a weakref callback; a daemon's fork holds signals, see
    ``_signals_held``) would otherwise be lost, and the command would run on with nobody to stop it."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: object) -> None:
        self.requested = True
        raise Stopped

    def check(self) -> None:
        if self.requested:
            raise Stopped

    @staticmethod
    def unraisable(info: Any) -> None:
        """sys.unraisablehook while the command runs: a swallowed stop request is not news (check() acts on
        it); anything else goes to the default hook."""
        if info.exc_type is not None and issubclass(info.exc_type, Stopped | KeyboardInterrupt):
            return
        sys.__unraisablehook__(info)


@click.command("localcluster")
@click.argument("nodes", metavar="N", type=click.IntRange(1, 26), default=2)
@click.option("--backend", type=click.Choice(["ib", "efa"]), default="ib", show_default=True)
@click.option("--timeout", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="seconds the daemons may take to start and see each other")
def localcluster(nodes: int, backend: str, timeout: float) -> None:
    """Start N daemons on this machine over softverbs, print their sockets, run until Ctrl-C.

    Each daemon is one simulated node; a process joining rank i of a job talks to daemon i. The printed
    environment lines set what ``gpuclient.connect().join()`` reads. Ctrl-C (or SIGTERM) stops the daemons
    and removes the work directory, also during start-up."""
    stop = _StopRequest()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    sys.unraisablehook = stop.unraisable
    try:
        cluster = LocalCluster(nodes, backend=backend)
        try:
            click.echo(f"starting {nodes} daemon(s) ({backend} over softverbs) in {cluster.workdir}")
            cluster.start(timeout_s=timeout)
            stop.check()  # a request that arrived where its exception was swallowed
        except (KeyboardInterrupt, Stopped):
            cluster.stop()  # start() has stopped what it started; this covers an interrupt before it
            click.echo("interrupted: daemons stopped, work directory removed", err=True)
            sys.exit(130)
        except (RuntimeError, TimeoutError) as exc:  # the message ends with the daemon's log
            head, _, log = str(exc).partition("\n")
            last = log.strip().splitlines()[-1:] or ["(empty log)"]
            raise click.ClickException(f"{head.rstrip(':')}; the end of its log: {last[0]}") from None
        try:
            _announce(cluster)
            while True:
                stop.check()
                for name, node in cluster.nodes.items():
                    if node.process is not None and node.process.poll() is not None:
                        log = cluster.log(name)
                        raise click.ClickException(f"daemon {name} exited with {node.process.returncode}; the "
                                                   f"end of its log: {' '.join(log.splitlines()[-1:])}")
                time.sleep(0.5)
        except (KeyboardInterrupt, Stopped):
            click.echo("stopping")
        finally:
            cluster.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = sys.__unraisablehook__


def _announce(cluster: LocalCluster) -> None:
    world = len(cluster.names)
    click.echo(f"{world} daemon(s) ready:")
    for name in cluster.names:
        click.echo(f"  {name}  {cluster.socket(name)}")
    click.echo(f"rank i of a {world}-rank job on daemon i (the variables `gpuclient.connect().join()` reads):")
    for rank, name in enumerate(cluster.names):
        click.echo(f"  export TRANSPORTD_SOCKET={cluster.socket(name)} TRANSPORTD_JOB=local "
                   f"TRANSPORTD_RANK={rank} TRANSPORTD_WORLD={world}")
    click.echo(f"inspect one: transportctl status --socket {cluster.socket(cluster.names[0])}")
    click.echo("Ctrl-C stops them and removes the work directory.")


if __name__ == "__main__":
    localcluster(prog_name="python -m transportd_cli.localcluster")
