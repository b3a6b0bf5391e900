"""``transportctl selftest`` in the daemon: the near daemon's side of each test, and the far daemon's rank.

Near side (control op ``selftest``): list the links, start a test on a peer (``peer_selftest``), ask it to
finish, hand back what it reported. Far side (``peer_selftest``): join rank 1 of the test's job with
memory, flags and a ring of the daemon's own and echo (:class:`transportd.ops.selftest.EchoResponder`);
on ``finish``, report and leave. The rules both sides follow live in :mod:`transportd.ops.selftest`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from cmd_ring.shm import map_fd, sealed_memfd
from transportd.control.protocol import PeerSelftest, PeerSelftestReport, ReplyCode, Selftest
from transportd.daemon.memory import HostBuffer, RankMemory
from transportd.daemon.peering import Peering
from transportd.daemon.state import JobState, LocalRank, NodeState, memfd_name
from transportd.dataplane.flagfile import FlagFile
from transportd.errors import RequestError, WorkerError
from transportd.ops.selftest import REGION_BYTES, SLOTS, EchoResponder

__all__ = ["MAX_SELFTESTS", "SelftestJobs"]

log = logging.getLogger("transportd")

MAX_SELFTESTS = 16  # self-test jobs at once, each side (each holds ~1.2 MiB, a ring and a thread on the far side)
FAR_RING_RECORDS = 256  # the far side's echoes: one record per flag it sees


class SelftestJobs:
    """Both sides' tests on this node: ``near`` (job -> {"node", "report", "error"}) and ``far``
    (job -> (its rank, its echo)). ``release`` frees a rank as a leaving client's is freed."""

    def __init__(self, state: NodeState, peering: Peering, memory: RankMemory,
                 release: Callable[[LocalRank], None]) -> None:
        self.state = state
        self.peering = peering
        self.memory = memory
        self.release = release
        self.near: dict[str, dict[str, Any]] = {}
        self.far: dict[str, tuple[LocalRank, EchoResponder]] = {}

    # --- near side -------------------------------------------------------------------------------------
    def request(self, req: Selftest) -> dict[str, Any]:
        """The control op (its session vouched for already): ``links``, ``start``, ``finish``, ``status``."""
        state, plane = self.state, self.state.plane
        if req.action == "links":
            links = [{"node": node, "up": p.up, "rails": p.rails, "backend": p.backend,
                      "why": "" if p.up else "peer is down (stopped, said goodbye, or stopped answering heartbeats)"}
                     for node, p in sorted(plane.peers.items())]
            links += [{"node": address, "up": False, "rails": 0, "backend": "",
                       "why": "no hello from this static peer: not running, unreachable, or its CURVE handshake "
                              "failed (a key missing from, or wrong in, security.curve_authorized_keys_dir)"}
                      for address in plane.unreached()]
            return {"node": state.node, "rails": len(state.workers), "backend": state.config.backend.kind,
                    "signal_mode": state.config.signal.mode, "decoupled": state.config.signal.decoupled,
                    "links": links}
        if req.action == "start":
            peer = plane.peers.get(req.node)
            if peer is None or not peer.up:
                raise RequestError(ReplyCode.UNREACHABLE, f"peer {req.node} is not up")
            rails = len(state.workers)
            if req.rail >= min(rails, peer.rails or rails):
                raise RequestError(ReplyCode.INVALID, f"rail {req.rail}: this node has {rails} and "
                                                      f"{req.node} has {peer.rails}")
            if req.job in self.near or req.job in state.jobs:
                raise RequestError(ReplyCode.INVALID, f"job {req.job!r} exists")
            if len(self.near) >= MAX_SELFTESTS:
                raise RequestError(ReplyCode.BUSY, f"{MAX_SELFTESTS} self-tests are running on node {state.node}")
            self.near[req.job] = {"node": req.node, "report": None, "error": ""}
            plane.send(req.node, PeerSelftest(action="start", job=req.job, rail=req.rail, seed=req.seed))
            return {}
        test = self.near.get(req.job)
        if test is None:
            raise RequestError(ReplyCode.NOT_FOUND, f"no self-test {req.job!r} on node {state.node}")
        if req.action == "finish":
            if not plane.send(test["node"], PeerSelftest(action="finish", job=req.job)) and not test["error"]:
                test["error"] = f"peer {test['node']} is not reachable"
            return {}
        if test["report"] is not None or test["error"]:
            del self.near[req.job]  # delivered: nothing of it stays behind
        return {"report": test["report"], "error": test["error"]}

    def on_report(self, node: str, msg: PeerSelftestReport) -> None:
        """What the far side of one of our tests saw (or why it could not take part)."""
        test = self.near.get(msg.job)
        if test is not None and test["node"] == node:
            test["report"], test["error"] = (None, msg.error) if msg.error else (dict(msg.report), "")

    # --- far side --------------------------------------------------------------------------------------
    def on_peer_selftest(self, node: str, msg: PeerSelftest) -> None:
        """``start``: join rank 1 and echo; ``finish``: report and leave."""
        plane = self.state.plane
        if msg.action == "finish":
            found = self.far.get(msg.job)
            if found is not None and found[1].requester == node:
                report = self.end_far(msg.job)
                plane.send(node, PeerSelftestReport(job=msg.job, report=report))
            return
        try:
            self._start_far(node, msg)
        except (WorkerError, RequestError, OSError) as exc:
            log.warning("self-test %s from %s: %s", msg.job, node, exc)
            plane.send(node, PeerSelftestReport(job=msg.job, report={}, error=str(exc)[:1000]))

    def _start_far(self, node: str, msg: PeerSelftest) -> None:
        state = self.state
        if msg.job in state.jobs or msg.job in self.far:
            raise RequestError(ReplyCode.INVALID, f"job {msg.job!r} exists on node {state.node}")
        if len(self.far) >= MAX_SELFTESTS:
            raise RequestError(ReplyCode.BUSY, f"{MAX_SELFTESTS} self-tests are running on node {state.node}")
        if msg.rail >= len(state.workers):
            raise RequestError(ReplyCode.INVALID, f"rail {msg.rail}: node {state.node} has {len(state.workers)}")
        rank = LocalRank(b"selftest:" + msg.job.encode(), msg.job, 1, 2, -1, msg.rail)
        job = state.jobs[msg.job] = JobState(world=2, owner=f"selftest:{node}")
        job.local[1] = rank
        try:
            # the region is a memfd of the daemon's own, mapped here for the echo and in every worker
            fd = sealed_memfd(memfd_name("selftest", rank.job), REGION_BYTES)
            try:
                memory = np.frombuffer(map_fd(fd).mm, dtype=np.uint8)
                # the rank's first region: id 0, FAR_REGION, where the near side's puts land
                self.memory.add_region(rank, HostBuffer(fd), 0, REGION_BYTES, ("write", "read"), "selftest")
            finally:
                os.close(fd)
            rank.flags, fd = FlagFile.create_memfd(SLOTS, name=memfd_name("flags", rank.job, rank.rank))
            try:
                self.memory.map_flags(rank, fd, SLOTS)
            finally:
                os.close(fd)  # the workers and our own mapping hold it
            channel_id, ring, fd = self.memory.add_ring(rank, FAR_RING_RECORDS)
            os.close(fd)  # the rail worker and our own mapping hold it
            rank.channels[channel_id] = ring
        except BaseException:
            self.release(rank)
            raise
        echo = EchoResponder(msg.job, node, msg.seed, memory, rank.flags, ring)
        self.far[msg.job] = (rank, echo)
        rank.announced = True
        state.plane.send(node, self.peering.regions_message(rank))
        self.peering.refresh_job(msg.job)
        log.info("self-test %s for %s: rank 1 joined on rail %d", msg.job, node, msg.rail)

    def job_refreshed(self, job_name: str) -> None:
        """A far-side job's wiring moved: once rank 1 reaches rank 0, its echoes may go."""
        far = self.far.get(job_name)
        if far is not None and not far[1].wired.is_set() and self.peering.job_wired(far[0]):
            far[1].wired.set()

    def end_far(self, job_name: str) -> dict[str, Any]:
        """Stop the echo, leave the job, and return what the echo saw."""
        rank, echo = self.far.pop(job_name)
        report = echo.stop()  # before the ring and flags go away under it
        self.release(rank)
        return report

    def expire(self) -> None:
        """Leave the far-side tests whose near side never finished them (it died)."""
        for job_name in [j for j, (_, echo) in self.far.items() if echo.expired]:
            log.warning("self-test %s: the near side never finished it; leaving", job_name)
            self.end_far(job_name)

    # --- both ------------------------------------------------------------------------------------------
    def peer_down(self, node: str) -> None:
        """Our tests on ``node`` fail; the tests ``node`` asked us for end."""
        for test in self.near.values():
            if test["node"] == node and test["report"] is None and not test["error"]:
                test["error"] = f"peer {node} went down"
        for job_name in [j for j, (_, echo) in self.far.items() if echo.requester == node]:
            self.end_far(job_name)

    def close(self) -> None:
        """The daemon stops: end every far-side test."""
        for job_name in list(self.far):
            self.end_far(job_name)
