"""A proxy worker process: one rail's backend, its proxy loop, and the requests the main process sends.

The main process (``transportd.daemon.main``) owns clients and peers; this process owns the rail's verbs
resources, maps the memory it registers (host regions and flag files are shared-memory files), and runs
the proxy loop (:func:`serve_loop`, in the engine with the GIL released). Requests arrive on the worker
link (``WorkerEndpoint``), whose descriptor the loop watches: it returns to Python to serve them. When the
rail is idle the loop backs off from spinning to watching the ring headers and short naps, so an idle
daemon does not burn a core.

Rail ``i`` opens ``backend.rails[i].device``. Over softverbs a device name that does not exist yet (only
``softib0``/``softefa0`` do by default) is created in this process, of the kind the backend drives, through
the soft options handed to ``transportd.backends.verbs.load`` (``devices``); pyverbs ignores them. Before opening
it, the worker pins itself to the CPUs of the NIC's NUMA node where the config or sysfs names one
(``transportd.dataplane.pinning``; never fatal).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

import msgspec

from cmd_ring import RingFile
from cmd_ring.shm import SharedFile, map_fd
from transportd.backends import DEVICE_KINDS, FIXED_PROVIDERS, open_configured, traits_of
from transportd.backends import verbs as verbs_provider
from transportd.backends.interface import MemoryKey
from transportd.config import Config
from transportd.dataplane import link_messages as link
from transportd.dataplane.flag_publication import RailFlags
from transportd.dataplane.flagfile import FlagFile
from transportd.dataplane.gpu_memory import GpuMemory, IpcRegion
from transportd.dataplane.pinning import LoopCpu, isolate_loop, pin_worker
from transportd.dataplane.proxy import Proxy
from transportd.dataplane.worker_link import WorkerEndpoint
from transportd.lifetime import die_with_parent
from transportd.logs import setup_logging

__all__ = ["RailService", "rail_main"]

log = logging.getLogger("transportd.dataplane.worker")


class RailService:
    """The worker's request handlers (:meth:`handlers`: one per worker-link request type) around one backend,
    its proxy and its flag publisher (:class:`~transportd.dataplane.flag_publication.RailFlags`: the ranks'
    flag arrays on this rail)."""

    def __init__(self, config: Config, rail: int) -> None:
        self.config = config
        self.rail = rail
        rails = config.backend.rails
        device = rails[rail].device if rails else ""
        kind = config.backend.kind
        # a backend the registry ties to one provider (kind "soft") uses it; otherwise backend.verbs decides
        provider = FIXED_PROVIDERS.get(kind, config.backend.verbs)
        soft_options = msgspec.structs.asdict(config.softverbs)
        if device and kind in DEVICE_KINDS:  # a soft rail device is created where missing
            soft_options["devices"] = {device: DEVICE_KINDS[kind]}
        verbs = verbs_provider.load(None if provider == "auto" else provider, soft_options=soft_options)
        self.verbs_name: str = verbs.name
        self.soft = verbs.soft  # softverbs.soft when this rail runs on softverbs, else None
        self.verbs_fallback: bool = verbs.fallback  # only "auto" falls back
        if self.verbs_fallback:
            log.warning("backend.verbs = \"auto\" found no RDMA device: rail %d uses softverbs, which moves "
                        "data over TCP, not a NIC; set backend.verbs = \"pyverbs\" on a production node (it "
                        "fails instead) or \"soft\" to choose this knowingly", rail)
        self.backend = open_configured(config, device=device or None, verbs=verbs)  # only what the kind takes
        self.proxy = Proxy(self.backend, batch_max=config.proxy.batch_max,
                           poll_window_us=config.proxy.poll_window_us, inflight_cap=config.proxy.inflight_cap,
                           max_take=config.proxy.max_take, decoupled=config.signal.decoupled)
        # this rail's registrations of the ranks' regions, key (state.region_key) -> (memory key, mapping): a
        # view of the main process's region registry (daemon.state.LocalRank.regions), mapped and unmapped
        # only on its MapRegion / MapGpuRegion / UnmapRegion
        self.regions: dict[str, tuple[MemoryKey, Any]] = {}
        self.conn_jobs: dict[int, str] = {}
        self.responders: set[int] = set()  # connections this rail accepted for a peer's requester
        self.ibgda_domains: dict[tuple[str, int], Any] = {}  # (job, rank) -> its ibgda.domain.ImportDomain
        self.seeds: dict[tuple[str, int], tuple[int, int, bytes]] = {}  # (job, peer) -> flags' seeds, to bind
        self.stopping = False
        self.gpu = GpuMemory(via=config.softverbs.direct_copy_via)  # CUDA starts when a client brings GPU memory
        if self.soft is not None and config.softverbs.direct_copy:
            # peers on this host place writes between GPU buffers by one copy (through host memory: via=host)
            self.soft.set_direct_copier(self.gpu)
        self.cpus: list[int] | None = None  # the CPUs rail_main pinned this worker to (None: not pinned)
        self.loop_cpu: int | None = None  # the CPU its loop has to itself (None: it shares the worker's)
        # the rank's flag arrays and the rail's one flag publisher (its path chosen and logged once)
        self.flags = RailFlags.for_rail(config.flags, self.backend, self.gpu, self.conn_jobs, rail)

    def handlers(self) -> dict[type[link.LinkRequest], Callable[..., Any]]:
        """The worker link's dispatch table: request type -> handler (``link.RAIL_REQUESTS``, each once)."""
        table: dict[type[link.LinkRequest], Callable[..., Any]] = {
            link.MapRegion: self.map_region, link.UnmapRegion: self.unmap_region,
            link.MapGpuRegion: self.map_gpu_region, link.MapFlags: self.map_flags, link.UnmapFlags: self.unmap_flags,
            link.MapGpuFlags: self.map_gpu_flags, link.SetSourceRegion: self.set_source_region,
            link.AddChannel: self.add_channel, link.RemoveChannel: self.remove_channel,
            link.ForgetRank: self.forget_rank, link.SetRemoteRegion: self.set_remote_region,
            link.SetRemoteFlags: self.set_remote_flags, link.BindPeer: self.bind_peer,
            link.ForgetPeer: self.forget_peer, link.TraceStart: self.trace_start, link.TraceStop: self.trace_stop,
            link.CreateEndpoint: self.create_endpoint, link.Connect: self.connect,
            link.CloseConnection: self.close_connection, link.FailConnection: self.fail_connection,
            link.HoldConnection: self.hold_connection, link.RetireConnection: self.retire_connection,
            link.BrokenConnections: self.broken_connections, link.ConnectionsIdle: self.connections_idle,
            link.OpenIbgdaDomain: self.open_ibgda_domain, link.CloseIbgdaDomain: self.close_ibgda_domain,
            link.Stats: self.stats, link.Stop: self.stop,
        }
        assert set(table) == set(link.RAIL_REQUESTS)
        return table

    # --- memory ---------------------------------------------------------------------------------------
    def map_region(self, req: link.MapRegion, fds: list[int]) -> link.RegionKey:
        """Map the client's memfd (passed by descriptor, never named by path) and register a range of it.

        The descriptor is closed at once: the mapping keeps the memory. :meth:`unmap_region` unmaps it,
        so a registration costs no descriptor and no mapped byte after it ends.
        """
        offset, size = req.offset, req.size
        try:
            (fd,) = fds
            shared = map_fd(fd)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            if offset + size > shared.size:
                raise ValueError(f"region [{offset}, {offset + size}) is outside the client's memory "
                                 f"({shared.size} bytes)")
            mkey = self.backend.register_memory(shared.address + offset, size, remote_write=req.remote_write,
                                                remote_atomic=req.remote_atomic)
        except BaseException:
            shared.close()
            raise
        self.regions[req.key] = (mkey, shared)
        return _key(mkey)

    def unmap_region(self, req: link.UnmapRegion) -> link.Done:
        entry = self.regions.pop(req.key, None)
        if entry is not None:
            self.backend.deregister_memory(entry[0])
            if isinstance(entry[1], SharedFile):
                entry[1].close()  # the mapping (and the descriptor mmap holds) go now, not at some GC
            elif hasattr(entry[1], "release"):  # a GPU region: drop its IPC mapping
                entry[1].release()
        return link.Done()

    def map_gpu_region(self, req: link.MapGpuRegion) -> link.RegionKey:
        """Open a client's GPU buffer by CUDA IPC handle and register it; softverbs reaches it by copies."""
        gpu = self.gpu
        region = gpu.open(req.handle, req.offset, req.size, req.device)
        try:
            mkey = self.backend.register_memory(region.addr, req.size, remote_write=req.remote_write,
                                                remote_atomic=req.remote_atomic, accessor=gpu.accessor(req.device))
        except BaseException:
            region.release()
            raise
        self.regions[req.key] = (mkey, region)
        return _key(mkey)

    def map_flags(self, req: link.MapFlags, fds: list[int]) -> link.RegionKey:
        """Map a rank's flag array (the daemon's memfd, by descriptor) and register it for remote atomics."""
        (fd,) = fds
        return _key(self.flags.map_host(req.job, req.rank, FlagFile.from_fd(fd), req.count))

    def unmap_flags(self, req: link.UnmapFlags) -> link.Done:
        """Drop a rank's flag array alone (its flags request failed on another rail)."""
        self.flags.drop(req.job, req.rank)
        return link.Done()

    def map_gpu_flags(self, req: link.MapGpuFlags, fds: list[int]) -> link.GpuFlagsKey:
        """A rank's flag words in GPU memory (allocated by the client): the NIC or this worker publishes.

        ``fds``: the rank's host flag file (the daemon's memfd), the shadow of the counters this worker
        publishes; mapped here, its descriptor closed. How they are published is the rail's
        (:class:`~transportd.dataplane.flag_publication.RailFlags`); a rail that has no way into GPU memory
        (``host-mapped``) copies, and says so.
        """
        shadow = _shadow_file(fds, req.count)
        mkey, publication = self.flags.map_gpu(req.job, req.rank, req.handle, req.offset, req.count, req.device,
                                               shadow)
        return link.GpuFlagsKey(addr=mkey.addr, length=mkey.length, lkey=mkey.lkey, rkey=mkey.rkey,
                                publication=publication)

    # --- tables -----------------------------------------------------------------------------------------
    def set_source_region(self, req: link.SetSourceRegion) -> link.Done:
        mkey = self.regions[req.key][0]
        self.proxy.set_source_region(req.job, req.rank, req.region, mkey.addr, mkey.length, mkey.lkey)
        return link.Done()

    def add_channel(self, req: link.AddChannel, fds: list[int]) -> link.Done:
        """Drain the ring the daemon made (a memfd, by descriptor: mapped here, the descriptor closed)."""
        (fd,) = fds
        ring = RingFile.from_fd(fd)
        try:
            self.proxy.add_channel(req.channel, ring, req.job, req.rank, req.world)
        except BaseException:
            ring.close()
            raise
        return link.Done()

    def remove_channel(self, req: link.RemoveChannel) -> link.Done:
        self.proxy.remove_channel(req.channel)
        return link.Done()

    def forget_rank(self, req: link.ForgetRank) -> link.Done:
        self.proxy.forget_rank(req.job, req.rank)
        self.flags.drop(req.job, req.rank)
        return link.Done()

    def set_remote_region(self, req: link.SetRemoteRegion) -> link.Done:
        self.proxy.set_remote_region(req.job, req.peer, req.region, req.addr, req.length, req.rkey)
        return link.Done()

    def set_remote_flags(self, req: link.SetRemoteFlags) -> link.Done:
        """``seeds``: the counters the peer's flag array holds already (a restart of either daemon kept
        them), for the connection the peer is bound to next (:meth:`bind_peer`)."""
        self.proxy.set_remote_flags(req.job, req.peer, req.addr, req.count, req.rkey)
        self.seeds[(req.job, req.peer)] = (req.addr, req.rkey, bytes(req.seeds))
        return link.Done()

    def bind_peer(self, req: link.BindPeer) -> link.Done:
        addr, rkey, seeds = self.seeds.pop((req.job, req.peer), (0, 0, b""))
        if seeds:
            self.backend.seed_signals(req.conn, addr, rkey, seeds)
        self.proxy.bind_peer(req.job, req.peer, req.conn)
        return link.Done()

    def forget_peer(self, req: link.ForgetPeer) -> link.Done:
        self.proxy.forget_peer(req.job, req.peer)
        return link.Done()

    # --- trace record (docs/trace.md) -------------------------------------------------------------------
    def trace_start(self, req: link.TraceStart) -> link.TraceStarted:
        """Record what the rank's channels on this rail take into ``{prefix}.ch{channel}.part`` files."""
        return link.TraceStarted(channels=self.proxy.trace_start(req.job, req.rank, req.prefix))

    def trace_stop(self, req: link.TraceStop) -> dict[str, Any]:
        """End the rank's recording here: its part files, counts and replay context (``Proxy.trace_stop``)."""
        return self.proxy.trace_stop(req.job, req.rank)

    # --- connections ------------------------------------------------------------------------------------
    def create_endpoint(self, req: link.CreateEndpoint) -> link.Endpoint:
        self.conn_jobs[req.conn] = req.job
        endpoint = self.backend.create_endpoint(req.conn, req.job)
        if req.responder:
            self.responders.add(req.conn)
        return link.Endpoint(endpoint=endpoint)

    def connect(self, req: link.Connect) -> link.Done:
        self.backend.connect(req.conn, req.remote)
        return link.Done()

    def close_connection(self, req: link.CloseConnection) -> link.Closed:
        """Close ``conn``; the reply says the payload bytes posted on it (the daemon keeps them per peer node)."""
        conn = req.conn
        sent = sum(int(c["bytes"]) for c in self.proxy.queue_stats()["connections"] if c["conn"] == conn)
        self.proxy.fail_connection(conn, 0)
        self.backend.close_connection(conn)
        self.conn_jobs.pop(conn, None)
        self.responders.discard(conn)
        return link.Closed(sent=sent)

    def fail_connection(self, req: link.FailConnection) -> link.Done:
        self.proxy.fail_connection(req.conn, req.code)
        return link.Done()

    # --- a peer daemon restarting (docs/restart.md) -------------------------------------------------------
    def hold_connection(self, req: link.HoldConnection) -> link.Done:
        """Keep records for ``conn``'s peers in their rings (or take them again); what waits still posts."""
        self.proxy.hold_connection(req.conn, req.on)
        return link.Done()

    def retire_connection(self, req: link.RetireConnection) -> link.Done:
        """``conn``'s far end is gone: what is waiting or in flight on it completes with ``code``, its peers
        stay held on it until bound to the connection that replaces it."""
        self.proxy.retire_connection(req.conn, req.code)
        return link.Done()

    def broken_connections(self, req: link.BrokenConnections) -> link.Conns:
        """Connections whose far end stopped answering since the last call (the engine holds them)."""
        return link.Conns(conns=self.proxy.broken_connections())

    def connections_idle(self, req: link.ConnectionsIdle) -> link.Idle:
        """Whether nothing waits or is in flight on any of ``conns`` (a restarting peer may stop then)."""
        return link.Idle(idle=self.proxy.connections_idle(list(req.conns)))

    # --- IBGDA domains: the client builds its queue pairs itself, on a domain this rail exports to it ------
    def open_ibgda_domain(self, req: link.OpenIbgdaDomain) -> link.IbgdaDomain:
        """The rank's domain (``ibgda.domain``: a context of its own on this rail's device, a PD, a scratch
        page), made on first use, with the rank's ``regions`` (worker region keys) registered there; the
        reply is the grant and each region's lkey and handle, and with ``with_fd`` a copy of the context's
        command descriptor for the client."""
        job, rank = req.job, req.rank
        domain = self.ibgda_domains.get((job, rank))
        if domain is None:
            if not traits_of(self.backend).ibgda:  # the backends that can serve one declare it
                raise ValueError(f"IBGDA channels need an InfiniBand rail (mlx5); this one is {self.backend.name}")
            domain = self.ibgda_domains[(job, rank)] = self.backend.create_ibgda_domain()
        keys = {}
        for key in req.regions:
            entry = self.regions.get(key)
            if entry is None:
                raise ValueError(f"no region {key!r} on this rail")
            mkey, memory = entry
            accessor = self.gpu.accessor(memory.device) if isinstance(memory, IpcRegion) else None
            keys[key] = domain.register(key, mkey.addr, mkey.length, accessor)
        # the command descriptor is sent before the reply and closed here (worker_link)
        return link.IbgdaDomain(grant=domain.grant(), regions=keys,
                                fds=[domain.command_fd()] if req.with_fd else [])

    def close_ibgda_domain(self, req: link.CloseIbgdaDomain) -> link.Done:
        """Close the rank's domain: its MRs' keys stop working and, once the client's copy of the descriptor
        is closed too (leave, exit or kill), the NIC frees the queue pairs the client built in it."""
        domain = self.ibgda_domains.pop((req.job, req.rank), None)
        if domain is not None:
            domain.close()
        return link.Done()

    def ibgda_stats(self) -> list[dict[str, Any]]:
        return [{"job": job, "rank": rank, "regions": len(d.regions) - 1}
                for (job, rank), d in self.ibgda_domains.items()]

    # --- reporting and shutdown -----------------------------------------------------------------------------
    def stats(self, req: link.Stats) -> dict[str, Any]:
        address = self.backend.local_address()
        return {"rail": self.rail, "backend": self.backend.name, "verbs": self.verbs_name,
                "verbs_fallback": self.verbs_fallback, "pid": os.getpid(), "device": address.get("device"),
                "gid": address.get("gid"), "cpus": self.cpus, "loop_cpu": self.loop_cpu,
                "flag_publication": self.flags.path,
                "flag_publication_detail": self.flags.publication.describe(),
                "flag_loopback": self.flags.loopback_stats(), "flag_copies": self.flags.copied_words(),
                **self.proxy.stats(),
                "queues": self._open_queues(),
                "ibgda_domains": self.ibgda_stats(), "responders": sorted(self.responders),
                "endpoints": sorted(self.conn_jobs), "softverbs": self._soft_stats(address.get("device"))}

    def _soft_stats(self, device: Any) -> dict[str, Any] | None:
        """The soft device's direct-copy counters and NIC-model schedule, and how its direct copies between GPU
        buffers are placed (``direct_copy_via``; None with direct copies off); None on a real NIC."""
        if self.soft is None or not device:
            return None
        try:
            out = self.soft.device_stats(device)
        except KeyError:
            return None
        out["direct_copy_via"] = self.gpu.via if self.config.softverbs.direct_copy else None
        return out

    def _open_queues(self) -> dict[str, Any]:
        """The proxy's queue state, less connections already closed here: the proxy keeps a closed
        connection's counters (its totals stay in ``stats``), but ``transportctl queues``/``top`` and the
        metrics' queue pairs must agree on what is open."""
        queues = self.proxy.queue_stats()
        queues["connections"] = [c for c in queues["connections"] if c["conn"] in self.conn_jobs]
        return queues

    def stop(self, req: link.Stop) -> link.Stopped:
        """Drain (every record committed so far is posted and completed, bounded), then exit."""
        drained = self.proxy.drain(timeout_s=5.0)
        self.stopping = True
        return link.Stopped(drained=drained)


def _key(mkey: MemoryKey) -> link.RegionKey:
    return link.RegionKey(addr=mkey.addr, length=mkey.length, lkey=mkey.lkey, rkey=mkey.rkey)


def _shadow_file(fds: list[int], count: int) -> FlagFile:
    """Map the rank's host flag file (by descriptor, closed here) as the shadow of its GPU flag words."""
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError("device flags need the rank's flag file as their shadow (one descriptor)")
    shadow = FlagFile.from_fd(fds[0])  # consumes the descriptor
    if shadow.count != count:
        shadow.close()
        raise ValueError(f"the flag file holds {shadow.count} flags, not {count}")
    return shadow


# Idle backoff (see serve_loop). Timed from the last pass that did work.
SPIN_S = 0.002  # passes back to back (records arriving within this are taken at once)
WATCH_S = 30e-6  # then, between passes: watch the ring headers this long, then nap NAP_S
NAP_S = 20e-6
DEEP_AFTER_S = 0.15  # idle this long: between passes, watch the ring headers for up to DEEP_WATCH_S with
DEEP_WATCH_S = 10e-3  # DEEP_NAP_S waits on the link between looks: a record is seen within ~DEEP_NAP_S, a
DEEP_NAP_S = 50e-6  # request at once; what it costs in CPU: `transportd bench proxy --idle-nap-us N`
# while busy or spinning, the link's descriptor is looked at this often: a look is a poll() (~0.5 us, about
# three idle passes), so counting passes put one in every ~10 us of spinning, in the way of a record arriving
LINK_EVERY_S = 50e-6


def deep_watch_s(backend: Any, deep_nap_s: float = DEEP_NAP_S) -> float:
    """How long a long-idle worker watches its rings between passes: ``DEEP_WATCH_S``, but one nap for a
    backend that ``receives`` (efa): its arrivals announce themselves on the CQ, not in a ring header, and
    only a pass polls the CQ, so a longer watch would hold a flag back by up to the watch."""
    return deep_nap_s if traits_of(backend).receives else DEEP_WATCH_S


def serve_policy(backend: Any, deep_nap_s: float = DEEP_NAP_S) -> dict[str, float | int]:
    """The back-off :meth:`Proxy.serve` runs, from this module's constants (read at call time)."""
    return {"spin_s": SPIN_S, "watch_s": WATCH_S, "nap_s": NAP_S, "deep_after_s": DEEP_AFTER_S,
            "deep_watch_s": deep_watch_s(backend, deep_nap_s), "deep_nap_s": deep_nap_s,
            "link_every_s": LINK_EVERY_S}


def serve_loop(proxy: Proxy, link: Any, stopping: Callable[[], bool], deep_nap_s: float = DEEP_NAP_S,
               loop_cpu: LoopCpu | None = None) -> None:
    """Run the proxy and serve the main process's requests until ``stopping()`` or a stop request.

    The loop itself runs in the engine with the GIL released (:meth:`Proxy.serve`): while the proxy has
    work it runs pass after pass, looking at the link's descriptor every ``LINK_EVERY_S``. When a pass
    finds nothing to do the worker keeps spinning for ``SPIN_S``, then alternates a pass (which also drains
    completions) with watching the ring headers for ``WATCH_S`` (a committed record ends the wait at once)
    and a ``NAP_S`` wait on the link's descriptor; after ``DEEP_AFTER_S`` each pass is followed by up to
    ``DEEP_WATCH_S`` of looking at the ring headers, waiting ``deep_nap_s`` on the link's descriptor between
    looks: a long-idle worker costs little CPU, still takes the first record within tens of µs, and a
    request on the link ends the wait at once. A backend that receives (efa) gets a pass after every nap
    instead (:func:`deep_watch_s`), so its arrivals wait no longer than a record.

    The engine returns here only when the link's descriptor turns readable (the requests are served, then
    the loop goes back in) or when :meth:`Proxy.interrupt` is called; ``stopping()`` is checked then. A
    backend's one Python call per pass (softverbs' shims, efa's flag copies) runs inside the engine's loop.
    With ``loop_cpu`` (:func:`~transportd.dataplane.pinning.isolate_loop`) the loop runs on its CPU alone and
    the requests on the worker's other CPUs.
    """
    serve_pending = link.serve_pending
    link_fd = link.wake_fd()
    policy = serve_policy(proxy.backend, deep_nap_s)
    while not stopping():
        # every request waiting is served before the engine goes back in: after that, a new one makes the
        # link's descriptor readable (zmq signals it when a drained pipe gets a message)
        if loop_cpu is not None:
            loop_cpu.requests()
        if serve_pending(0) or stopping():
            break
        if loop_cpu is not None:
            loop_cpu.loop()
        proxy.serve(wake_fd=link_fd, **policy)


def rail_main(config: Config, rail: int, link_endpoint: str) -> None:
    """Process entry of a proxy worker (``config`` arrives pickled from the main process)."""
    # A worker must not outlive its daemon (kill -9, the OOM killer): nobody would serve or reclaim its rail.
    parent = mp.parent_process()
    die_with_parent(signal.SIGKILL, parent.pid if parent is not None else None)
    cfg = config
    # The main process decides when to stop (SIGTERM -> drain): a Ctrl-C sent to the whole process group
    # must not kill a worker in the middle of its drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(cfg.logging.level, cfg.logging.format, tag=f"rail{rail}")
    # near the NIC where the machine says so; before the device opens, so the provider's threads follow
    entry = cfg.backend.rails[rail] if rail < len(cfg.backend.rails) else None
    cpus = pin_worker(rail, entry.numa_node if entry else -1, entry.device if entry else "")
    service = RailService(cfg, rail)
    service.cpus = list(cpus) if cpus is not None else None
    endpoint = WorkerEndpoint(link_endpoint, service.handlers())
    # once the device and the link have started their threads: those move off the loop's CPU
    loop_cpu = isolate_loop(rail, entry.loop_cpu if entry else -1)
    service.loop_cpu = loop_cpu.cpu if loop_cpu is not None else None
    endpoint.send_ready(address=service.backend.local_address(), verbs=service.verbs_name,
                        verbs_fallback=service.verbs_fallback, flag_publication=service.flags.path)
    serve_loop(service.proxy, endpoint, lambda: service.stopping, loop_cpu=loop_cpu)
    endpoint.close()
    for job, rank in list(service.ibgda_domains):
        service.close_ibgda_domain(link.CloseIbgdaDomain(job=job, rank=rank))
    service.flags.close()
    service.backend.close()
    service.flags.publication.close()
