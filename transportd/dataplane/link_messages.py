"""The messages of the worker link (:mod:`transportd.dataplane.worker_link`): what the daemon's main process
asks a rail worker, and the replies that have a fixed shape.

Each request is a msgspec Struct in one tagged union (``op`` names the class, in snake case: ``MapRegion``
travels as ``{"op": "map_region", ...}``); the worker decodes it with a typed decoder over the union it
serves, so a malformed or unknown request is refused with the field or the op named, and dispatches on its
type. ``reply`` names the type the reply decodes to in the main process (``dict[str, Any]`` for the free-form
reports: stats, a trace's summary); ``fds`` how many descriptors travel with the request on the link's
descriptor socket (``SCM_RIGHTS``), checked on arrival.

The link is private to one daemon (a socket in a private directory, both ends the same build), so these are
plain typed Structs; the client, peer and descriptor-socket messages, which cross a trust boundary, are
:mod:`transportd.control.protocol`'s checked Records.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

__all__ = [
    "AddChannel",
    "BindPeer",
    "BrokenConnections",
    "CloseConnection",
    "CloseIbgdaDomain",
    "Closed",
    "Conns",
    "Connect",
    "ConnectionsIdle",
    "CreateEndpoint",
    "Done",
    "Endpoint",
    "FailConnection",
    "ForgetPeer",
    "ForgetRank",
    "GpuFlagsKey",
    "HoldConnection",
    "IbgdaDomain",
    "Idle",
    "LinkRequest",
    "MapFlags",
    "MapGpuFlags",
    "MapGpuRegion",
    "MapRegion",
    "RAIL_REQUESTS",
    "RegionKey",
    "RemoveChannel",
    "RetireConnection",
    "SetRemoteFlags",
    "SetRemoteRegion",
    "SetSourceRegion",
    "Stats",
    "Stop",
    "Stopped",
    "TraceStart",
    "TraceStarted",
    "TraceStop",
    "UnmapFlags",
    "UnmapRegion",
    "op_name",
]

U64 = Annotated[int, Meta(ge=0)]
U32 = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]


def op_name(class_name: str) -> str:
    """A request class's ``op`` on the wire: ``MapGpuFlags`` -> ``map_gpu_flags``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()


class LinkRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="op",
                  tag=op_name):
    """Base of every worker-link request (one subclass per op)."""

    reply: ClassVar[Any]  # the type its reply decodes to
    fds: ClassVar[int] = 0  # descriptors sent with it

    @property
    def op(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]


# --- replies with a fixed shape --------------------------------------------------------------------------
class Done(msgspec.Struct, frozen=True):
    """The reply of a request that returns nothing but success."""


class RegionKey(msgspec.Struct, frozen=True):
    """A registration on a rail: where it is and the keys the NIC knows it by."""

    addr: U64
    length: U64
    lkey: U32
    rkey: U32

    def as_dict(self) -> dict[str, int]:
        """The plain map the daemon keeps per rail and hands to peers."""
        return {"addr": self.addr, "length": self.length, "lkey": self.lkey, "rkey": self.rkey}


class GpuFlagsKey(RegionKey, frozen=True):
    """A rank's GPU flag words registered on a rail, and how that rail publishes into them."""

    publication: str

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "publication": self.publication}


class Endpoint(msgspec.Struct, frozen=True):
    """What the far end of a connection needs to connect to it (backend-defined: QPN, GID, EFA address)."""

    endpoint: dict[str, Any]


class Closed(msgspec.Struct, frozen=True):
    """A closed connection: the payload bytes posted on it (the daemon keeps them per peer node)."""

    sent: U64


class Conns(msgspec.Struct, frozen=True):
    conns: list[int]


class Idle(msgspec.Struct, frozen=True):
    idle: bool


class TraceStarted(msgspec.Struct, frozen=True):
    channels: list[int]  # the channels traced from now on


class IbgdaDomain(msgspec.Struct, frozen=True):
    """A rank's IBGDA domain on a rail: the grant, each region's key there, and (``with_fd``) the command
    descriptor: sent by the worker (which closes its own), owned by the caller once it arrives."""

    grant: dict[str, Any]
    regions: dict[str, dict[str, Any]]
    fds: list[int] = msgspec.field(default_factory=list)


class Stopped(msgspec.Struct, frozen=True):
    drained: bool  # every record committed before the stop was posted and completed


# --- memory ------------------------------------------------------------------------------------------------
class MapRegion(LinkRequest, frozen=True):
    """Map the client's memfd (by descriptor, never by path) and register ``[offset, offset + size)`` of it."""

    reply = RegionKey
    fds = 1
    key: str
    offset: U64
    size: U64
    remote_write: bool
    remote_atomic: bool
    remote_read: bool = True


class UnmapRegion(LinkRequest, frozen=True):
    reply = Done
    key: str


class MapGpuRegion(LinkRequest, frozen=True):
    """Open a client's GPU buffer by CUDA IPC handle and register it."""

    reply = RegionKey
    key: str
    handle: bytes
    offset: U64
    size: U64
    device: U32
    remote_write: bool
    remote_atomic: bool
    remote_read: bool = True


class MapFlags(LinkRequest, frozen=True):
    """Map a rank's host flag array (the daemon's memfd, by descriptor) for remote atomics."""

    reply = RegionKey
    fds = 1
    job: str
    rank: U32
    count: U64


class UnmapFlags(LinkRequest, frozen=True):
    reply = Done
    job: str
    rank: U32


class MapGpuFlags(LinkRequest, frozen=True):
    """A rank's flag words in GPU memory; the descriptor is its host flag file, the counters' shadow."""

    reply = GpuFlagsKey
    fds = 1
    job: str
    rank: U32
    handle: bytes
    offset: U64
    count: U64
    device: U32


# --- tables ------------------------------------------------------------------------------------------------
class SetSourceRegion(LinkRequest, frozen=True):
    reply = Done
    job: str
    rank: U32
    region: U32
    key: str


class AddChannel(LinkRequest, frozen=True):
    """Drain the ring the daemon made (a memfd, by descriptor)."""

    reply = Done
    fds = 1
    channel: U32
    job: str
    rank: U32
    world: U32


class RemoveChannel(LinkRequest, frozen=True):
    reply = Done
    channel: U32


class ForgetRank(LinkRequest, frozen=True):
    reply = Done
    job: str
    rank: U32


class SetRemoteRegion(LinkRequest, frozen=True):
    reply = Done
    job: str
    peer: U32
    region: U32
    addr: U64
    length: U64
    rkey: U32


class SetRemoteFlags(LinkRequest, frozen=True):
    """A peer's flag array; ``seeds``: the counters it holds already (a restart kept them)."""

    reply = Done
    job: str
    peer: U32
    addr: U64
    count: U64
    rkey: U32
    seeds: bytes = b""


class BindPeer(LinkRequest, frozen=True):
    reply = Done
    job: str
    peer: U32
    conn: U32


class ForgetPeer(LinkRequest, frozen=True):
    reply = Done
    job: str
    peer: U32


# --- trace record (docs/trace.md) ----------------------------------------------------------------------------
class TraceStart(LinkRequest, frozen=True):
    reply = TraceStarted
    job: str
    rank: U32
    prefix: str


class TraceStop(LinkRequest, frozen=True):
    reply = dict[str, Any]  # part files, counts and replay context (Proxy.trace_stop)
    job: str
    rank: U32


# --- connections -------------------------------------------------------------------------------------------
class CreateEndpoint(LinkRequest, frozen=True):
    reply = Endpoint
    conn: U32
    job: str
    responder: bool = False


class Connect(LinkRequest, frozen=True):
    reply = Done
    conn: U32
    remote: dict[str, Any]


class CloseConnection(LinkRequest, frozen=True):
    reply = Closed
    conn: U32


class FailConnection(LinkRequest, frozen=True):
    reply = Done
    conn: U32
    code: U32


class HoldConnection(LinkRequest, frozen=True):
    reply = Done
    conn: U32
    on: bool = True


class RetireConnection(LinkRequest, frozen=True):
    reply = Done
    conn: U32
    code: U32


class BrokenConnections(LinkRequest, frozen=True):
    reply = Conns


class ConnectionsIdle(LinkRequest, frozen=True):
    reply = Idle
    conns: list[U32]


# --- IBGDA domains ------------------------------------------------------------------------------------------
class OpenIbgdaDomain(LinkRequest, frozen=True):
    reply = IbgdaDomain
    job: str
    rank: U32
    regions: list[str]
    with_fd: bool = False


class CloseIbgdaDomain(LinkRequest, frozen=True):
    reply = Done
    job: str
    rank: U32


# --- reporting and shutdown -----------------------------------------------------------------------------------
class Stats(LinkRequest, frozen=True):
    reply = dict[str, Any]  # the rail's report (``transportctl stats``), free-form by design


class Stop(LinkRequest, frozen=True):
    """Drain, then exit: every worker serves it (``WorkerHandle.stop`` sends it)."""

    reply = Stopped


#: every request a rail worker (``transportd.dataplane.worker.RailService``) serves
RAIL_REQUESTS: tuple[type[LinkRequest], ...] = (
    MapRegion, UnmapRegion, MapGpuRegion, MapFlags, UnmapFlags, MapGpuFlags, SetSourceRegion, AddChannel,
    RemoveChannel, ForgetRank, SetRemoteRegion, SetRemoteFlags, BindPeer, ForgetPeer, TraceStart, TraceStop,
    CreateEndpoint, Connect, CloseConnection, FailConnection, HoldConnection, RetireConnection,
    BrokenConnections, ConnectionsIdle, OpenIbgdaDomain, CloseIbgdaDomain, Stats, Stop,
)
