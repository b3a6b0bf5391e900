"""The control plane over real zmq sockets: a server in a thread, clients over ipc:// (and tcp:// with CURVE).

Good requests get replies; every kind of bad input gets an error reply and the server keeps serving; a
missing or dead daemon is a quick, actionable DaemonUnavailableError, never a hang.
"""

from __future__ import annotations

import grp
import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import msgpack
import pytest
import zmq

from transportd.config import load_config
from transportd.control import codec, protocol
from transportd.control.client import ControlConnection, resolve_endpoint
from transportd.control.curve import CurveClientKeys, CurveServerKeys, generate_keypair
from transportd.control.protocol import Exchange, Flags, Join, Register, SessionState, Stats
from transportd.control.server import BaseHandler, ControlDispatcher, ControlServer
from transportd.errors import (
    ConfigError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    LocalProtocolError,
    RequestError,
    TransportdError,
)

FAST = {"handshake_timeout_ms": 300, "timeout_ms": 2000}


class Handler(BaseHandler):
    """A stand-in daemon: answers, refuses, crashes and defers on cue."""

    def __init__(self) -> None:
        self.server: ControlServer | ControlDispatcher | None = None
        self.gone: list[bytes] = []
        self.waiting: list = []
        self.hold_exchange = False

    def on_join(self, client_id, req):
        return {"rank": req.rank, "world": req.world}

    def on_register(self, client_id, req):
        if req.handle == 99:
            raise RequestError("invalid", f"no descriptor {req.handle}")
        return {"region": 1}

    def on_flags(self, client_id, req):
        raise RuntimeError("flag allocator exploded")

    def on_stats(self, client_id, req):
        return {"clients": len(self.server.clients)}

    def on_exchange(self, client_id, req):
        # A barrier over two ranks: the first waits (deferred), the second releases both.
        assert self.server is not None
        token = self.server.defer()
        self.waiting.append(token)
        if len(self.waiting) == 2 and not self.hold_exchange:
            for i, t in enumerate(self.waiting):
                self.server.complete(t, {"ranks": 2, "order": i})
            self.waiting.clear()

    def on_leave(self, client_id, req):
        return {}

    def on_client_gone(self, client_id):
        self.gone.append(client_id)


@pytest.fixture
def sock_dir():
    # ipc paths must fit in sun_path (108 bytes); pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="tpd-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Served:
    """A server polled in a thread until closed, the way the daemon's main loop polls it
    (``ControlServer.poll``)."""

    def __init__(self, server: ControlServer, handler: Handler) -> None:
        self.server, self.handler, self.endpoint = server, handler, server.endpoint
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            self.server.poll(10)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive(), "server thread did not stop"
        self.server.close()


@pytest.fixture
def served(sock_dir):
    handler = Handler()
    server = ControlServer(f"ipc://{sock_dir}/control.sock", handler, max_message_bytes=4096, mode=0o600)
    handler.server = server
    s = Served(server, handler)
    yield s
    s.close()


def raw_dealer(endpoint: str, ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 2000
    sock.connect(endpoint)
    return sock


def raw_call(sock: zmq.Socket, *frames: bytes) -> dict:
    sock.send_multipart([b"", *frames])
    empty, payload = sock.recv_multipart()
    assert empty == b""
    return codec.decode(payload, 1 << 20)


# --- good requests ----------------------------------------------------------------------------------------


def test_session_over_ipc(served):
    with ControlConnection(served.endpoint, name="test", **FAST) as conn:
        assert conn.hello_reply == {"version": protocol.V}
        assert conn.session.state is SessionState.READY
        assert conn.request(Join("job", 1, 2, 0)) == {"rank": 1, "world": 2}
        assert conn.request(Register("host", 0, size=4096)) == {"region": 1}
        assert conn.request(Stats()) == {"clients": 1}
        assert conn.session.state is SessionState.JOINED
        conn.request(protocol.Leave())
        assert conn.session.state is SessionState.READY
    info = next(iter(served.server.clients.values()))
    assert info.session.state is SessionState.READY and info.requests == 5 and info.errors == 0


def test_socket_file_gets_the_configured_mode(served, sock_dir):
    st = os.stat(f"{sock_dir}/control.sock")
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_socket_group(sock_dir):
    group = grp.getgrgid(os.getgid()).gr_name
    with ControlServer(f"ipc://{sock_dir}/g.sock", Handler(), group=group, mode=0o660):
        st = os.stat(f"{sock_dir}/g.sock")
        assert st.st_gid == os.getgid() and stat.S_IMODE(st.st_mode) == 0o660
    with pytest.raises(TransportdError, match="group 'no-such-group-tpd' does not exist"):
        ControlServer(f"ipc://{sock_dir}/h.sock", Handler(), group="no-such-group-tpd")


def test_from_config_and_bad_group_is_a_config_error(sock_dir, tmp_path):
    cfg_file = tmp_path / "t.toml"
    cfg_file.write_text(f'[control]\nsocket = "ipc://{sock_dir}/c.sock"\ngroup = "no-such-group-tpd"\n')
    with pytest.raises(ConfigError) as info:
        ControlServer.from_config(load_config(cfg_file, env={}), Handler())
    assert info.value.key == "control.group" and info.value.file == str(cfg_file)
    cfg_file.write_text(f'[control]\nsocket = "ipc://{sock_dir}/c.sock"\nmode = 0o640\n')
    with ControlServer.from_config(load_config(cfg_file, env={}), Handler()) as server:
        assert server.endpoint == f"ipc://{sock_dir}/c.sock"
        assert stat.S_IMODE(os.stat(f"{sock_dir}/c.sock").st_mode) == 0o640
    assert not os.path.exists(f"{sock_dir}/c.sock"), "closing removes the socket file"


def test_a_second_server_does_not_steal_a_live_socket(served):
    with pytest.raises(TransportdError, match="already running"):
        ControlServer(served.endpoint, Handler())
    with ControlConnection(served.endpoint, **FAST) as conn:  # the first one is undisturbed
        conn.request(Stats())


def test_stale_socket_file_is_replaced(sock_dir):
    path = f"{sock_dir}/stale.sock"
    import socket as pysocket

    s = pysocket.socket(pysocket.AF_UNIX)
    s.bind(path)
    s.close()  # leaves a socket file nobody listens on
    handler = Handler()
    served = Served(ControlServer(f"ipc://{path}", handler), handler)
    try:
        with ControlConnection(f"ipc://{path}", **FAST) as conn:
            assert conn.hello_reply["version"] == protocol.V
    finally:
        served.close()


def test_deferred_replies_make_a_barrier(served):
    results = {}

    def rank(r):
        with ControlConnection(served.endpoint, **FAST) as conn:
            conn.request(Join("job", r, 2, 0))
            results[r] = conn.request(Exchange())

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(res["order"] for res in results.values()) == [0, 1]
    assert not served.server.pending


# --- bad input: error replies, and the server keeps serving ---------------------------------------------


GARBAGE = [
    (b"\xc1", "bad_message", "not valid msgpack"),
    (b"", "bad_message", "empty payload"),
    (msgpack.packb([1, 2, 3]), "bad_message", "top level must be a map"),
    (msgpack.packb({"v": 2, "op": "hello"}), "bad_version", "version 2 is not supported"),
    (msgpack.packb({"op": "hello"}), "bad_version", "no protocol version"),
    (msgpack.packb({"v": 1, "op": "fly"}), "unknown_op", "unknown op 'fly'"),
    (msgpack.packb({"v": 1}), "bad_message", "no string 'op'"),
    (msgpack.packb({"v": 1, "op": "hello", "pid": "me"}), "bad_field", "field 'pid': expected integer"),
    (msgpack.packb({"v": 1, "op": "hello", "shoe": 1}), "bad_field", "field 'shoe': unknown field"),
    (msgpack.packb({"v": 1.0, "op": "hello"}), "bad_version", "the integer 1"),
    (msgpack.packb({"v": True, "op": "hello"}), "bad_version", "version True is not supported (bool)"),
    (msgpack.packb({"v": 1, "op": "register", "kind": "host", "handle": "/dev/shm/tpd-host-1-0", "size": 8}),
     "bad_field", "never by path"),
    (msgpack.packb({"v": 1, "op": "join", "job": "j", "rank": 0, "world": 1}), "bad_field",
     "field 'device': missing"),
    (msgpack.packb({"v": 1, "op": "hello", "pad": "x" * 5000}), "too_large", "exceeds the limit of 4096"),
    (msgpack.packb({"v": 1, "op": "hello", "e": msgpack.ExtType(3, b"")}), "bad_message", "ext type 3"),
]


def test_garbage_gets_error_replies_and_the_server_keeps_serving(served):
    ctx = zmq.Context.instance()
    with ControlConnection(served.endpoint, **FAST) as good:
        good.request(Join("job", 0, 1, 0))
        bad = raw_dealer(served.endpoint, ctx)
        try:
            for payload, code, match in GARBAGE:
                reply = raw_call(bad, payload)
                assert reply["v"] == protocol.V and reply["ok"] is False, payload
                assert reply["code"] == code and match in reply["message"], reply
                assert good.request(Stats())["clients"] >= 1  # still serving the good client
            reply = raw_call(bad, b"one", b"two")
            assert reply["code"] == "bad_message" and "expected one payload frame, got 2" in reply["message"]
        finally:
            bad.close()
        assert good.request(Register("host", 0, size=8)) == {"region": 1}


def test_dealer_without_delimiter_is_answered_the_same_way(served):
    sock = raw_dealer(served.endpoint, zmq.Context.instance())
    try:
        sock.send(codec.encode(protocol.Hello().to_msg()))
        assert codec.decode(sock.recv(), 4096) == {"v": 1, "ok": True, "version": 1}
    finally:
        sock.close()


def test_handler_refusals_and_crashes_become_error_replies(served):
    with ControlConnection(served.endpoint, **FAST) as conn:
        conn.request(Join("job", 0, 1, 0))
        with pytest.raises(RequestError, match="no descriptor 99") as info:
            conn.request(Register("host", 99, size=8))
        assert info.value.code == "invalid"
        with pytest.raises(RequestError, match="RuntimeError: flag allocator exploded") as info:
            conn.request(Flags(4))
        assert info.value.code == "internal"
        assert conn.request(Register("host", 0, size=8)) == {"region": 1}
        assert conn.session.state is SessionState.JOINED


def test_order_is_enforced_on_both_sides(served):
    with ControlConnection(served.endpoint, **FAST) as conn:
        with pytest.raises(LocalProtocolError, match="join a job first"):
            conn.request(Register("host", 0, size=8))  # refused before sending
        with pytest.raises(RequestError, match="join a job first") as info:
            conn.request(Register("host", 0, size=8).to_msg())  # a raw map skips the local check
        assert info.value.code == "bad_state"


def test_unsupported_ops_say_so(sock_dir):
    served = Served(ControlServer(f"ipc://{sock_dir}/u.sock", BaseHandler()), Handler())
    try:
        with ControlConnection(served.endpoint, **FAST) as conn:
            with pytest.raises(RequestError, match="does not implement 'join'") as info:
                conn.request(Join("j", 0, 1, 0))
            assert info.value.code == "unsupported"
    finally:
        served.close()


# --- a missing, dead or hung daemon -------------------------------------------------------------------


def test_missing_daemon_is_a_quick_actionable_error(sock_dir):
    endpoint = f"ipc://{sock_dir}/nobody.sock"
    start = time.monotonic()
    with pytest.raises(DaemonUnavailableError) as info:
        ControlConnection(endpoint, handshake_timeout_ms=200)
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert info.value.endpoint == endpoint
    assert f"transportd is not running at {endpoint}" in message
    assert "does not exist" in message and "transportd run" in message and "TRANSPORTD_SOCKET" in message


def test_missing_tcp_daemon(sock_dir):
    with pytest.raises(DaemonUnavailableError, match="not running at tcp://127.0.0.1:1"):
        ControlConnection("tcp://127.0.0.1:1", handshake_timeout_ms=200)


@pytest.mark.parametrize("kind", ["a directory", "a regular file"])
def test_a_socket_path_that_is_no_socket_is_named_as_such(sock_dir, kind):
    """Not "transportd is not running": the path is wrong, and the message says what it is."""
    path = f"{sock_dir}/a-dir" if kind == "a directory" else f"{sock_dir}/a-file"
    os.mkdir(path) if kind == "a directory" else open(path, "w").close()
    with pytest.raises(DaemonUnavailableError) as info:
        ControlConnection(f"ipc://{path}", handshake_timeout_ms=200)
    assert f"{path} is {kind}, not a control socket" in str(info.value) and "not running" not in str(info.value)


def test_a_tcp_listener_that_does_not_answer_hello_is_not_called_not_running():
    """The peer port, or a CURVE control socket used without keys: something listens, nothing answers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(DaemonUnavailableError) as info:
            ControlConnection(endpoint, handshake_timeout_ms=200)
    message = str(info.value)
    assert "not running" not in message and "did not answer" in message
    assert "CURVE" in message and "peer port" in message


def test_the_hint_names_the_parameters_that_exist(sock_dir):
    with pytest.raises(DaemonUnavailableError) as info:
        ControlConnection(f"ipc://{sock_dir}/nobody.sock", handshake_timeout_ms=200)
    assert "socket= to gpuclient.connect" in str(info.value) and "endpoint=" not in str(info.value)


def test_daemon_that_exits_mid_session(sock_dir):
    handler = Handler()
    server = ControlServer(f"ipc://{sock_dir}/d.sock", handler)
    s = Served(server, handler)
    conn = ControlConnection(server.endpoint, **FAST)
    conn.request(Join("j", 0, 1, 0))
    s.close()
    with pytest.raises(DaemonUnavailableError, match="has exited"):
        conn.request(Stats())
    conn.close()
    with pytest.raises(DaemonUnavailableError, match="closed"):
        conn.ensure_alive()


def test_timed_out_request_does_not_wedge_the_connection(served):
    served.handler.hold_exchange = True
    with ControlConnection(served.endpoint, **FAST) as conn:
        conn.request(Join("j", 0, 2, 0))
        with pytest.raises(DaemonTimeoutError, match="no reply to 'exchange' within 0.2 s"):
            conn.request(Exchange(), timeout_ms=200)
        # The daemon is alive (ensure_alive pings it) and the next request gets its own reply.
        assert conn.request(Stats()) == {"clients": 1}


def test_client_liveness_and_expiry(sock_dir):
    now = [100.0]
    handler = Handler()
    dispatcher = ControlDispatcher(handler, clock=lambda: now[0])
    handler.server = dispatcher
    hello = codec.encode(protocol.Hello().to_msg())
    assert dispatcher.handle(b"a", hello)["ok"]
    now[0] = 105.0
    assert dispatcher.handle(b"b", hello)["ok"]
    assert dispatcher.clients[b"a"].last_seen == 100.0 and dispatcher.clients[b"b"].last_seen == 105.0
    now[0] = 111.0
    assert dispatcher.expire(10.0) == [b"a"]
    assert handler.gone == [b"a"] and set(dispatcher.clients) == {b"b"}
    # An expired client starts over: its next request is refused, saying the session is gone, until it says
    # hello again.
    reply = dispatcher.handle(b"a", codec.encode(Stats().to_msg()))
    assert reply["code"] == "no_session" and "join again" in reply["message"]
    assert "session state" not in reply["message"] and "send hello" not in reply["message"]  # no internals


def test_garbage_from_unknown_clients_creates_no_state():
    dispatcher = ControlDispatcher(Handler())
    for payload, _code, _match in GARBAGE:
        assert dispatcher.handle(b"x", payload)["ok"] is False
    assert not dispatcher.clients


def test_resolve_endpoint_precedence(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[control]\nsocket = "ipc:///from/config.sock"\n')
    cfg = load_config(cfg_file, env={})
    env = {"TRANSPORTD_SOCKET": "ipc:///from/env.sock"}
    assert resolve_endpoint("ipc:///explicit.sock", config=cfg, env=env) == "ipc:///explicit.sock"
    assert resolve_endpoint(None, config=cfg, env=env) == "ipc:///from/env.sock"
    assert resolve_endpoint(None, config=cfg, env={}) == "ipc:///from/config.sock"
    assert resolve_endpoint(None, env={}) == "ipc:///run/transportd/control.sock"


# --- CURVE over tcp ---------------------------------------------------------------------------------------


@pytest.fixture
def curve_served(tmp_path):
    _, server_secret = generate_keypair(tmp_path / "server", "server")
    good_public, good_secret = generate_keypair(tmp_path / "good", "good")
    _, bad_secret = generate_keypair(tmp_path / "bad", "bad")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(good_public, authorized / "good.key")
    handler = Handler()
    server = ControlServer("tcp://127.0.0.1:*", handler,
                           curve=CurveServerKeys.from_files(server_secret, authorized))
    handler.server = server
    s = Served(server, handler)
    server_public = tmp_path / "server" / "server.key"
    yield s, CurveClientKeys.from_files(good_secret, server_public), CurveClientKeys.from_files(
        bad_secret, server_public), CurveClientKeys.from_files(good_secret, good_public)
    s.close()


def test_curve_admits_only_authorized_keys(curve_served):
    served, good_keys, bad_keys, wrong_server_keys = curve_served
    assert served.endpoint.startswith("tcp://127.0.0.1:")
    with ControlConnection(served.endpoint, curve=good_keys, **FAST) as good:
        good.request(Join("j", 0, 1, 0))
        with pytest.raises(DaemonUnavailableError, match="no reply to hello"):
            ControlConnection(served.endpoint, curve=bad_keys, handshake_timeout_ms=300)
        with pytest.raises(DaemonUnavailableError):
            ControlConnection(served.endpoint, curve=wrong_server_keys, handshake_timeout_ms=300)
        with pytest.raises(DaemonUnavailableError):
            ControlConnection(served.endpoint, handshake_timeout_ms=300)  # no CURVE at all
        assert good.request(Stats()) == {"clients": 1}  # only the good client ever got through
