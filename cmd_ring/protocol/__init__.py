"""The control and peer protocols, with no I/O (the zmq shells live in ``server.py``, ``client.py`` and ``peers.py``).

The protocol lives in one module per plane, and this module re-exports it all (import from here): the
shared mechanism, version and reply codes in ``wire``; the client's requests in ``client_messages``, the
descriptor socket's in ``side_messages``, the peers' in ``peer_messages``; ``replies``; the client
session's state machine in ``session``.

A message on the wire is a msgpack map ``{"v": V, "op": <name>, <field>: <value>, ...}``. Each op is a
msgspec Struct here whose annotations carry each field's limits (``Annotated[int, Meta(ge=..., le=...)]``,
name lengths and charsets); :mod:`cmd_ring.schema` checks them, on construction and at the receive
boundary alike (lists become tuples, nested maps become records), and each class's ``_check`` adds the
rules across fields. Building a bad message raises :class:`LocalProtocolError`; :func:`parse_request` and
:func:`parse_peer_message`, the receive boundary, turn the same failure into :class:`RemoteProtocolError`
naming the field. Replies are ``{"v": V, "ok": true, ...}`` or ``{"v": V, "ok": false, "code", "message"}``.

Local clients (one session per client socket) speak ``hello`` → ``join`` → ``register`` / ``flags`` /
``channel`` / ``exchange`` … → ``leave``; :data:`TRANSITIONS` is the whole state machine, used by the
client before sending and by the server before dispatching. Peer daemons speak the ``peer_*`` ops.
"""

from __future__ import annotations

from cmd_ring.limits import (
    MAX_CHANNEL_CAPACITY,
    MAX_RAILS,
    MAX_REGIONS,
    MAX_WORLD,
    MIN_CHANNEL_CAPACITY,
)
from cmd_ring.protocol.client_messages import (
    REQUESTS,
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
    QueueEndpoint,
    Register,
    Request,
    Restart,
    Selftest,
    Stats,
    TraceStart,
    TraceStop,
    parse_request,
)
from cmd_ring.protocol.peer_messages import (
    PEER_MESSAGES,
    PeerBye,
    PeerConnect,
    PeerConnectAccept,
    PeerConnectRequest,
    PeerDisconnect,
    PeerHeartbeat,
    PeerHello,
    PeerJobLost,
    PeerMessage,
    PeerQuiesced,
    PeerRankLeft,
    PeerRegions,
    PeerRestarting,
    PeerSelftest,
    PeerSelftestReport,
    RailQP,
    RegionInfo,
    parse_peer_message,
)
from cmd_ring.protocol.replies import (
    error,
    error_reply_for,
    ok,
    parse_reply,
)
from cmd_ring.protocol.session import (
    TRANSITIONS,
    SessionRules,
    SessionState,
    next_state,
)
from cmd_ring.protocol.side_messages import (
    SIDE_MESSAGES,
    PassFd,
    SideMessage,
    TakeFd,
    Vouch,
    parse_side_message,
)
from cmd_ring.protocol.wire import (
    CUDA_IPC_HANDLE_BYTES,
    MAX_FD_ID,
    MAX_FLAGS,
    MAX_NAME_LEN,
    MAX_OPAQUE_KEYS,
    MAX_REGION_BYTES,
    TOKEN_BYTES,
    Message,
    Record,
    ReplyCode,
    V,
)

__all__ = [
    "CUDA_IPC_HANDLE_BYTES",
    "MAX_FD_ID",
    "MAX_FLAGS",
    "MAX_NAME_LEN",
    "MAX_OPAQUE_KEYS",
    "MAX_RAILS",
    "MAX_REGIONS",
    "MAX_REGION_BYTES",
    "MAX_WORLD",
    "MAX_CHANNEL_CAPACITY",
    "MIN_CHANNEL_CAPACITY",
    "REQUESTS",
    "SIDE_MESSAGES",
    "PEER_MESSAGES",
    "TRANSITIONS",
    "TOKEN_BYTES",
    "V",
    "Channel",
    "ChannelClose",
    "ChannelConnect",
    "ChannelInfo",
    "Exchange",
    "Flags",
    "Heartbeat",
    "Hello",
    "Inspect",
    "Join",
    "Leave",
    "Message",
    "PassFd",
    "PeerBye",
    "PeerConnect",
    "PeerConnectAccept",
    "PeerConnectRequest",
    "PeerDisconnect",
    "PeerHeartbeat",
    "PeerHello",
    "PeerJobLost",
    "PeerMessage",
    "PeerRankLeft",
    "PeerQuiesced",
    "PeerRegions",
    "PeerRestarting",
    "PeerSelftest",
    "PeerSelftestReport",
    "QueueEndpoint",
    "RailQP",
    "Record",
    "RegionInfo",
    "Register",
    "Restart",
    "Selftest",
    "ReplyCode",
    "Request",
    "SessionRules",
    "SessionState",
    "SideMessage",
    "Stats",
    "TakeFd",
    "TraceStart",
    "TraceStop",
    "Vouch",
    "error",
    "error_reply_for",
    "next_state",
    "ok",
    "parse_peer_message",
    "parse_reply",
    "parse_request",
    "parse_side_message",
]
