"""A session that outlives its daemon: when the node's daemon restarts, the client re-attaches by itself.

A daemon that stops hands its jobs over (docs/restart.md): it drains what it took from the rings, publishes
each ring's consumer position in the ring, and exits without ending any session. Everything a kernel
touches is memory this process holds (the rings and the flag file are memfds it took by descriptor, host
buffers are its own memfds, GPU buffers its own allocations), so a new daemon can serve the very same
memory. :class:`Reattacher` watches the session's descriptor connection (the kernel closes it the moment
the daemon's end goes) and, in the background, greets the next daemon at the same endpoint and sends it
everything again, in the order the session first did:

1. ``hello`` and ``vouch`` on a fresh socket, then ``join`` the same job, rank and rail (``resume``);
2. every region again, by the same descriptor or CUDA IPC handle, under the id it had (``Register.id``);
3. the flag file the earlier daemon made, passed back (``Flags.adopt``): counters as they are;
4. ``exchange`` (if the session had exchanged) until the job is wired again: peers re-wire to the new
   daemon's keys while region ids and flag slots stay what kernels were built with;
5. each ring, passed back (``Channel.adopt``): the new daemon drains it from the published consumer
   position. Records an earlier daemon took but never saw complete (a crash) come back as UNKNOWN_OUTCOME
   in the ring's error word, from the first of them; the handle's ``in_doubt`` says which.

Nothing is asked of the application: its ``Session``, ``FlagArray``, ``ChannelHandle`` and ``Region``
objects stay valid, a producer that keeps pushing meets backpressure until step 5, ``session.wait`` and
``ch.quiet`` keep waiting. IBGDA channels do not survive (their queue pairs and the peers' keys live in the
kernels' handles): they report CHANNEL_LOST; open new ones. A daemon that does not come back within its
``peers.restart_grace_s`` (what its hello said), or refuses the re-attach, ends the session:
``ChannelError(CLIENT_GONE)`` as before. The daemon ending a session itself (it writes CLIENT_GONE into the
status word first) is not a restart: nothing is re-attached then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

from cmd_ring.errors import ErrorCode, TransportdError
from cmd_ring.protocol import Channel as ChannelRequest
from cmd_ring.protocol import Exchange, Flags, Join, Register

if TYPE_CHECKING:
    from gpuclient.session import Session

__all__ = ["Reattacher"]

log = logging.getLogger("gpuclient")

POLL_S = 0.01  #: how often the watcher looks at the descriptor connection (a poll of one socket)
RETRY_S = 0.02  #: between attempts to greet the next daemon
HELLO_TIMEOUT_MS = 500  #: one attempt's bound (a daemon still starting answers on its next poll)


class Reattacher:
    """Watches one session's daemon and re-attaches the session to the next one (module doc).

    ``state``: ``attached``, ``reattaching`` or ``gone`` (no daemon came back in time, or it refused us);
    ``count`` re-attaches so far; ``pauses`` how long each took, from the daemon's end closing to the last
    ring adopted; ``error`` why the last attempt failed.
    """

    def __init__(self, session: Session) -> None:
        self._session = weakref.ref(session)
        self.state = "attached"
        self.count = 0
        self.pauses: list[float] = []
        self.error: str | None = None
        self.attached = threading.Event()
        self.attached.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transportd-reattach", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching (the session leaves or its client closes); waits for an attempt under way."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            session = self._session()
            if session is None or session._conn.closed:
                return
            if not session._conn.daemon_gone():
                continue
            flags = session.flag_array
            if flags is not None and flags.status == ErrorCode.CLIENT_GONE:
                self.state = "gone"  # the daemon ended this session itself: not a restart
                return
            self._reattach(session)
            if self.state == "gone":
                return
            del session

    def _reattach(self, session: Session) -> None:
        t0 = time.monotonic()
        grace = float(session._conn.hello_reply.get("restart_grace_s") or 0.0)
        deadline = t0 + grace
        self.state = "reattaching"
        self.attached.clear()
        log.info("job %s rank %d: the daemon went away; re-attaching to its next life (up to %.1fs)",
                 session.job, session.rank, grace)
        try:
            with session._control:
                while True:
                    if self._stop.is_set() or session._conn.closed:
                        return
                    try:
                        _greet(session)
                        break
                    except TransportdError as exc:  # no daemon yet (or still the old one going away)
                        self.error = str(exc)
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(RETRY_S)
                _resend(session, deadline)  # joined the next life: a failure now is final
            self.count += 1
            self.pauses.append(time.monotonic() - t0)
            self.state = "attached"
            log.info("job %s rank %d re-attached in %.3fs", session.job, session.rank, self.pauses[-1])
        except (TransportdError, OSError, TimeoutError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "gone"
            log.warning("job %s rank %d: could not re-attach (%s): the session is over", session.job,
                        session.rank, self.error)
        finally:
            self.attached.set()


def _greet(session: Session) -> None:
    """hello + vouch to whatever daemon answers at the session's endpoint now, then join as before."""
    conn = session._conn
    path = conn.endpoint[len("ipc://"):] if conn.endpoint.startswith("ipc://") else ""
    if path and not path.startswith("@") and not os.path.exists(path):
        raise TransportdError(f"no daemon at {conn.endpoint} yet")
    conn.reconnect(timeout_ms=HELLO_TIMEOUT_MS)
    reply = conn.request(Join(job=session.job, rank=session.rank, world=session.world,
                              device=-1 if session.device is None else session.device,
                              rail=int(session.info.get("rail", -1)), resume=True))
    session.info = {**session.info, **reply}


def _resend(session: Session, deadline: float) -> None:
    """Regions under their ids, the flag file, the exchange, then the rings (module doc, steps 2-5)."""
    conn = session._conn
    for reg in session._registrations:
        if reg.kind == "host":
            from gpuclient.host_memory import resolve_host_buffer

            host = resolve_host_buffer(reg.buffer)
            handle: object = conn.pass_fd(host.fd, "memfd")
            offset, size, address = host.offset, host.nbytes, host.address
        else:
            handle, offset, size, address = reg.ipc
        conn.request(Register(kind=reg.kind, handle=handle, offset=offset, size=size, address=address,
                              access=reg.access, id=reg.region.id))
    flags = session.flag_array
    if flags is not None:
        count, where, handle, offset = session._flags_request
        fd_id = conn.pass_fd(session._flags_fd, "memfd")
        conn.request(Flags(count=count, where=where, handle=handle, offset=offset, adopt=fd_id))
    if session._exchanged:
        while not conn.request(Exchange()).get("complete"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job {session.job!r} was not wired again within the restart grace period")
            time.sleep(0.005)
    for ch in session.channels:
        fd_id = conn.pass_fd(ch._fd, "memfd")
        reply = conn.request(ChannelRequest(adopt=fd_id, id=ch.id))
        ch.id = int(reply["channel"])
        first, end = (int(x) for x in reply.get("in_doubt", (0, 0)))
        if end > first:
            ch.in_doubt = (first, end)
    for ibgda in session.ibgda_channels:
        ibgda.mark_lost()
    # the domains imported from the earlier daemon died with it (each lost channel keeps its own): the next
    # IBGDA channel imports the new daemon's
    session._ibgda_domains.clear()
