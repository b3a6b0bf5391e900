"""What the daemon's parts share: the node's servers and rail workers, its jobs and their ranks, the ids.

:class:`NodeState` is the one bag of shared resources: :class:`~transportd.daemon.main.Daemon` creates and
closes what it holds (the rail workers, the control server, the descriptor socket, the peer plane); the
parts (``clients``, ``memory``, ``ibgda``, ``peering``, ``selftest_jobs``, ``stats``) use them and keep their
own state themselves. The records of a job are here too, since every part reads them: :class:`JobState`,
its ranks on this node (:class:`LocalRank`) and on peer nodes (:class:`RemoteRank`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cmd_ring import RingFile
from transportd.backends.interface import FLAG_SEED_DTYPE
from transportd.config import Config
from transportd.control.fdsocket import FdServer
from transportd.control.peers import PeerPlane
from transportd.control.protocol import RegionInfo
from transportd.control.server import ControlServer
from transportd.dataplane.flagfile import FlagFile
from transportd.dataplane.worker_link import WorkerHandle
from transportd.errors import WorkerError

__all__ = ["FLAGS_REGION_ID", "JobState", "LocalRank", "NodeState", "RemoteRank", "flag_seeds", "memfd_name",
           "quietly", "region_key"]

log = logging.getLogger("transportd")

FLAGS_REGION_ID = 0xFFFF_FFFF  # the id a rank's flag array carries in peer_regions


@dataclass
class LocalRank:
    """One client session that joined a job on this node (or the far side of a self-test).

    ``regions`` is the region registry: the one record of the regions this rank registered, region id ->
    rail -> key (address, length, lkey, rkey), which :class:`~transportd.daemon.memory.RankMemory` alone
    adds to (once every rail has registered the region) and releases. What the rails keep are views of it,
    made and dropped on its say: each rail worker's registration of the region
    (:attr:`transportd.dataplane.worker.RailService.regions`, by :func:`region_key`), that worker's proxy's
    source table for the rank (:class:`transportd.dataplane.tables.RegionTable`, through
    ``SetSourceRegion``), and the engine's view of that table's arrays. A peer node learns them from
    ``peer_regions`` (:class:`RemoteRank`).
    """

    client_id: bytes
    job: str
    rank: int
    world: int
    device: int
    rail: int
    pid: int = 0
    regions: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)  # id -> rail -> key
    region_kinds: dict[int, str] = field(default_factory=dict)
    flags: FlagFile | None = None
    flag_keys: dict[int, dict[str, int]] = field(default_factory=dict)  # rail -> key
    channels: dict[int, RingFile] = field(default_factory=dict)  # its rings (IBGDA channels: ibgda.py)
    offers: list[int] = field(default_factory=list)  # descriptors offered to its client (taken or not)
    announced: bool = False
    next_region: int = 0


@dataclass
class RemoteRank:
    node: str
    regions: dict[tuple[int, int], RegionInfo]  # (id, rail) -> info
    flag_seeds: bytes = b""  # its nonzero flag counters when it announced itself (PeerRegions.flag_seeds)


@dataclass
class JobState:
    world: int
    owner: str = ""  # the principal of the session that created the job on this node
    local: dict[int, LocalRank] = field(default_factory=dict)
    remote: dict[int, RemoteRank] = field(default_factory=dict)
    pushed: set[tuple[int, int, int]] = field(default_factory=set)  # (rail, peer rank, region id) in workers
    lost: set[str] = field(default_factory=set)  # nodes declared lost while the job ran (it has PEER_LOST)
    #: remote ranks whose node restarted, with the clock time by which they must announce themselves again
    #: (their records wait in the rings until then; after it the job has lost their node)
    returning: dict[int, float] = field(default_factory=dict)


@dataclass
class NodeState:
    """The daemon's shared resources. ``workers``: one per rail (their index is the rail); ``control``,
    ``fdserver`` and ``peers`` once started (``fdserver`` only over ipc); ``jobs`` by name."""

    config: Config
    workers: list[WorkerHandle] = field(default_factory=list)
    control: ControlServer | None = None
    fdserver: FdServer | None = None
    peers: PeerPlane | None = None
    jobs: dict[str, JobState] = field(default_factory=dict)
    # one id space per worker for its connections, accepted connections and IBGDA queues (the worker keys
    # them all by id), and one for channels (rings and IBGDA channels)
    conn_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    channel_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    kept_channel_ids: set[int] = field(default_factory=set)  # ids re-attaching clients kept (never handed out)

    def new_channel_id(self, wanted: int = 0) -> int:
        """A channel id: ``wanted`` (a ring a re-attaching client kept) where no channel of this life has it,
        else the next unused one."""
        if wanted and wanted not in self.kept_channel_ids and not any(
                wanted in rank.channels for job in self.jobs.values() for rank in job.local.values()):
            self.kept_channel_ids.add(wanted)
            return wanted
        while True:
            channel_id = next(self.channel_ids)
            if channel_id not in self.kept_channel_ids:
                return channel_id

    @property
    def node(self) -> str:
        return self.config.node.name

    @property
    def plane(self) -> PeerPlane:
        """The peer plane, for the parts that only run once the daemon started."""
        assert self.peers is not None, "the peer plane is not started"
        return self.peers

    def node_of(self, job: JobState, rank: int) -> str:
        """The node hosting rank ``rank`` of ``job`` (this one for a local rank)."""
        return self.node if rank in job.local else job.remote[rank].node

    def rail_for_device(self, device: int) -> int:
        """The rail a rank on GPU ``device`` uses when it names none: the rail of that GPU, else by index."""
        for index, rail in enumerate(self.config.backend.rails or ()):
            if rail.gpu == device and device >= 0:
                return index
        return max(device, 0) % len(self.workers)

    def flags_placement(self, device: int) -> str:
        """Where ``session.flags()`` puts flags when the client does not say: ``flags.placement``, except
        host for a client without a GPU, or where a rail could reach GPU flag words only through the
        daemon's CUDA context (its ``flag_publication`` is ``host-mapped``)."""
        if self.config.flags.placement == "host" or device < 0:
            return "host"
        if any(w.info.get("flag_publication") == "host-mapped" for w in self.workers):
            return "host"
        return "device"


def flag_seeds(flags: FlagFile | None) -> bytes:
    """The nonzero counters of a flag array as FLAG_SEED_DTYPE records (what PeerRegions.flag_seeds carries)."""
    if flags is None:
        return b""
    values = flags.values
    slots = np.flatnonzero(values)
    seeds = np.zeros(len(slots), dtype=FLAG_SEED_DTYPE)
    seeds["slot"] = slots
    seeds["value"] = values[slots]
    return seeds.tobytes()


def region_key(rank: LocalRank, region_id: int) -> str:
    """The name a rank's region has in every rail worker."""
    return f"{rank.job}/{rank.rank}/{region_id}"


def memfd_name(kind: str, *parts: object) -> str:
    """``tpd-<kind>-<parts>``: a label in /proc/<pid>/maps and fd links, nothing anyone can open by it."""
    return "-".join(("tpd", kind, *map(str, parts)))[:200]  # the kernel takes 249 bytes at most


def quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a worker for cleanup: a failure is logged, never raised (the rest of the cleanup goes on); the
    reply, or None after a failure."""
    try:
        return fn(*args, **kwargs)
    except WorkerError as exc:
        log.warning("%s", exc)
        return None
