"""Who may touch what: memory passed by descriptor, identity from the kernel, jobs owned by their uid.

Real daemons, real sockets, real processes. The second uid is a real user: CI runs as root, so the test
creates one (``useradd``) and runs its client under it (setuid/setgid in the child).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gpuclient
from tests.support.cluster import close_ranks, join_ranks
from tests.support.users import GROUP, run_as
from tests.support.waiting import wait_until
from transportd.control.client import ControlConnection
from transportd.control.fdsocket import FdClient
from transportd.control.protocol import Hello, Inspect, Join, PassFd, Register, Stats
from transportd.errors import ErrorCode, RequestError

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

INTRUDER = """
    socket = sys.argv[1]
    out = {}
    def refusal(fn):
        try:
            fn()
        except RequestError as exc:
            return [exc.code, exc.message]
        return None
    conn = ControlConnection(socket)
    out["vouched"] = conn.vouch_reply
    out["join"] = refusal(lambda: conn.request(Join(job="owned", rank=1, world=2, device=-1)))
    out["inspect"] = refusal(lambda: conn.request(Inspect(what="flags", job="owned", rank=0)))
    out["stats_jobs"] = sorted(conn.request(Stats())["jobs"])
    run = click.testing.CliRunner().invoke(transportd_cli.ctl.main, ["flags", "owned", "0", "--socket", socket])
    out["ctl"] = [run.exit_code, run.output]
    # its own job works, and the first user's registration ids mean nothing on its descriptor socket
    client = gpuclient.Client(conn)
    session = client.join("mine", rank=0, world=1)
    out["own_region"] = session.register(gpuclient.host_array(4096)).id
    out["foreign_fd"] = refusal(lambda: conn.request(Register(kind="host", handle=0, size=4096)))
    session.leave()
    print(json.dumps(out))
"""

OUTSIDE = """
    conn = ControlConnection(sys.argv[1], handshake=False)
    conn.request(Hello())
    out = {}
    try:
        conn.vouch()
    except RequestError as exc:
        out["vouch"] = [exc.code, exc.message]
    try:
        conn.request(Join(job="anything", rank=0, world=1, device=-1))
    except RequestError as exc:
        out["join"] = [exc.code, exc.message]
    print(json.dumps(out))
"""


def test_a_second_uid_cannot_join_inspect_or_register_into_a_job_of_the_first(cluster_factory, users,
                                                                              shared_dir) -> None:
    cluster = cluster_factory(nodes=1, workdir=str(shared_dir),
                              per_node={"nodea": {"control": {"group": GROUP, "mode": 0o666}}})
    socket = cluster.socket("nodea")
    owner = gpuclient.connect(socket)
    try:
        session = owner.join("owned", rank=0, world=2)
        session.register(gpuclient.host_array(4096))
        session.flags(4)
        seen = run_as(users["other"], INTRUDER, socket)
        assert seen["vouched"]["uid"] == users["other"].pw_uid  # the kernel's word, not the client's
        assert seen["join"][0] == "forbidden" and "belongs to another user" in seen["join"][1]
        assert seen["inspect"][0] == "forbidden" and "belongs to another user" in seen["inspect"][1]
        assert seen["ctl"][0] == 1 and "belongs to another user" in seen["ctl"][1], seen["ctl"]
        assert "owned" not in seen["stats_jobs"]
        assert seen["own_region"] == 0  # its own job works beside the other's
        assert seen["foreign_fd"][0] == "not_found" and "no descriptor 0" in seen["foreign_fd"][1]
        # the owner's job is untouched: one local rank, its flags readable by its owner (and root)
        assert owner.stats()["jobs"]["owned"]["local"] == [0]
        with ControlConnection(socket) as conn:
            assert conn.request(Inspect(what="flags", job="owned", rank=0))["values"] == [0, 0, 0, 0]
        # control.group is enforced on the descriptor socket too, whatever the socket file's mode allows
        outside = run_as(users["outsider"], OUTSIDE, socket)
        assert outside["vouch"][0] == "forbidden" and f"not in group '{GROUP}'" in outside["vouch"][1]
        assert outside["join"][0] == "no_identity"
        session.leave()
    finally:
        owner.close()


def test_a_register_naming_a_path_or_a_named_file_is_refused_and_the_daemon_serves_on(cluster_factory,
                                                                                       tmp_path) -> None:
    cluster = cluster_factory(nodes=1)
    victim = gpuclient.connect(cluster.socket("nodea"))
    attacker = ControlConnection(cluster.socket("nodea"))
    ring = tmp_path / "named"  # a file anyone could name (the daemon's own rings have no name at all)
    ring.write_bytes(bytes(8192))
    try:
        vs = victim.join("victim", rank=0, world=1)
        vs.flags(4)
        vs.channel(capacity=64)
        attacker.request(Join(job="attacker", rank=0, world=1, device=-1))
        # a path, as the library never sends it: refused before the daemon opens anything
        with pytest.raises(RequestError, match="never by path") as info:
            attacker.request({"v": 1, "op": "register", "kind": "host", "handle": str(ring), "size": 4096})
        assert info.value.code == "bad_field"
        # a named file opened and passed as a descriptor: not a memfd, refused
        fd = os.open(ring, os.O_RDWR)
        try:
            fd_id = attacker.pass_fd(fd)
        finally:
            os.close(fd)
        with pytest.raises(RequestError, match="must be a memfd") as info:
            attacker.request(Register(kind="host", handle=fd_id, size=4096))
        assert info.value.code == "invalid"
        with pytest.raises(RequestError, match=f"no descriptor {fd_id} was passed"):  # taken (and closed) once
            attacker.request(Register(kind="host", handle=fd_id, size=4096))
        # a memfd whose size is not sealed: its owner could shrink it under the rail worker (SIGBUS)
        loose = os.memfd_create("loose", os.MFD_CLOEXEC)
        try:
            os.ftruncate(loose, 8192)
            fd_id = attacker.pass_fd(loose)
        finally:
            os.close(loose)
        with pytest.raises(RequestError, match="size sealed") as info:
            attacker.request(Register(kind="host", handle=fd_id, size=4096))
        assert info.value.code == "invalid"
        # a memfd smaller than the region asked for
        small = gpuclient.host_array(4096)
        with pytest.raises(PermissionError):  # the library's own memory cannot shrink
            os.ftruncate(gpuclient.host_memory.resolve_host_buffer(small).fd, 0)
        fd_id = attacker.pass_fd(gpuclient.host_memory.resolve_host_buffer(small).fd)
        with pytest.raises(RequestError, match="outside the memfd"):
            attacker.request(Register(kind="host", handle=fd_id, size=8192))
        # a message with a descriptor too many, and one with none where one is due
        side = FdClient(cluster.socket("nodea")[len("ipc://"):] + ".fds")
        try:
            r, w = os.pipe()
            with pytest.raises(RequestError, match="carries 1 descriptor"):
                side.request(PassFd(), [r, w])
            with pytest.raises(RequestError, match="vouch for a control session"):
                side.request(PassFd(), [r])
            os.close(r)
            os.close(w)
        finally:
            side.close()
        # and the daemon serves everyone on: both clients register and report normally
        assert attacker.request(Register(kind="host", handle=attacker.pass_fd(
            gpuclient.host_memory.resolve_host_buffer(small).fd), size=4096))["region"] == 0
        assert vs.register(gpuclient.host_array(4096)).id == 0
        assert vs.stats()["jobs"]["victim"]["local"] == [0]
        vs.leave()
    finally:
        attacker.close()
        victim.close()


FORGER = """
    import os, sys, time
    from transportd.control.client import ControlConnection
    from transportd.control.protocol import Hello, Join
    conn = ControlConnection(sys.argv[1], handshake=False)
    conn.request(Hello(pid=int(sys.argv[2]), name="forger"))   # says it is another process
    seen = conn.vouch()
    conn.request(Join(job=sys.argv[3], rank=0, world=1, device=-1))
    print(seen["pid"], flush=True)
    time.sleep(600)
"""


def test_a_forged_pid_in_hello_changes_nothing(cluster_factory) -> None:
    cluster = cluster_factory(nodes=1, per_node={"nodea": {"control": {"client_timeout_s": 600.0}}})
    socket = cluster.socket("nodea")
    observer = gpuclient.connect(socket)
    dead = subprocess.Popen(["true"])
    dead.wait()
    procs = []
    try:
        # one claims the pid of a live process (this test's), one the pid of a process that has exited
        for job, claimed in (("claims-alive", os.getpid()), ("claims-dead", dead.pid)):
            proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FORGER), socket, str(claimed), job],
                                    stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdout is not None
            assert int(proc.stdout.readline()) == proc.pid  # the daemon watches the kernel's pid
        jobs = lambda: observer.stats()["jobs"]  # noqa: E731
        assert {"claims-alive", "claims-dead"} <= set(jobs())
        # killing the first reclaims it at once, though the pid it claimed lives on
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        wait_until(lambda: "claims-alive" not in jobs(), "the killed client to be reclaimed", 5.0)
        # the second claimed a dead pid: the liveness pass that reclaimed the first kept it
        assert "claims-dead" in jobs()
        assert observer.stats()["sessions_ended"]["exited"] == 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        observer.close()


def test_a_session_must_show_who_it_is_before_it_joins(cluster_factory) -> None:
    cluster = cluster_factory(nodes=1)
    conn = ControlConnection(cluster.socket("nodea"), handshake=False)
    other = ControlConnection(cluster.socket("nodea"), handshake=False)
    try:
        reply = conn.request(Hello())
        with pytest.raises(RequestError, match="has not shown who it is") as info:
            conn.request(Join(job="j", rank=0, world=1, device=-1))
        assert info.value.code == "no_identity"
        side = FdClient(reply["fd_socket"])
        try:
            with pytest.raises(RequestError, match="unknown or used token"):
                side.vouch(b"x" * 16)
            assert side.vouch(reply["token"])["pid"] == os.getpid()
        finally:
            side.close()  # the connection that vouched ends: so does the session's identity
        other.request(Hello())
        again = FdClient(reply["fd_socket"])
        try:
            with pytest.raises(RequestError, match="unknown or used token"):  # a token is good once
                again.vouch(reply["token"])
        finally:
            again.close()
        assert other.vouch()["uid"] == os.geteuid()
        other.request(Join(job="j", rank=0, world=1, device=-1))
    finally:
        conn.close()
        other.close()


PEEKER = """
    # what a member of the client group can reach of another uid's job: its rings and flags by name in
    # /dev/shm, or through the /proc entries of the daemon, its rail workers and the owner's process
    job, socket, pids = sys.argv[1], sys.argv[2], sys.argv[3:]
    out = {"named": [n for n in os.listdir("/dev/shm") if job in n], "opened": [], "listed": []}
    for pid in pids:
        for where in ("fd", "map_files"):
            try:
                names = os.listdir(f"/proc/{pid}/{where}")
            except PermissionError:
                continue
            out["listed"].append(f"{pid}/{where}")
            for name in names:
                try:
                    os.close(os.open(f"/proc/{pid}/{where}/{name}", os.O_RDWR))
                    out["opened"].append(f"{pid}/{where}/{name}")
                except OSError:
                    pass
    # offers are per descriptor connection: the owner's ids mean nothing on this one
    conn = ControlConnection(socket)
    out["take"] = []
    for fd_id in range(8):
        try:
            os.close(conn.take_fd(fd_id, "ring"))
            out["take"].append(fd_id)
        except RequestError as exc:
            assert exc.code == "not_found", exc
    print(json.dumps(out))
"""


def test_another_uid_in_the_group_cannot_open_a_jobs_rings_or_flags(cluster_factory, users, shared_dir) -> None:
    cluster = cluster_factory(nodes=1, workdir=str(shared_dir),
                              per_node={"nodea": {"control": {"group": GROUP, "mode": 0o666}}})
    socket = cluster.socket("nodea")
    owner = gpuclient.connect(socket)
    try:
        session = owner.join("private", rank=0, world=1)
        session.register(gpuclient.host_array(4096))
        flags = session.flags(4)
        ch = session.channel(capacity=64)
        maps = Path("/proc/self/maps").read_text()
        assert "/memfd:tpd-ring-private-0-" in maps and "/memfd:tpd-flags-private-0" in maps  # mapped, unnamed
        assert ch.ring.path is None and flags._file.path is None
        daemon = cluster.nodes["nodea"].process.pid
        workers = [r["pid"] for r in owner.stats()["rails"]]
        seen = run_as(users["other"], PEEKER, "private", socket, str(daemon), *map(str, workers), str(os.getpid()))
        assert seen["named"] == [], seen  # nothing of the job has a name in /dev/shm
        assert seen["listed"] == [] and seen["opened"] == [], seen  # /proc of other uids: refused by the kernel
        assert seen["take"] == [], seen
        # the owner's ring and flags are the daemon's own memory: a record it writes reaches the rail
        # worker (a signal to itself is refused, in the ring's error word), a flag word it writes the daemon
        ch.signal(peer=0, slot=1, value=5)
        with pytest.raises(gpuclient.ChannelError, match="BAD_PEER"):
            ch.quiet(timeout=10)
        flags.values[2] = 7
        with ControlConnection(socket) as conn:
            assert conn.request(Inspect(what="flags", job="private", rank=0))["values"] == [0, 0, 7, 0]
        session.leave()
    finally:
        owner.close()


VICTIM_HOST_ARRAY = """
    import sys, gpuclient
    client = gpuclient.connect(sys.argv[1])
    s = client.join("shm", rank=0, world=1)
    bufs = [gpuclient.host_array(1 << 20) for _ in range(4)]
    for b in bufs:
        s.register(b)
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_host_arrays_leave_nothing_in_dev_shm_when_their_client_is_killed(cluster_factory) -> None:
    cluster = cluster_factory(nodes=1)
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(VICTIM_HOST_ARRAY), cluster.socket("nodea")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert maps.count("/memfd:tpd-host") == 4, "host arrays are memfds"
        assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("tpd-host")]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with ControlConnection(cluster.socket("nodea")) as conn:
        wait_until(lambda: "shm" not in conn.request(Stats())["jobs"], "the client's reclaim")
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("tpd-host")]


def _worker_usage(pid: int) -> tuple[int, int]:
    """A rail worker's open descriptors and bytes mapped from memfds and /dev/shm files."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    mapped = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and (parts[5].startswith("/memfd:") or parts[5].startswith("/dev/shm/")):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            mapped += hi - lo
    return fds, mapped


KILLED_RANK = """
    import sys, gpuclient
    client = gpuclient.connect(sys.argv[1])
    s = client.join(sys.argv[2], rank=int(sys.argv[3]), world=2)
    s.register(gpuclient.host_array(1 << 20))
    s.register(gpuclient.host_array(1 << 20))
    s.flags(4)
    s.exchange(wait=False)
    s.channel(capacity=64)
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_rail_workers_descriptors_and_mappings_return_to_baseline_after_many_jobs(cluster_factory) -> None:
    """Leaving, a kill and a daemon-side reclaim (a client that drops its connection) each release every
    mapping and descriptor the rail workers took for a job."""
    cluster = cluster_factory(nodes=2)
    workers = {}
    for node in cluster.names:
        with ControlConnection(cluster.socket(node)) as conn:
            workers[node] = conn.request(Stats())["rails"][0]["pid"]

    def one_job(i: int, how: str) -> None:
        job = f"soak-{i}"
        if how == "kill":  # rank 1 is a process killed with SIGKILL
            proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_RANK), cluster.socket("nodeb"),
                                     job, "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            client = gpuclient.connect(cluster.socket("nodea"))
            session = client.join(job, rank=0, world=2)
            buf = gpuclient.host_array(1 << 20)
            session.register(buf)
            session.flags(4)
            session.exchange(timeout=30)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            session.leave()
            client.close()
            return
        ranks = join_ranks(cluster, job=job, nbytes=1 << 20, flags=4)
        a, b = ranks
        a.send[:4096] = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096]
        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0,
                             nbytes=4096, slot=0, value=1)
        a.channel.quiet(timeout=30)
        b.session.wait(slot=0, at_least=1, timeout=30)
        if how == "leave":
            close_ranks(ranks)
        else:  # the clients drop their connections without leaving: the daemons reclaim the sessions
            for r in ranks:
                r.client.close()

    def idle() -> bool:
        for node in cluster.names:
            with ControlConnection(cluster.socket(node)) as conn:
                if conn.request(Stats())["clients"]:  # joined sessions (the asking one has not joined)
                    return False
        return True

    one_job(0, "leave")  # first use: the soft devices' connections and threads come up
    wait_until(idle, "the warm-up job to be reclaimed")
    baseline = {node: _worker_usage(pid) for node, pid in workers.items()}
    for i in range(1, 13):
        one_job(i, ("leave", "kill", "drop")[i % 3])
    wait_until(idle, "every job to be reclaimed", 30)
    after = wait_until(lambda: (lambda u: u if u == baseline else None)(
        {node: _worker_usage(pid) for node, pid in workers.items()}), "the workers' descriptors and mappings "
        "to return to their baseline", 10)
    assert after == baseline
    assert all(mapped == 0 for _fds, mapped in baseline.values()), baseline  # nothing of any job is left


def test_quiet_says_client_gone_when_the_daemon_stops_or_dies(cluster_factory) -> None:
    # no daemon comes back within the grace period (docs/restart.md): the session is over
    cluster = cluster_factory(nodes=1, overrides={"peers": {"restart_grace_s": 1.0}})
    for stop in (cluster.terminate, cluster.kill):
        client = gpuclient.connect(cluster.socket("nodea"))
        try:
            session = client.join("quiet", rank=0, world=1)
            session.flags(4)
            ch = session.channel(capacity=64)
            stop("nodea")
            ch.signal(peer=0, slot=0, value=1)  # no proxy drains it any more
            with pytest.raises(gpuclient.ChannelError, match="CLIENT_GONE") as info:
                ch.quiet(timeout=5)
            assert info.value.code == ErrorCode.CLIENT_GONE
            # a daemon killed outright writes no status word: the session still hears, not a timeout
            with pytest.raises(gpuclient.ChannelError, match="CLIENT_GONE"):
                session.wait(slot=0, at_least=1, timeout=5)
        finally:
            client.close()
        cluster.restart("nodea")
