"""Daemon ↔ daemon messages (the peer plane): one checked message per op in :data:`PEER_MESSAGES`, the
records nested in them, and :func:`parse_peer_message`, their receive boundary."""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from cmd_ring.limits import MAX_RAILS, MAX_REGIONS
from cmd_ring.protocol.wire import (
    _U24,
    _U64,
    GID_BYTES,
    MAX_EFA_ADDRESS,
    MAX_FLAGS,
    MAX_REGION_BYTES,
    U24,
    U32,
    U64,
    Message,
    Name,
    NameOrEmpty,
    NodeName,
    Opaque,
    Rail,
    Rank,
    Record,
    Text,
    _message,
    _parse,
)

__all__ = [
    "PEER_MESSAGES",
    "PeerBye",
    "PeerConnect",
    "PeerConnectAccept",
    "PeerConnectRequest",
    "PeerDisconnect",
    "PeerHeartbeat",
    "PeerHello",
    "PeerJobLost",
    "PeerMessage",
    "PeerQuiesced",
    "PeerRankLeft",
    "PeerRegions",
    "PeerRestarting",
    "PeerSelftest",
    "PeerSelftestReport",
    "RailQP",
    "RegionInfo",
    "parse_peer_message",
]

PEER_MESSAGES: dict[str, type[Message]] = {}
_peer = _message(PEER_MESSAGES)


# ---------------------------------------------------------------------------------------------------------
# Daemon ↔ daemon messages.


class PeerMessage(Message):
    """Marker base of daemon ↔ daemon messages (one subclass per op in :data:`PEER_MESSAGES`)."""


class RailQP(Record):
    """What a peer needs to connect to one rail: an IB RC QP (``gid`` and/or ``lid``) or an EFA endpoint."""

    _context: ClassVar[str] = "rail"
    rail: Rail
    qpn: Annotated[int, Meta(ge=1, le=_U24)]
    psn: U24 = 0
    gid: bytes = b""  #: GID_BYTES, or empty where the rail has a lid or is EFA
    lid: Annotated[int, Meta(ge=0, le=0xFFFF)] = 0
    efa_address: Annotated[bytes, Meta(max_length=MAX_EFA_ADDRESS)] = b""
    qkey: U32 = 0

    def _check(self) -> None:
        if self.efa_address:
            if self.gid or self.lid:
                self._fail("efa_address", "an EFA rail carries no gid/lid")
        elif self.gid:
            if len(self.gid) != GID_BYTES:
                self._fail("gid", f"must be {GID_BYTES} bytes, got {len(self.gid)}")
        elif not self.lid:
            self._fail("gid", "an IB rail needs a gid or a lid (an EFA rail needs efa_address)")


class RegionInfo(Record):
    """One registered region as peers see it: remote address (an offset for dmabuf MRs), length, rkey."""

    _context: ClassVar[str] = "region"
    id: U32
    addr: U64  #: at most 2**64 - 1 - length: checked with ``length``
    length: Annotated[int, Meta(ge=1, le=MAX_REGION_BYTES)]
    rkey: U32
    rail: Rail = 0

    def _check(self) -> None:
        self._range("addr", 0, _U64 - self.length)


@_peer
class PeerHello(PeerMessage):
    """First message on a peer link: who we are, which backend, how many rails, which life of the daemon.

    ``incarnation`` is the daemon's start time in ns (0: not told). A known node saying hello with a larger
    one has restarted: everything built with its earlier life (connections, responder QPs) is torn down, even
    when it came back before its heartbeats timed out. A smaller one is a late hello of an earlier life.
    """

    op: ClassVar[str] = "peer_hello"
    node: NodeName
    backend: Literal["ib", "efa", "soft"]
    rails: Annotated[int, Meta(ge=1, le=MAX_RAILS)]
    incarnation: U64 = 0


@_peer
class PeerConnect(PeerMessage):
    """QP (or EFA endpoint) information per rail; ``job`` empty for node-wide connections."""

    op: ClassVar[str] = "peer_connect"
    node: NodeName
    rails: tuple[RailQP, ...]
    job: NameOrEmpty = ""

    def _check(self) -> None:
        if not 1 <= len(self.rails) <= MAX_RAILS:
            self._fail("rails", f"must list 1..{MAX_RAILS} rails, got {len(self.rails)}")
        if len({r.rail for r in self.rails}) != len(self.rails):
            self._fail("rails", "lists a rail twice")


class _PeerEndpoint(PeerMessage):
    """One end of connection ``conn`` on ``rail`` for ``job``: the fields both connect messages carry.

    ``endpoint`` is that end as its backend described it (``Backend.create_endpoint``); the protocol
    checks only that it is a small map with string keys — its meaning belongs to the backend.
    """

    job: NameOrEmpty
    rail: Rail
    conn: U64
    endpoint: Opaque


@_peer
class PeerConnectRequest(_PeerEndpoint):
    """Ask the peer to create its end of connection ``conn``; ``endpoint`` is the sender's end.

    This is the form the daemon uses; :class:`PeerConnect` is the typed verbs-level equivalent.
    """

    op: ClassVar[str] = "peer_connect_request"


@_peer
class PeerConnectAccept(_PeerEndpoint):
    """The answer to :class:`PeerConnectRequest`: the accepting side's ``endpoint`` for the same ``conn``."""

    op: ClassVar[str] = "peer_connect_accept"


@_peer
class PeerDisconnect(PeerMessage):
    """The sender closed its end of connection ``conn`` (a job's connection or an IBGDA queue pair): close the
    end accepted for it."""

    op: ClassVar[str] = "peer_disconnect"
    job: NameOrEmpty
    rail: Rail
    conn: U64


@_peer
class PeerRegions(PeerMessage):
    """The regions rank ``rank`` of ``job`` registered on the sending node (replaces earlier announcements).

    ``flag_seeds`` are the nonzero counters of its flag array as they are now (``FLAG_SEED_DTYPE`` records:
    slot, pad, value): a flag array that outlived a daemon restart, so that a sender writing absolute flag
    values (ib write and fence modes) goes on from them rather than from 0.
    """

    op: ClassVar[str] = "peer_regions"
    job: Name
    rank: Rank
    regions: tuple[RegionInfo, ...]
    flag_seeds: Annotated[bytes, Meta(max_length=16 * MAX_FLAGS)] = b""

    def _check(self) -> None:
        if len(self.regions) > MAX_REGIONS:
            self._fail("regions", f"at most {MAX_REGIONS} regions, got {len(self.regions)}")
        if len({(r.id, r.rail) for r in self.regions}) != len(self.regions):
            self._fail("regions", "lists the same (id, rail) twice")
        if len(self.flag_seeds) % 16:
            self._fail("flag_seeds", f"must be 16-byte records, got {len(self.flag_seeds)} bytes")


@_peer
class PeerRankLeft(PeerMessage):
    """Rank ``rank`` of ``job`` on the sending node left (or was reclaimed): forget its regions and flags."""

    op: ClassVar[str] = "peer_rank_left"
    job: Name
    rank: Rank


@_peer
class PeerJobLost(PeerMessage):
    """The sender declared this node lost while ``job`` ran (its heartbeats stopped arriving, though the node
    itself may have noticed nothing) and failed the job's connections to it: the job cannot go on at the
    receiver either."""

    op: ClassVar[str] = "peer_job_lost"
    job: Name


@_peer
class PeerSelftest(PeerMessage):
    """A self-test job of the daemons' own: ``start``, the receiver joins rank 1 of ``job`` (world 2) on
    ``rail`` with its own memory, flags and ring, and echoes every flag it sees back to rank 0 (on the
    sender) with the data it covers; ``finish``, it answers ``peer_selftest_report`` and leaves the job.
    Travels on the peer plane, so it is authenticated (CURVE) like every other peer message."""

    op: ClassVar[str] = "peer_selftest"
    action: Literal["start", "finish"]
    job: Name
    rail: Rail = 0
    seed: U64 = 0


@_peer
class PeerSelftestReport(PeerMessage):
    """What the far side of a self-test saw: ``report`` (rounds, data checked, flags seen early, its
    turnaround per echo), or ``error`` when it could not take part."""

    op: ClassVar[str] = "peer_selftest_report"
    job: Name
    report: Opaque
    error: Text = ""


@_peer
class PeerRestarting(PeerMessage):
    """The sender's daemon is restarting (SIGTERM, ``transportctl restart``): hold every record for its
    ranks, let what is in flight to it complete, answer ``peer_quiesced``, and keep its jobs for
    ``peers.restart_grace_s`` while its next life comes back and its ranks re-announce themselves."""

    op: ClassVar[str] = "peer_restarting"
    node: NodeName


@_peer
class PeerQuiesced(PeerMessage):
    """The answer to ``peer_restarting``: nothing of the sender's is in flight to the restarting node any
    more (its connections there are held and drained), so the restarting node may stop."""

    op: ClassVar[str] = "peer_quiesced"
    node: NodeName


@_peer
class PeerHeartbeat(PeerMessage):
    """Liveness: sequence number and the sender's clock (seconds), for loss and round-trip reports."""

    op: ClassVar[str] = "peer_heartbeat"
    seq: U64
    t: Annotated[float, Meta(ge=0)]


@_peer
class PeerBye(PeerMessage):
    """The sender is shutting down cleanly; tear down without waiting for the heartbeat timeout."""

    op: ClassVar[str] = "peer_bye"
    node: NodeName
    reason: Text = ""


def parse_peer_message(msg: dict[str, Any]) -> PeerMessage:
    """Validate a decoded peer-daemon message into its :class:`PeerMessage`, or raise RemoteProtocolError."""
    return typing.cast(PeerMessage, _parse(msg, PEER_MESSAGES, "peer"))
