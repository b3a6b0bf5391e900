"""A rank's memory in the rail workers: registered regions, its flag array, its rings.

Regions are mapped and registered on every rail (so any rail can serve a command that names them); the
flag array and each ring are memfds the daemon makes and offers to the client by descriptor. Host memory
arrives only by descriptor and must be a size-sealed memfd (:func:`check_host_fd`).

A session re-attaching after a restart (docs/restart.md) sends it all again: its regions under the ids they
had, and the flag file and rings an earlier daemon made (``adopt``), which this one serves as they are:
counters untouched, each ring drained from the consumer position published in it. Records that earlier
daemon took but never saw complete (between the ring's completion and consumer positions) have an unknown
outcome: the ring's error word says UNKNOWN_OUTCOME from the first of them, and the reply says which.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cmd_ring import RingError, RingFile
from cmd_ring.shm import size_is_sealed
from transportd.control.fdsocket import SideConnection, is_memfd
from transportd.control.protocol import Flags, Register, ReplyCode
from transportd.daemon.clients import ControlClients
from transportd.daemon.state import LocalRank, NodeState, memfd_name, quietly, region_key
from transportd.dataplane import link_messages as link
from transportd.dataplane.flagfile import FlagFile
from transportd.errors import ErrorCode, RequestError, WorkerError
from transportd.limits import MAX_REGIONS

__all__ = ["GpuBuffer", "HostBuffer", "RankMemory", "check_adopted_fd", "check_host_fd"]

log = logging.getLogger("transportd")


@dataclass(frozen=True)
class HostBuffer:
    """Host memory to register: a size-sealed memfd (still the caller's; each rail gets a copy)."""

    fd: int


@dataclass(frozen=True)
class GpuBuffer:
    """GPU memory to register: a CUDA IPC handle, opened by the rails on ``device``."""

    handle: bytes
    device: int


class RankMemory:
    """Maps, registers and releases ranks' memory in the rail workers (the ranks record what they hold)."""

    def __init__(self, state: NodeState, clients: ControlClients) -> None:
        self.state = state
        self.clients = clients

    # --- regions ---------------------------------------------------------------------------------------
    def register(self, client_id: bytes, req: Register) -> dict[str, Any]:
        rank = self.clients.joined(client_id)
        fd = -1
        if req.kind in ("host", "dmabuf"):
            # by descriptor only: the fd this session passed on its descriptor socket (never a path)
            conn = self.clients.side.get(client_id)
            if conn is None:
                raise RequestError(ReplyCode.UNSUPPORTED, f"{req.kind} memory travels as a descriptor on the "
                                                          "local descriptor socket: register it over ipc")
            fd = conn.take(int(req.handle))  # type: ignore[arg-type]
        try:
            if req.kind == "host":
                check_host_fd(fd, req.offset, req.size)
                memory: HostBuffer | GpuBuffer = HostBuffer(fd)
            elif req.kind == "cuda_ipc":  # opened by the rail workers in a context on the client's device
                memory = GpuBuffer(req.handle, max(rank.device, 0))  # type: ignore[arg-type]
            else:
                # a dma-buf fd arrives the same way; a real-NIC rail would register it with DmaBufMR
                raise RequestError(ReplyCode.UNSUPPORTED,
                                   f"{req.kind} memory needs a real-NIC backend (not available yet)")
            region_id = self.add_region(rank, memory, req.offset, req.size, req.access, f"{req.kind}:{req.offset}",
                                        wanted=req.id)
        finally:
            if fd >= 0:
                os.close(fd)  # every worker holds its own mapping; the daemon keeps nothing of it
        return {"region": region_id}

    def add_region(self, rank: LocalRank, memory: HostBuffer | GpuBuffer, offset: int, size: int,
                   access: Sequence[str], kind: str, wanted: int = -1) -> int:
        """Map and register a region of ``rank`` on every rail (``memory``: a memfd, still the caller's, or
        an IPC handle) and make it a source there; its id (``wanted``, where the client names the id it had
        before a restart). All rails or none: a failure unmaps it."""
        if wanted >= 0:
            if wanted in rank.regions:
                raise RequestError(ReplyCode.INVALID, f"region id {wanted} is taken in this session")
            region_id = wanted
        elif rank.next_region >= MAX_REGIONS:
            raise RequestError(ReplyCode.TOO_MANY_REGIONS, f"a rank may register at most {MAX_REGIONS} regions")
        else:
            region_id = rank.next_region
        key = region_key(rank, region_id)
        workers = self.state.workers
        keys = {}
        rights = {"remote_write": "write" in access, "remote_atomic": "atomic" in access,
                  "remote_read": "read" in access}
        request: link.MapRegion | link.MapGpuRegion
        if isinstance(memory, HostBuffer):
            request, fds = link.MapRegion(key=key, offset=offset, size=size, **rights), (memory.fd,)
        else:
            request, fds = link.MapGpuRegion(key=key, handle=memory.handle, offset=offset, size=size,
                                             device=memory.device, **rights), ()
        for worker in workers:
            try:
                keys[worker.rail] = worker.call(request, fds=fds).as_dict()
            except WorkerError as exc:
                for rail in keys:
                    workers[rail].call(link.UnmapRegion(key=key))
                raise RequestError(ReplyCode.REGISTER_FAILED, str(exc)) from None
        rank.next_region = max(rank.next_region, region_id + 1)
        rank.regions[region_id] = keys
        rank.region_kinds[region_id] = kind
        for worker in workers:
            worker.call(link.SetSourceRegion(job=rank.job, rank=rank.rank, region=region_id, key=key))
        return region_id

    # --- flags -----------------------------------------------------------------------------------------
    def flags(self, client_id: bytes, req: Flags) -> dict[str, Any]:
        rank = self.clients.joined(client_id)
        if rank.flags is not None:
            raise RequestError(ReplyCode.FLAGS_EXIST, "this rank already has its flag array")
        if req.where == "device" and not req.handle:
            raise RequestError(ReplyCode.UNSUPPORTED,
                               "device flags are allocated by the GPU client and sent by CUDA IPC "
                               "handle (gpuclient: session.flags(count, where='device'))")
        conn = self.clients.side_for(client_id, "a flag array (its status word, and the words of host flags)")
        if req.adopt >= 0:
            return self._adopt_flags(rank, conn, req)
        # + the status word; a memfd: no other process can open it by name, nothing outlives a killed daemon
        flags, fd = FlagFile.create_memfd(req.count, name=memfd_name("flags", rank.job, rank.rank))
        try:
            self.map_flags(rank, fd, req.count, req.where, req.handle, req.offset)
        except WorkerError as exc:
            os.close(fd)
            self._unmap_flags(rank)
            flags.close()
            raise RequestError(ReplyCode.FLAGS_FAILED, str(exc)) from None
        try:
            fd_id = self.clients.offer(rank, conn, fd, "flags")  # the offer owns fd now (closed if refused)
        except RequestError:
            self._unmap_flags(rank)
            flags.close()
            raise
        rank.flags = flags
        return {"fd": fd_id, "count": req.count}

    def _adopt_flags(self, rank: LocalRank, conn: SideConnection, req: Flags) -> dict[str, Any]:
        """Serve the flag file an earlier daemon made for this rank, passed back by its client: its counters
        and status word as they are (peers keep adding to them where they left off)."""
        fd = conn.take(req.adopt)
        try:
            check_adopted_fd(fd, "flag file")
            flags = FlagFile.from_fd(os.dup(fd))
        except (ValueError, OSError) as exc:
            os.close(fd)
            raise RequestError(ReplyCode.INVALID, f"the flag file passed back is not one: {exc}") from None
        try:
            if flags.count != req.count:
                raise RequestError(ReplyCode.INVALID, f"the flag file passed back holds {flags.count} flags, "
                                                      f"not {req.count}")
            self.map_flags(rank, fd, req.count, req.where, req.handle, req.offset)
        except WorkerError as exc:
            self._unmap_flags(rank)
            flags.close()
            raise RequestError(ReplyCode.FLAGS_FAILED, str(exc)) from None
        except BaseException:
            self._unmap_flags(rank)
            flags.close()
            raise
        finally:
            os.close(fd)
        rank.flags = flags
        return {"count": req.count, "adopted": True}

    def map_flags(self, rank: LocalRank, fd: int, count: int, where: str = "host", handle: bytes = b"",
                  offset: int = 0) -> None:
        """Map ``rank``'s flag file (``fd``, still the caller's) on every rail: host flags are its words;
        device flags are GPU words the client sent by IPC ``handle``, with the file as their host shadow."""
        for worker in self.state.workers:
            if where == "device":
                # the flag file rides along: the host shadow of the counters the workers publish
                request: link.MapGpuFlags | link.MapFlags = link.MapGpuFlags(
                    job=rank.job, rank=rank.rank, handle=handle, offset=offset, count=count,
                    device=max(rank.device, 0))
            else:
                request = link.MapFlags(job=rank.job, rank=rank.rank, count=count)
            rank.flag_keys[worker.rail] = worker.call(request, fds=(fd,)).as_dict()

    def _unmap_flags(self, rank: LocalRank) -> None:
        for rail in rank.flag_keys:
            quietly(self.state.workers[rail].call, link.UnmapFlags(job=rank.job, rank=rank.rank))
        rank.flag_keys.clear()

    # --- rings -----------------------------------------------------------------------------------------
    def adopt_ring(self, rank: LocalRank, conn: SideConnection, fd_id: int, wanted: int) -> dict[str, Any]:
        """Serve a ring an earlier daemon made for this rank, passed back by its client: drained from the
        consumer position published in it. What lies between its completion and consumer positions was
        taken and never seen complete: reported UNKNOWN_OUTCOME from the first such record (module doc)."""
        fd = conn.take(fd_id)
        try:
            check_adopted_fd(fd, "ring")
            ring = RingFile.from_fd(os.dup(fd))
        except (ValueError, OSError, RingError) as exc:
            os.close(fd)
            raise RequestError(ReplyCode.INVALID, f"the ring passed back is not one: {exc}") from None
        first, end = ring.completion_pos, ring.consumer_pos
        channel_id = self.state.new_channel_id(wanted)
        if end > first:
            # before the worker maps it (it starts at `end` and publishes that as complete): no one else
            # writes this error word now
            ring.report_error(int(ErrorCode.UNKNOWN_OUTCOME), first, end - first)
            log.warning("job %s rank %d channel %d: records [%d, %d) were taken by an earlier daemon and never seen "
                        "complete: UNKNOWN_OUTCOME", rank.job, rank.rank, channel_id, first, end)
        try:
            self.state.workers[rank.rail].call(
                link.AddChannel(channel=channel_id, job=rank.job, rank=rank.rank, world=rank.world), fds=(fd,))
        except WorkerError as exc:
            ring.close()
            raise RequestError(ReplyCode.CHANNEL_FAILED, str(exc)) from None
        finally:
            os.close(fd)
        rank.channels[channel_id] = ring
        return {"channel": channel_id, "capacity": ring.capacity, "rail": rank.rail, "position": end,
                "in_doubt": [first, max(first, end)]}

    def open_ring(self, rank: LocalRank, conn: SideConnection, capacity: int) -> dict[str, Any]:
        """A ring of ``capacity`` records (0: ``proxy.ring_capacity``) on the rank's rail, offered to it."""
        capacity = capacity or self.state.config.proxy.ring_capacity
        try:
            channel_id, ring, fd = self.add_ring(rank, capacity)
        except WorkerError as exc:
            raise RequestError(ReplyCode.CHANNEL_FAILED, str(exc)) from None
        try:
            fd_id = self.clients.offer(rank, conn, fd, "ring")
        except RequestError:
            quietly(self.state.workers[rank.rail].call, link.RemoveChannel(channel=channel_id))
            ring.close()
            raise
        rank.channels[channel_id] = ring
        return {"channel": channel_id, "fd": fd_id, "capacity": capacity, "rail": rank.rail}

    def add_ring(self, rank: LocalRank, capacity: int) -> tuple[int, RingFile, int]:
        """A new ring the rank's rail worker drains: (channel id, the ring, its memfd for the caller)."""
        channel_id = self.state.new_channel_id()
        # a memfd: the client and the rail worker get it by descriptor; no path another process could open
        ring, fd = RingFile.create_memfd(capacity, name=memfd_name("ring", rank.job, rank.rank, channel_id))
        try:
            self.state.workers[rank.rail].call(
                link.AddChannel(channel=channel_id, job=rank.job, rank=rank.rank, world=rank.world), fds=(fd,))
        except BaseException:
            os.close(fd)
            ring.close()
            raise
        return channel_id, ring, fd

    # --- releasing -------------------------------------------------------------------------------------
    def release(self, rank: LocalRank) -> None:
        """Free the rank's rings, regions and flags in every worker; whoever waits on them stops waiting."""
        workers = self.state.workers
        worker = workers[rank.rail] if rank.rail < len(workers) else None
        for channel_id, ring in rank.channels.items():
            if worker:
                quietly(worker.call, link.RemoveChannel(channel=channel_id))
            # a producer still waiting on the ring (quiet) stops at once, as one waiting on its flags does
            ring.report_error(int(ErrorCode.CLIENT_GONE), ring.consumer_pos)
            ring.close()
        for w in workers:
            quietly(w.call, link.ForgetRank(job=rank.job, rank=rank.rank))
            for region_id in rank.regions:
                quietly(w.call, link.UnmapRegion(key=region_key(rank, region_id)))
        if rank.flags is not None:
            # a client still waiting on its flags (the daemon stopping, its session expired) stops waiting
            rank.flags.set_status(int(ErrorCode.CLIENT_GONE))
            rank.flags.close()


def check_adopted_fd(fd: int, what: str) -> None:
    """A ring or flag file passed back by a re-attaching client: a memfd whose size is sealed (as the daemon
    made it), so that no holder can shrink it under the rail workers' mappings."""
    if not is_memfd(fd):
        raise ValueError(f"a {what} is a memfd the daemon made, not another kind of descriptor")
    if not size_is_sealed(fd):
        raise ValueError(f"a {what}'s memfd has its size sealed (F_SEAL_SHRINK and F_SEAL_GROW)")


def check_host_fd(fd: int, offset: int, size: int) -> None:
    """Host memory must be an anonymous memfd the client made (no file anyone could name), its size sealed
    (a client that shrank it would make the rail worker, and with it the daemon, die of SIGBUS touching
    the pages), holding the range."""
    if not is_memfd(fd):
        raise RequestError(ReplyCode.INVALID, "host memory must be a memfd (gpuclient.host_array): a named file "
                                              "or another kind of descriptor is refused")
    if not size_is_sealed(fd):
        raise RequestError(ReplyCode.INVALID, "host memory's memfd must have its size sealed (F_SEAL_SHRINK and "
                                              "F_SEAL_GROW, as gpuclient.host_array makes it): its owner could "
                                              "shrink it under the NIC")
    st = os.fstat(fd)
    if offset + size > st.st_size:
        raise RequestError(ReplyCode.INVALID, f"region [{offset}, {offset + size}) is outside the memfd "
                                              f"({st.st_size} bytes)")
