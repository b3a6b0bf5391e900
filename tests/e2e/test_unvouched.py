"""Connections to the descriptor socket that never vouch are capped in number and in time.

A connection that has not presented a valid hello token holds a descriptor and a poll slot of the daemon:
it is closed after ``control.vouch_timeout_s``, and at most ``control.max_unvouched`` wait at once (a
quarter per uid), a newer one closing the oldest of its uid. Real daemon, real sockets, a second real uid.
"""

from __future__ import annotations

import select
import socket
import time

import pytest

import gpuclient
from tests.support.users import GROUP, run_as
from tests.support.waiting import wait_until
from transportd.control import codec

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

TIMEOUT_S, MAX_UNVOUCHED = 1.0, 8  # so 2 per uid


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    return sock


def _closed(sock: socket.socket) -> bool:
    """The daemon closed its end (EOF is readable at once)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except ConnectionResetError:
        return True


def _works(socket_endpoint: str, job: str) -> None:
    with gpuclient.connect(socket_endpoint) as client:
        session = client.join(job, rank=0, world=1)
        session.register(gpuclient.host_array(4096))
        session.flags(4)
        assert session.channel(capacity=64).ring.capacity == 64
        session.leave()


OTHER_CLIENT = """
    import gpuclient
    with gpuclient.connect(sys.argv[1]) as client:
        session = client.join("other-uid", rank=0, world=1)
        session.register(gpuclient.host_array(4096))
        session.flags(4)
        capacity = session.channel(capacity=64).ring.capacity
        session.leave()
    print(json.dumps({"capacity": capacity}))
"""


def test_silent_and_babbling_connections_are_closed_after_the_vouch_timeout(cluster_factory) -> None:
    cluster = cluster_factory(nodes=1, per_node={"nodea": {"control": {"vouch_timeout_s": TIMEOUT_S,
                                                                       "max_unvouched": MAX_UNVOUCHED}}})
    path = cluster.socket("nodea").removeprefix("ipc://") + ".fds"
    silent, babbling = _connect(path), _connect(path)
    t0 = time.monotonic()
    try:
        # garbage, and a wrong token: answered with errors, never vouched
        babbling.send(b"\xc1 not msgpack")
        assert codec.decode(babbling.recv(4096), 4096)["ok"] is False
        babbling.send(codec.encode({"v": 1, "op": "vouch", "token": b"x" * 16}))
        assert "unknown or used token" in codec.decode(babbling.recv(4096), 4096)["message"]
        _works(cluster.socket("nodea"), "beside-them")  # a client that vouches is served meanwhile
        wait_until(lambda: _closed(silent) and _closed(babbling), "the unvouched connections to be closed", 10)
        assert time.monotonic() - t0 >= TIMEOUT_S * 0.9  # not before their time was up
        assert "no valid vouch within 1s" in cluster.log("nodea")
        _works(cluster.socket("nodea"), "after-them")
    finally:
        silent.close()
        babbling.close()


def test_a_flood_of_unvouched_connections_holds_a_few_slots_and_stops_no_client(cluster_factory, users,
                                                                                 shared_dir) -> None:
    cluster = cluster_factory(nodes=1, workdir=str(shared_dir),
                              per_node={"nodea": {"control": {"group": GROUP, "mode": 0o666,
                                                              "vouch_timeout_s": 600.0,
                                                              "max_unvouched": MAX_UNVOUCHED}}})
    path = cluster.socket("nodea").removeprefix("ipc://") + ".fds"
    flood = [_connect(path) for _ in range(5 * MAX_UNVOUCHED)]  # as this uid; none will ever vouch
    try:
        # all but this uid's quarter of the slots are closed, the oldest first (no timeout helps here)
        wait_until(lambda: sum(not _closed(s) for s in flood) == MAX_UNVOUCHED // 4, "the flood to be capped", 10)
        assert all(_closed(s) for s in flood[:-MAX_UNVOUCHED // 4])
        assert "too many connections waiting to vouch" in cluster.log("nodea")
        # clients of this uid and of another one connect, vouch and work while the flood goes on
        _works(cluster.socket("nodea"), "same-uid")
        assert run_as(users["other"], OTHER_CLIENT, cluster.socket("nodea")) == {"capacity": 64}
        flood += [_connect(path) for _ in range(MAX_UNVOUCHED)]
        _works(cluster.socket("nodea"), "same-uid-again")
    finally:
        for s in flood:
            s.close()


@pytest.mark.parametrize("bad", [0, 3, 5000])
def test_max_unvouched_out_of_range_is_a_config_error(bad: int, tmp_path) -> None:
    from transportd.config import load_config
    from transportd.errors import ConfigError

    config = tmp_path / "bad.toml"
    config.write_text(f"[control]\nmax_unvouched = {bad}\n")
    with pytest.raises(ConfigError, match="control.max_unvouched"):
        load_config(config, env={})
