"""The sans-IO protocol core: messages, validation at construction and at the receive boundary, replies,
and the session state machine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transportd.control import codec, protocol
from transportd.control.protocol import (
    PEER_MESSAGES,
    REQUESTS,
    TRANSITIONS,
    Channel,
    ChannelClose,
    ChannelConnect,
    ChannelInfo,
    Exchange,
    Flags,
    Heartbeat,
    Hello,
    Inspect,
    Join,
    Leave,
    PeerBye,
    PeerConnect,
    PeerConnectAccept,
    PeerConnectRequest,
    PeerDisconnect,
    PeerHeartbeat,
    PeerHello,
    PeerJobLost,
    PeerQuiesced,
    PeerRankLeft,
    PeerRegions,
    PeerRestarting,
    PeerSelftest,
    PeerSelftestReport,
    QueueEndpoint,
    RailQP,
    RegionInfo,
    Register,
    Restart,
    Selftest,
    SessionRules,
    SessionState,
    Stats,
    TraceStart,
    TraceStop,
    V,
    parse_peer_message,
    parse_reply,
    parse_request,
)
from transportd.errors import LocalProtocolError, ProtocolError, RemoteProtocolError, RequestError

IPC_HANDLE = bytes(range(64))

REQUEST_SAMPLES = [
    Hello(),
    Hello(pid=1234, name="trainer"),
    Hello(pid=1234, name="in-a-container", pid_ns=4026531836),
    Join("llama-70b.run_3", 3, 16, 2),
    Join("cpu", 0, 1, -1),
    Register("cuda_ipc", IPC_HANDLE, size=1 << 20, offset=4096, address=0x7F0000000000, access=("write",)),
    Register("dmabuf", 17, size=4096),
    Register("host", 0, size=64, access=("read", "write", "atomic")),  # the id of a memfd passed by descriptor
    Flags(128),
    Flags(1, "host"),
    Exchange(),
    Channel(4096),
    Channel(256, "ibgda"),
    ChannelInfo(3),
    ChannelConnect(3, (QueueEndpoint(1, 0x1234, 7, 5, "fe80:0000:0000:0000:0000:0000:0000:0001", 1, 5, 16),)),
    ChannelClose(3),
    Stats(),
    Inspect("flags", "job-1", 3),
    Leave(),
    Heartbeat(seq=9),
    Selftest("links"),
    Selftest("start", job="selftest-1a2b", node="node-b", rail=1, seed=7),
    Selftest("status", job="selftest-1a2b"),
    TraceStart("job-1", 3, out="/tmp/rank3.trace"),
    TraceStop("job-1", 3),
    Restart(),
    Join("job-1", 1, 2, -1, resume=True),
    Register("host", 4, size=64, id=7),  # a session re-attaching keeps its region id
    Flags(64, "host", adopt=5),
    Channel(256, adopt=6, id=3),
]

PEER_SAMPLES = [
    PeerHello("node-a", "ib", 4),
    PeerHello("node-a", "ib", 4, incarnation=(1 << 64) - 1),
    PeerConnect("node-a", (RailQP(0, 0x123, 77, gid=b"\xfe" * 16), RailQP(1, 0x456, lid=12)), job="j1"),
    PeerConnect("node-b", (RailQP(0, 9, efa_address=b"\x01" * 16, qkey=0x11111111),)),
    PeerConnectRequest("j1", 1, 7, {"qpn": 0x123, "gid": b"\xfe" * 16, "psn": 5, "extra": [1, 2]}),
    PeerConnectAccept("", 0, 7, {"host": "10.0.0.2", "port": 18600}),
    PeerDisconnect("j1", 1, 7),
    PeerRankLeft("j1", 3),
    PeerJobLost("j1"),
    PeerSelftest("start", "selftest-1a2b", rail=1, seed=(1 << 64) - 1),
    PeerSelftest("finish", "selftest-1a2b"),
    PeerSelftestReport("selftest-1a2b", {"echoes": 3, "turnaround_us": [1.5, 2.0]}),
    PeerSelftestReport("selftest-1a2b", {}, error="no rail 3 here"),
    PeerRegions("j1", 5, (RegionInfo(0, 0, 1 << 20, 0xABC), RegionInfo(0, 0, 1 << 20, 0xDEF, rail=1))),
    PeerRegions("j1", 0, ()),
    PeerHeartbeat(42, 1712345678.25),
    PeerBye("node-a", "shutdown"),
    PeerRestarting("node-a"),
    PeerQuiesced("node-b"),
]


def wire(msg: dict) -> dict:
    """What the other side sees: through the codec and back."""
    return codec.decode(codec.encode(msg), 1 << 20)


def test_every_op_has_a_sample():
    assert {type(r).op for r in REQUEST_SAMPLES} == set(REQUESTS)
    assert {type(m).op for m in PEER_SAMPLES} == set(PEER_MESSAGES)


@pytest.mark.parametrize("req", REQUEST_SAMPLES, ids=repr)
def test_requests_round_trip(req):
    msg = req.to_msg()
    assert msg["v"] == V and msg["op"] == req.op
    assert parse_request(wire(msg)) == req


@pytest.mark.parametrize("msg", PEER_SAMPLES, ids=repr)
def test_peer_messages_round_trip(msg):
    assert parse_peer_message(wire(msg.to_msg())) == msg


def test_messages_are_frozen_and_normalised():
    reg = Register("host", 1, size=8, access=["read"])
    assert reg.access == ("read",)
    with pytest.raises(AttributeError, match="immutable"):  # msgspec's frozen Struct
        reg.size = 9  # type: ignore[misc]
    connect = PeerConnect("n", [{"rail": 0, "qpn": 1, "lid": 3}])
    assert connect.rails == (RailQP(0, 1, lid=3),)


def test_peer_and_client_planes_do_not_mix():
    with pytest.raises(RemoteProtocolError, match="unknown op 'peer_hello'"):
        parse_request(PeerHello("n", "soft", 1).to_msg())
    with pytest.raises(RemoteProtocolError, match="unknown op 'join'"):
        parse_peer_message(Join("j", 0, 1, 0).to_msg())


# --- the receive boundary: every failure names what is wrong --------------------------------------------

GOOD_JOIN = {"v": 1, "op": "join", "job": "j", "rank": 0, "world": 2, "device": 0}


@pytest.mark.parametrize(
    ("change", "code", "field", "match"),
    [
        ({"v": 2}, "bad_version", "v", "protocol version 2 is not supported"),
        ({"v": None}, "bad_version", "v", "version None"),
        ({"v": True}, "bad_version", "v", "version True"),
        ({"v": "1"}, "bad_version", "v", "version '1'"),
        ({"v": 1.0}, "bad_version", "v", r"version 1.0 is not supported \(number\): this side speaks v1, the integer"),
        ({"v": True}, "bad_version", "v", r"version True is not supported \(bool\)"),
        ({"op": "teleport"}, "unknown_op", "op", "unknown op 'teleport'; known: channel"),
        ({"op": 3}, "bad_message", "op", "no string 'op'"),
        ({"rank": "0"}, "bad_field", "rank", "join: field 'rank': expected integer, got string"),
        ({"rank": True}, "bad_field", "rank", "expected integer, got bool"),
        ({"rank": 1.0}, "bad_field", "rank", "expected integer, got number"),
        ({"rank": 2}, "bad_field", "rank", r"must be in \[0, 1\], got 2"),
        ({"rank": -1}, "bad_field", "rank", r"must be in \[0, 1\]"),
        ({"world": 0}, "bad_field", "world", r"must be in \[1, "),
        ({"device": 64}, "bad_field", "device", r"must be in \[-1, 63\]"),
        ({"job": ""}, "bad_field", "job", "length must be 1..64"),
        ({"job": "x" * 65}, "bad_field", "job", "length must be 1..64"),
        ({"job": "a b"}, "bad_field", "job", "may hold only letters"),
        ({"job": "-lead"}, "bad_field", "job", "must start with a letter or digit"),
        ({"job": ["j"]}, "bad_field", "job", "expected string, got array"),
        ({"colour": "red"}, "bad_field", "colour", "join: field 'colour': unknown field"),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(change, code, field, match):
    msg = {**GOOD_JOIN, **change}
    with pytest.raises(RemoteProtocolError, match=match) as info:
        parse_request(msg)
    assert (info.value.code, info.value.field) == (code, field)


@pytest.mark.parametrize("missing", ["v", "op", "job", "rank", "world", "device"])
def test_missing_fields_are_named(missing):
    msg = {k: v for k, v in GOOD_JOIN.items() if k != missing}
    with pytest.raises(RemoteProtocolError) as info:
        parse_request(msg)
    assert info.value.field == missing
    if missing not in ("v", "op"):
        assert str(info.value) == f"join: field '{missing}': missing"


def test_non_map_message_is_refused():
    with pytest.raises(RemoteProtocolError, match="must be a map, got array"):
        parse_request([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "field", "match"),
    [
        ({"kind": "cuda_ipc", "handle": b"short", "size": 8}, "handle", "64 bytes of CUipcMemHandle"),
        ({"kind": "cuda_ipc", "handle": 5, "size": 8}, "handle", "64 bytes"),
        ({"kind": "dmabuf", "handle": -1, "size": 8}, "handle", "id of a descriptor passed on the descriptor socket"),
        ({"kind": "dmabuf", "handle": "fd", "size": 8}, "handle", "by descriptor, never by path"),
        ({"kind": "host", "handle": "relative/path", "size": 8}, "handle", "by descriptor, never by path"),
        ({"kind": "host", "handle": "/dev/shm/tpd-ring-nodea-job-0-1-77", "size": 8}, "handle",
         "never by path: pass the memory's fd on the descriptor socket"),
        ({"kind": "host", "handle": b"/dev/shm/x", "size": 8}, "handle", "id of a descriptor"),
        ({"kind": "host", "handle": True, "size": 8}, "handle", "expected bytes or integer or string, got bool"),
        ({"kind": "gpu", "handle": 0, "size": 8}, "kind", "must be one of 'host', 'cuda_ipc', 'dmabuf'"),
        ({"kind": "host", "handle": 0, "size": 0}, "size", r"must be in \[1, "),
        ({"kind": "host", "handle": 0, "size": (1 << 40) + 1}, "size", r"must be in \[1, "),
        ({"kind": "host", "handle": 0, "size": 8, "offset": -1}, "offset", "must be in"),
        ({"kind": "host", "handle": 0, "size": 8, "offset": 2**64 - 4}, "offset", "must be in"),
        ({"kind": "host", "handle": 0, "size": 8, "access": []}, "access", "at least one"),
        ({"kind": "host", "handle": 0, "size": 8, "access": ["exec"]}, "access[0]", "must be one of"),
        ({"kind": "host", "handle": 0, "size": 8, "access": ["read", "read"]}, "access", "twice"),
        ({"kind": "host", "handle": 0, "size": 8, "access": "read"}, "access", "expected array"),
    ],
)
def test_register_validation(fields, field, match):
    with pytest.raises(RemoteProtocolError, match=match) as info:
        parse_request({"v": 1, "op": "register", **fields})
    assert info.value.field == field
    with pytest.raises(LocalProtocolError, match=match):  # the same rule when building one locally
        Register(**fields)


@pytest.mark.parametrize(
    ("req", "field", "match"),
    [
        (lambda: Flags(0), "count", "must be in"),
        (lambda: Flags(8, "gpu"), "where", "must be one of 'host', 'device'"),
        (lambda: Channel(100), "capacity", "power of two"),
        (lambda: Channel(4), "capacity", "must be in"),
        (lambda: Channel(1 << 16, "ibgda"), "capacity", "must be in"),
        (lambda: Channel(256, "dma"), "kind", "ring"),
        (lambda: ChannelInfo(0), "channel", "must be in"),
        (lambda: Channel(1 << 21), "capacity", "must be in"),
        (lambda: Hello(pid=-5), "pid", "must be in"),
        (lambda: Hello(pid=5, pid_ns=-1), "pid_ns", "must be in"),
        (lambda: Hello(pid=5, pid_ns=1 << 64), "pid_ns", "must be in"),
        (lambda: Heartbeat(seq=-1), "seq", "must be in"),
        (lambda: Inspect("queues", "j", 0), "what", "must be one of 'flags'"),
        (lambda: Inspect("flags", "j", -1), "rank", "must be in"),
    ],
)
def test_local_construction_is_validated(req, field, match):
    with pytest.raises(LocalProtocolError, match=match) as info:
        req()
    assert info.value.field == field


@pytest.mark.parametrize(
    ("msg", "field", "match"),
    [
        ({"op": "peer_hello", "node": "n", "backend": "tcp", "rails": 1}, "backend", "one of 'ib'"),
        ({"op": "peer_hello", "node": "n", "backend": "ib", "rails": 0}, "rails", "must be in"),
        ({"op": "peer_hello", "node": "n", "backend": "ib", "rails": 1, "incarnation": -1}, "incarnation",
         "must be in"),
        ({"op": "peer_hello", "node": "n", "backend": "ib", "rails": 1, "incarnation": 1 << 64}, "incarnation",
         "must be in"),
        ({"op": "peer_hello", "node": "n", "backend": "ib", "rails": 1, "incarnation": "x"}, "incarnation",
         "expected integer"),
        ({"op": "peer_connect", "node": "n", "rails": []}, "rails", "1..16 rails"),
        ({"op": "peer_connect", "node": "n", "rails": [{"rail": 0, "qpn": 1}]}, "rails[0].gid", "needs a gid"),
        ({"op": "peer_connect", "node": "n", "rails": [{"rail": 0, "qpn": 1, "gid": b"x"}]}, "rails[0].gid",
         "16 bytes"),
        ({"op": "peer_connect", "node": "n", "rails": [{"rail": 0, "qpn": 0, "lid": 1}]}, "rails[0].qpn",
         "must be in"),
        ({"op": "peer_connect", "node": "n", "rails": [{"rail": 0, "qpn": 1, "lid": 1, "x": 1}]}, "rails[0].x",
         "unknown field"),
        ({"op": "peer_connect", "node": "n", "rails": [7]}, "rails[0]", "expected map, got integer"),
        ({"op": "peer_connect", "node": "n",
          "rails": [{"rail": 0, "qpn": 1, "lid": 1}, {"rail": 0, "qpn": 2, "lid": 1}]}, "rails", "twice"),
        ({"op": "peer_connect", "node": "n", "rails": [{"rail": 0, "qpn": 1, "lid": 1, "efa_address": b"a"}]},
         "rails[0].efa_address", "no gid/lid"),
        ({"op": "peer_regions", "job": "j", "rank": 0, "regions": [{"id": 1, "addr": 0, "length": 0, "rkey": 1}]},
         "regions[0].length", "must be in"),
        ({"op": "peer_regions", "job": "j", "rank": 0, "regions": [{"id": 1, "addr": 0, "length": 1}]},
         "regions[0].rkey", "missing"),
        ({"op": "peer_regions", "job": "j", "rank": 0,
          "regions": [{"id": 1, "addr": 0, "length": 1, "rkey": 1}] * 2}, "regions", "same \\(id, rail\\) twice"),
        ({"op": "peer_connect_request", "job": "j", "rail": 0, "conn": 1, "endpoint": [1]}, "endpoint",
         "expected map, got array"),
        ({"op": "peer_connect_accept", "job": "j", "rail": 0, "conn": -1, "endpoint": {}}, "conn", "must be in"),
        ({"op": "peer_connect_accept", "job": "j", "rail": 0, "conn": 1, "endpoint": {str(i): i for i in range(65)}},
         "endpoint", "at most 64 keys"),
        ({"op": "peer_disconnect", "job": "j", "rail": 16, "conn": 1}, "rail", "must be in"),
        ({"op": "peer_disconnect", "job": "j", "rail": 0}, "conn", "missing"),
        ({"op": "peer_rank_left", "job": "", "rank": 1}, "job", "length must be"),
        ({"op": "peer_rank_left", "job": "j", "rank": -1}, "rank", "must be in"),
        ({"op": "peer_rank_left", "job": "j"}, "rank", "missing"),
        ({"op": "peer_job_lost"}, "job", "missing"),
        ({"op": "peer_job_lost", "job": "has space"}, "job", "may hold only"),
        ({"op": "peer_heartbeat", "seq": 1, "t": float("inf")}, "t", "finite"),
        ({"op": "peer_heartbeat", "seq": 1, "t": "now"}, "t", "expected number"),
        ({"op": "peer_bye", "node": "bad node"}, "node", "may hold only"),
    ],
)
def test_bad_peer_messages_name_the_nested_field(msg, field, match):
    with pytest.raises(RemoteProtocolError, match=match) as info:
        parse_peer_message({"v": 1, **msg})
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)


# --- replies ---------------------------------------------------------------------------------------------


def test_reply_helpers():
    assert protocol.ok(rank=3) == {"v": V, "ok": True, "rank": 3}
    assert protocol.error("bad_state", "join first") == {"v": V, "ok": False, "code": "bad_state",
                                                         "message": "join first"}
    with pytest.raises(LocalProtocolError, match="reserved"):
        protocol.ok(code="x")


def test_parse_reply():
    assert parse_reply(wire(protocol.ok(a=1))) == {"a": 1}
    with pytest.raises(RequestError) as info:
        parse_reply(wire(protocol.error("invalid", "handle does not open")))
    assert (info.value.code, info.value.message) == ("invalid", "handle does not open")
    for bad in ({"v": 2, "ok": True}, {"v": 1}, {"v": 1, "ok": False}, {"v": 1, "ok": "yes"}):
        with pytest.raises(RemoteProtocolError):
            parse_reply(bad)


def test_error_reply_for_maps_exceptions_to_stable_codes():
    assert protocol.error_reply_for(RequestError("limit", "too many rings"))["code"] == "limit"
    assert protocol.error_reply_for(RemoteProtocolError("x", code="too_large"))["code"] == "too_large"
    internal = protocol.error_reply_for(KeyError("boom"))
    assert internal["code"] == "internal" and "KeyError" in internal["message"]


# --- the session state machine ---------------------------------------------------------------------------


def test_transition_table_covers_every_state_and_only_known_ops():
    assert set(TRANSITIONS) == set(SessionState)
    for row in TRANSITIONS.values():
        assert set(row) <= set(REQUESTS)
        assert "heartbeat" in row


@pytest.mark.parametrize("op", ["register", "flags", "channel", "exchange", "join", "leave", "stats"])
def test_nothing_but_hello_before_hello(op):
    with pytest.raises(LocalProtocolError, match="send hello first") as info:
        SessionRules().check(op)
    assert info.value.code == "bad_state"


@pytest.mark.parametrize("op", ["register", "flags", "channel", "exchange", "leave"])
def test_memory_ops_need_a_join(op):
    session = SessionRules(SessionState.READY)
    with pytest.raises(LocalProtocolError, match="join a job first"):
        session.check(op)
    assert session.refuse_reason(op) is not None


def test_full_session_walk():
    session = SessionRules()
    for op, state in [("hello", SessionState.READY), ("stats", SessionState.READY), ("join", SessionState.JOINED),
                      ("register", SessionState.JOINED), ("flags", SessionState.JOINED),
                      ("channel", SessionState.JOINED), ("exchange", SessionState.JOINED),
                      ("heartbeat", SessionState.JOINED), ("inspect", SessionState.JOINED),
                      ("leave", SessionState.READY), ("inspect", SessionState.READY),
                      ("join", SessionState.JOINED)]:
        session.check(op)
        session.advance(op)
        assert session.state is state, op
    with pytest.raises(LocalProtocolError, match="not allowed in session state 'joined'"):
        session.check("hello")


class _CoreServer:
    """Just enough of a server to drive the core with a client: decode, parse, state check, reply."""

    def __init__(self) -> None:
        self.session = SessionRules()

    def receive(self, payload: bytes) -> bytes:
        try:
            req = parse_request(codec.decode(payload, 4096))
            reason = self.session.refuse_reason(req.op)
            if reason is not None:
                raise RequestError("bad_state", reason)
            self.session.advance(req.op)
            reply = protocol.ok(op=req.op)
        except (ProtocolError, RequestError) as exc:
            reply = protocol.error_reply_for(exc)
        return codec.encode(reply)


def test_client_server_pair_through_the_core():
    client, server = SessionRules(), _CoreServer()

    def call(req):
        client.check(req.op)
        fields = parse_reply(codec.decode(server.receive(codec.encode(req.to_msg())), 4096))
        client.advance(req.op)
        return fields

    assert call(Hello(pid=1)) == {"op": "hello"}
    assert call(Join("j", 0, 1, 0)) == {"op": "join"}
    assert call(Register("host", 0, size=64)) == {"op": "register"}
    assert client.state is server.session.state is SessionState.JOINED
    # A client that skips its own check meets the same rule on the server.
    fresh = _CoreServer()
    with pytest.raises(RequestError, match="send hello first") as info:
        parse_reply(codec.decode(fresh.receive(codec.encode(Flags(4).to_msg())), 4096))
    assert info.value.code == "bad_state"
    # Garbage gets a reply, not an exception, and the server's state is unchanged.
    for garbage in (b"\xc1", codec.encode({"v": 1, "op": "nope"}), codec.encode({"v": 9, "op": "hello"})):
        with pytest.raises(RequestError):
            parse_reply(codec.decode(server.receive(garbage), 4096))
    assert server.session.state is SessionState.JOINED


# --- fuzz: whatever a decoded map holds, the boundary answers with RemoteProtocolError or a valid message ---

_FIELD_NAMES = sorted({name for cls in [*REQUESTS.values(), *PEER_MESSAGES.values()]
                       for name in cls.__struct_fields__} | {"v", "op"})
_OPS = sorted(REQUESTS) + sorted(PEER_MESSAGES)
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**65) | st.floats() | st.text(max_size=70)
    | st.binary(max_size=70) | st.sampled_from(_OPS) | st.just(1),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(_FIELD_NAMES), children,
                                                                      max_size=4),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(_OPS), st.dictionaries(st.sampled_from(_FIELD_NAMES), _values, max_size=7))
def test_parse_never_fails_any_other_way(op, fields):
    msg = {"v": 1, "op": op, **fields}
    for parse in (parse_request, parse_peer_message):
        try:
            parsed = parse(msg)
        except RemoteProtocolError as exc:
            assert exc.code and str(exc)
        else:
            again = codec.encode(parse(parsed.to_msg()).to_msg())  # bytes: NaN in an opaque map compares equal
            assert again == codec.encode(parsed.to_msg())


def test_descriptor_socket_messages_carry_exactly_their_descriptors():
    token = bytes(range(protocol.TOKEN_BYTES))
    assert protocol.parse_side_message(wire(protocol.Vouch(token=token).to_msg())) == protocol.Vouch(token=token)
    assert protocol.parse_side_message(wire(protocol.PassFd().to_msg()), fds=1) == protocol.PassFd("memfd")
    with pytest.raises(RemoteProtocolError, match="pass_fd carries 1 descriptor"):
        protocol.parse_side_message(wire(protocol.PassFd().to_msg()), fds=0)
    with pytest.raises(RemoteProtocolError, match="vouch carries 0 descriptor"):
        protocol.parse_side_message(wire(protocol.Vouch(token=token).to_msg()), fds=2)
    with pytest.raises(RemoteProtocolError, match="must be 16 bytes"):
        protocol.parse_side_message({"v": 1, "op": "vouch", "token": b"short"})
    with pytest.raises(RemoteProtocolError, match="unknown op 'register'"):  # the planes do not mix
        protocol.parse_side_message(wire(Register("host", 0, size=8).to_msg()))
    with pytest.raises(RemoteProtocolError, match="version 1.0"):
        protocol.parse_side_message({"v": 1.0, "op": "pass_fd"}, fds=1)
