"""Trace record (``transportctl trace start|stop``): the daemon's side of docs/trace.md.

``start`` asks every rail worker to record what a local rank's channels take (the engine writes a part
file per channel into a private directory of this process's); ``stop`` ends it in every worker, merges
the parts into one trace file in an anonymous memfd and offers that to the client by descriptor, so the
daemon never writes into a path a client names (``out`` is only echoed back, for the client to write).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from transportd.control.fdsocket import SideConnection
from transportd.control.protocol import ReplyCode, TraceStart, TraceStop
from transportd.daemon.clients import Identity
from transportd.daemon.state import NodeState
from transportd.dataplane import link_messages as link
from transportd.dataplane.trace import merge_parts
from transportd.errors import RequestError, WorkerError

__all__ = ["Tracing"]

log = logging.getLogger("transportd")


@dataclass
class _Active:
    directory: str
    out: str
    principal: str
    started: float


class Tracing:
    """The traces running on this node, by (job, rank)."""

    def __init__(self, state: NodeState) -> None:
        self.state = state
        self.active: dict[tuple[str, int], _Active] = {}

    def _check(self, ident: Identity, job_name: str, rank: int) -> None:
        job = self.state.jobs.get(job_name)
        if job is not None and not ident.may_touch(job):
            raise RequestError(ReplyCode.FORBIDDEN, f"job {job_name!r} on node {self.state.node} belongs to another "
                                                    "user")
        if job is None or rank not in job.local:
            raise RequestError(ReplyCode.NOT_FOUND,
                               f"rank {rank} of job {job_name!r} is not joined on node {self.state.node}")

    def start(self, ident: Identity, req: TraceStart) -> dict[str, Any]:
        key = (req.job, req.rank)
        if key in self.active:
            raise RequestError(ReplyCode.EXISTS,
                               f"rank {req.rank} of job {req.job!r} is traced already (stop it first)")
        self._check(ident, req.job, req.rank)
        directory = tempfile.mkdtemp(prefix="transportd-trace-")
        started: list[int] = []
        try:
            channels = 0
            for rail, worker in enumerate(self.state.workers):
                reply = worker.call(link.TraceStart(job=req.job, rank=req.rank, prefix=f"{directory}/rail{rail}"))
                started.append(rail)
                channels += len(reply.channels)
        except (WorkerError, RequestError) as exc:
            for rail in started:
                self._stop_worker(rail, req.job, req.rank)
            shutil.rmtree(directory, ignore_errors=True)
            raise RequestError(ReplyCode.FAILED, f"trace start: {exc}") from None
        self.active[key] = _Active(directory, req.out, ident.principal, time.time())
        log.info("trace of job %s rank %d started (%d channels)", req.job, req.rank, channels)
        return {"job": req.job, "rank": req.rank, "channels": channels, "out": req.out}

    def _stop_worker(self, rail: int, job: str, rank: int) -> dict[str, Any] | None:
        try:
            return self.state.workers[rail].call(link.TraceStop(job=job, rank=rank))
        except WorkerError as exc:
            log.warning("trace stop on rail %d: %s", rail, exc)
            return None

    def stop(self, ident: Identity, conn: SideConnection, req: TraceStop) -> dict[str, Any]:
        key = (req.job, req.rank)
        active = self.active.get(key)
        if active is None:
            raise RequestError(ReplyCode.NOT_FOUND, f"rank {req.rank} of job {req.job!r} is not traced on node "
                                                    f"{self.state.node}")
        if not ident.superuser and ident.principal != active.principal:
            raise RequestError(ReplyCode.FORBIDDEN, "another user started this trace")
        del self.active[key]
        try:
            stopped = [(rail, r) for rail in range(len(self.state.workers))
                       if (r := self._stop_worker(rail, req.job, req.rank)) is not None]
            context: dict[str, Any] = dict(stopped[0][1]["context"]) if stopped else {}
            context["channels"] = {cid: {**info, "rail": rail} for rail, r in stopped
                                   for cid, info in r["context"]["channels"].items()}
            context["node"] = self.state.node
            parts = [p for _, r in stopped for p in r["parts"]]
            start_mono = min((r["start_mono_ns"] for _, r in stopped), default=0)
            start_wall = min((r["start_wall_ns"] for _, r in stopped), default=0)
            fd = os.memfd_create(f"transportd-trace-{req.job}-{req.rank}", os.MFD_CLOEXEC)
            try:
                with open(fd, "wb", closefd=False) as f:
                    entries = merge_parts(f, parts, context, start_mono, start_wall)
                os.lseek(fd, 0, os.SEEK_SET)
                fd_id = conn.offer(fd, "trace")  # the offer owns fd now
            except BaseException:
                os.close(fd)
                raise
        finally:
            shutil.rmtree(active.directory, ignore_errors=True)
        dropped = sum(int(r["dropped"]) for _, r in stopped)
        errors = [e for _, r in stopped for e in r["write_errors"]]
        log.info("trace of job %s rank %d stopped: %d entries, %d dropped", req.job, req.rank, entries, dropped)
        return {"job": req.job, "rank": req.rank, "fd": fd_id, "entries": entries, "dropped": dropped,
                "write_errors": errors, "out": active.out, "rails": len(stopped)}

    def close(self) -> None:
        """The daemon stops: recordings end with it, their parts go."""
        for active in self.active.values():
            shutil.rmtree(active.directory, ignore_errors=True)
        self.active.clear()
