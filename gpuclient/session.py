"""The host client API: connect to the node's daemon, join a job, register memory, open channels.

::

    client = gpuclient.connect()                       # TRANSPORTD_SOCKET or the default socket
    session = client.join("train-42", rank=0, world=2)
    buf = gpuclient.host_array(1 << 20)                # memory the daemon can map
    region = session.register(buf)
    flags = session.flags(64)                          # this rank's flag words, signalled by peers
    session.exchange()                                 # wait until every rank's regions are known
    ch = session.channel()
    ch.put_signal(peer=1, dst_region=region.id, dst_off=0, src_region=region.id, src_off=0,
                  nbytes=4096, slot=3, value=1)
    session.wait(slot=3, at_least=1, timeout=5.0)      # on the receiving rank

Over ipc a session outlives a restart of its daemon: it re-attaches by itself with the same objects and the
same memory (:mod:`gpuclient.reattach`, docs/restart.md).
"""

from __future__ import annotations

import os
import threading
import time
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cmd_ring import RECORD_DTYPE, Flag, Opcode, RingFile, RingProducer
from cmd_ring.errors import ErrorCode
from cmd_ring.flagfile import FlagFile
from cmd_ring.protocol import Channel as ChannelRequest
from cmd_ring.protocol import Exchange, Flags, Join, Leave, Register, Stats
from gpuclient.errors import ChannelError
from gpuclient.host_memory import resolve_host_buffer
from gpuclient.launcher import from_environment
from transportd.control.client import ControlConnection

if TYPE_CHECKING:
    from gpuclient.ibgda_channel import IbgdaChannelHandle
    from ibgda.imported import ImportedDomain

__all__ = ["connect", "Client", "Session", "Region", "FlagArray", "ChannelHandle", "SignalOp"]


class SignalOp:
    ADD = "add"
    SET = "set"


def connect(socket: str | None = None, timeout: float = 5.0) -> Client:
    """Connect to the node's daemon (``socket`` > ``TRANSPORTD_SOCKET`` > the default)."""
    return Client(ControlConnection(socket, timeout_ms=int(timeout * 1000), name="gpuclient"))


class Client:
    """A connection to the daemon; ``join`` makes the session that does the work."""

    def __init__(self, conn: ControlConnection) -> None:
        self._conn = conn
        self.info = conn.hello_reply
        self._sessions: list[Session] = []  # joined through this connection (their re-attach stops with it)

    def join(self, job: str | None = None, rank: int | None = None, world: int | None = None,
             device: int | None = None, *, env: Mapping[str, str] | None = None) -> Session:
        """Join rank ``rank`` of ``job`` (``world`` ranks) on local GPU ``device`` (None: CPU only).

        With none of job, rank and world, they come from the launcher that started this process
        (torchrun, Open MPI, SLURM or ``TRANSPORTD_*``; see :mod:`gpuclient.launcher`, ``env`` defaults to
        ``os.environ``) and ``device`` defaults to the launcher's local rank. Giving some but not all of
        the three is refused: half from the caller and half from the environment is never what was meant.
        """
        given = [name for name, value in (("job", job), ("rank", rank), ("world", world)) if value is not None]
        if not given:
            info = from_environment(env)
            job, rank, world = info.job, info.rank, info.world
            device = info.device if device is None else device
        elif len(given) < 3:
            missing = sorted({"job", "rank", "world"} - set(given))
            raise TypeError(f"join() got {', '.join(given)} but not {', '.join(missing)}: pass all three, or none "
                            "to take them from the launcher's environment")
        assert job is not None and rank is not None and world is not None
        reply = self._conn.request(Join(job=job, rank=rank, world=world, device=-1 if device is None else device))
        session = Session(self._conn, job, rank, world, reply)
        session.device = device
        if self._conn.hello_reply.get("fd_socket"):  # ipc: its memory can be handed to a restarted daemon
            from gpuclient.reattach import Reattacher

            session.reattach = Reattacher(session)
        self._sessions.append(session)
        return session

    def stats(self) -> dict[str, Any]:
        return self._conn.request(Stats())

    def close(self) -> None:
        for session in self._sessions:
            if session.reattach is not None:
                session.reattach.stop()
        self._sessions.clear()
        self._conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Region:
    """A registered buffer: commands name it by ``id`` and address it by byte offset."""

    id: int
    nbytes: int


@dataclass(frozen=True)
class _Registration:
    """What a registration sent, to send again to a restarted daemon: the buffer (host: its memfd is looked up
    again) or the CUDA IPC export ``(handle, offset, size, address)``."""

    region: Region
    kind: str
    access: tuple[str, ...]
    buffer: object = None
    ipc: tuple[bytes, int, int, int] | None = None


class FlagArray:
    """This rank's flag words (monotonic 64-bit counters peers ADD to or SET)."""

    def __init__(self, flag_file: FlagFile, count: int) -> None:
        """``flag_file``: the daemon's flag array, mapped from the descriptor it handed over."""
        self._file = flag_file
        if self._file.count != count:
            raise ValueError(f"the daemon's flag array holds {self._file.count} flags, expected {count}")
        self.values = self._file.values
        self.count = count

    @property
    def status(self) -> int:
        """The session-wide error code the daemon writes (ErrorCode; 0 = fine)."""
        return self._file.status

    def __getitem__(self, slot: int) -> int:
        return int(self.values[slot])

    def __len__(self) -> int:
        return self.count


class ChannelHandle:
    """A command ring with a CPU producer: the host twin of the device API's ``tpd::Channel``.

    One producer per channel: use it from one thread.
    """

    def __init__(self, session: Session, channel_id: int, ring: RingFile) -> None:
        """``ring``: the daemon's ring, mapped from the descriptor it handed over."""
        self.id = channel_id
        self._session = session
        self.ring = ring
        self._producer = RingProducer(self.ring)
        self._record = np.zeros(1, dtype=RECORD_DTYPE)
        self.timeout = 30.0
        self._device_channel: Any = None  # gpuclient.device_channel.DeviceChannel, once device_handle() ran
        self._fd = -1  # a descriptor of the ring's memfd, passed back to a restarted daemon
        #: ``(first, end)``: ring positions a daemon that died took and never saw complete (UNKNOWN_OUTCOME)
        self.in_doubt: tuple[int, int] | None = None

    def _push(self, opcode: Opcode, *, peer: int = 0, dst_region: int = 0, dst_off: int = 0, src_region: int = 0,
              src_off: int = 0, nbytes: int = 0, chunk_id: int = 0, slot: int = 0, value: int = 0,
              flags: Flag = Flag.NONE) -> int:
        rec = self._record
        rec[0] = (0, int(opcode), int(flags), peer, src_off, dst_off, nbytes, src_region, dst_region, chunk_id,
                  slot, value)
        position = self._producer.position
        self._producer.push_records(rec, timeout=self.timeout)
        return position

    def push_records(self, records: np.ndarray) -> int:
        """Commit ready-made records (RECORD_DTYPE) as they are; returns the first one's ring position.

        For tools and tests that build records themselves — including ones the daemon must refuse.
        """
        position = self._producer.position
        self._producer.push_records(records, timeout=self.timeout)
        return position

    def put(self, peer: int, dst_region: int, dst_off: int, src_region: int, src_off: int, nbytes: int,
            chunk_id: int = 0, now: bool = False) -> int:
        """Write ``nbytes`` from our ``src_region`` to ``peer``'s ``dst_region``; returns the ring position.

        ``now``: the proxy posts it at once, with the commands before it, instead of with its connection's
        batch (which waits up to ``proxy.poll_window_us`` to fill); as for ``put_signal`` and ``signal``."""
        return self._push(Opcode.PUT, peer=peer, dst_region=dst_region, dst_off=dst_off, src_region=src_region,
                          src_off=src_off, nbytes=nbytes, chunk_id=chunk_id, flags=_post_flag(now))

    def put_signal(self, peer: int, dst_region: int, dst_off: int, src_region: int, src_off: int, nbytes: int,
                   slot: int, value: int = 1, op: str = SignalOp.ADD, chunk_id: int = 0, now: bool = False) -> int:
        """``put``, then update ``peer``'s flag ``slot`` once the payload is placed there."""
        return self._push(Opcode.PUT_SIGNAL, peer=peer, dst_region=dst_region, dst_off=dst_off,
                          src_region=src_region, src_off=src_off, nbytes=nbytes, chunk_id=chunk_id, slot=slot,
                          value=value, flags=_signal_flag(op) | _post_flag(now))

    def signal(self, peer: int, slot: int, value: int = 1, op: str = SignalOp.ADD, now: bool = False) -> int:
        """Update ``peer``'s flag ``slot`` after every earlier command to that peer is placed."""
        return self._push(Opcode.SIGNAL, peer=peer, slot=slot, value=value, flags=_signal_flag(op) | _post_flag(now))

    def fence(self, peer: int) -> int:
        """Later commands to ``peer`` are delivered after earlier ones are placed."""
        return self._push(Opcode.FENCE, peer=peer)

    def quiet(self, timeout: float | None = None) -> None:
        """Block until every command pushed so far has completed locally (raises on a channel error)."""
        position = self._push(Opcode.QUIET)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        checked = time.monotonic()
        while self.ring.completion_pos <= position:
            self.raise_for_status()
            now = time.monotonic()
            if now - checked > 0.01 or now > deadline:  # the session over on the daemon's side: not a timeout
                checked = now
                self._session._raise_if_gone()
            if now > deadline:
                raise TimeoutError(f"quiet: completion position {self.ring.completion_pos} did not pass "
                                   f"{position} in time")
            time.sleep(20e-6)
        self.raise_for_status()

    def status(self) -> tuple[int, int, int]:
        """The error word: ``(code, count, position)``, the lowest bad position and its code; code 0 means no
        error."""
        return self.ring.error

    def device_handle(self, device: int | None = None) -> Any:
        """The ``tpd::Channel`` for kernels (``.bytes``, ``.ctypes``); see ``gpuclient.device_channel``."""
        from gpuclient.device_channel import device_handle

        return device_handle(self, device)

    def raise_for_status(self) -> None:
        code, count, position = self.ring.error
        if code:
            raise ChannelError(code, count, position)


_U64_MASK = (1 << 64) - 1


def exchange_all(sessions: Iterable[Session], timeout: float = 30.0) -> None:
    """``Session.exchange`` for the ranks one process drives: every session publishes first, then each waits
    until its job is wired (a rank that waited before the others published would wait for itself)."""
    sessions = list(sessions)
    for s in sessions:
        s.exchange(wait=False)
    for s in sessions:
        s.exchange(timeout=timeout)


def _post_flag(now: bool) -> Flag:
    if not isinstance(now, bool):  # "no" would be true: refused, not guessed
        raise TypeError(f"now must be True or False, got {now!r}")
    return Flag.NO_BATCH if now else Flag.NONE


def _signal_flag(op: str) -> Flag:
    if op == SignalOp.ADD:
        return Flag.NONE
    if op == SignalOp.SET:
        return Flag.SIGNAL_SET
    raise ValueError(f"signal op must be 'add' or 'set', got {op!r}")


class Session:
    """One rank of one job on this node."""

    def __init__(self, conn: ControlConnection, job: str, rank: int, world: int, info: dict[str, Any]) -> None:
        self._conn = conn
        self.job, self.rank, self.world = job, rank, world
        self.info = info
        self.flag_array: FlagArray | None = None
        self.channels: list[ChannelHandle] = []
        self.ibgda_channels: list[IbgdaChannelHandle] = []
        self._ibgda_domains: dict[int, ImportedDomain] = {}  # rail -> the IBGDA domain imported for it
        self._keep: list[object] = []  # buffers registered: keep them mapped while the daemon uses them
        self.device: int | None = None  # the local GPU given to join (GPU buffers, device flags, handles)
        #: re-attaches this session to a restarted daemon (ipc sessions; gpuclient.reattach)
        self.reattach: Any = None
        self._control = threading.RLock()  # one control sequence at a time: a re-attach, or a call here
        self._registrations: list[_Registration] = []
        self._flags_fd = -1  # a descriptor of the flag file's memfd, and what its request said
        self._flags_request: tuple[int, str, bytes, int] = (0, "host", b"", 0)
        self._exchanged = False

    def _await_attached(self) -> None:
        """A call to the daemon waits while the session re-attaches to a restarted one (bounded by then)."""
        if self.reattach is not None:
            self.reattach.attached.wait(float(self._conn.hello_reply.get("restart_grace_s") or 0) + 30.0)

    def register(self, buffer: object, access: tuple[str, ...] = ("read", "write")) -> Region:
        """Register a buffer for RDMA; returns its region.

        ``buffer`` is a ``gpuclient.host_array`` (or a view into one), or GPU memory: a CuPy array, a
        PyTorch tensor, anything with ``__cuda_array_interface__`` or CUDA DLPack (sent to the daemon as a
        CUDA IPC handle of its allocation plus an offset; see ``gpuclient.cuda_memory``).
        """
        from gpuclient.cuda_memory import is_device_buffer

        self._await_attached()
        with self._control:
            if is_device_buffer(buffer):
                from gpuclient.cuda_memory import export_ipc, resolve_device_buffer

                gpu = export_ipc(resolve_device_buffer(buffer))
                reply = self._conn.request(Register(kind="cuda_ipc", handle=gpu.handle, offset=gpu.offset,
                                                    size=gpu.nbytes, address=gpu.address, access=tuple(access)))
                self._keep.append(buffer)
                region = Region(int(reply["region"]), gpu.nbytes)
                ipc = (gpu.handle, gpu.offset, gpu.nbytes, gpu.address)
                self._registrations.append(_Registration(region, "cuda_ipc", tuple(access), ipc=ipc))
                return region
            host = resolve_host_buffer(buffer)
            fd_id = self._conn.pass_fd(host.fd, "memfd")  # the memory itself, by descriptor: never a path
            reply = self._conn.request(Register(kind="host", handle=fd_id, offset=host.offset, size=host.nbytes,
                                                address=host.address, access=tuple(access)))
            self._keep.append(buffer)
            region = Region(int(reply["region"]), host.nbytes)
            self._registrations.append(_Registration(region, "host", tuple(access), buffer=buffer))
            return region

    @property
    def default_flags_placement(self) -> str:
        """Where :meth:`flags` puts flags without ``where=``: the daemon's answer in the join reply
        (``flags.placement``, host for a session without a GPU); host from a daemon that did not say."""
        return str(self.info.get("flags_placement", "host"))

    def flags(self, count: int, where: str | None = None) -> FlagArray:
        """Allocate this rank's ``count`` flag words (once per session).

        ``where="host"``: a host flag file the daemon creates (kernels read it mapped). ``where="device"``:
        GPU memory on this session's device, allocated here and registered by IPC handle; the daemon (or
        the remote NIC) publishes into it. ``None``: :attr:`default_flags_placement` (the daemon's
        ``flags.placement``); an explicit ``where`` always wins.
        """
        if where is None:
            where = self.default_flags_placement
        if where not in ("host", "device"):
            raise ValueError(f"where must be 'host' or 'device', not {where!r}")
        self._await_attached()
        with self._control:
            if where == "device":
                from gpuclient.device_channel import DeviceFlags, allocate_device_flags

                device = self.device if self.device is not None and self.device >= 0 else 0
                memory, handle, offset = allocate_device_flags(count, device)
                try:
                    reply = self._conn.request(Flags(count=count, where=where, handle=handle, offset=offset))
                except BaseException:
                    memory.free()
                    raise
                self.flag_array = DeviceFlags(self._take_flags(reply), count, memory)  # type: ignore[assignment]
                self._flags_request = (count, where, handle, offset)
                return self.flag_array
            reply = self._conn.request(Flags(count=count, where=where))
            self.flag_array = FlagArray(self._take_flags(reply), count)
            self._flags_request = (count, where, b"", 0)
            return self.flag_array

    def flag_slots(self, first: int, count: int, owner: str) -> None:
        """Make sure flag words ``[first, first + count)`` exist for an op (``owner`` names it in the error): a
        session without flags gets ``first + count`` of them in GPU memory (where the fused ops want them); a
        session whose flags are fewer is refused (ValueError), and one with enough keeps them."""
        if self.flag_array is None:
            self.flags(first + count, where="device")
        elif len(self.flag_array) < first + count:
            raise ValueError(f"{owner} needs flag slots [{first}, {first + count}); the session has "
                             f"{len(self.flag_array)}")

    def _take_flags(self, reply: dict[str, Any]) -> FlagFile:
        """Map the flag array the daemon made: a memfd it hands over by descriptor (no path to open). A copy
        of the descriptor is kept, to hand the same file to a restarted daemon."""
        fd = self._conn.take_fd(int(reply["fd"]), "flags")
        self._flags_fd = os.dup(fd)
        return FlagFile.from_fd(fd)

    def exchange(self, timeout: float = 30.0, wait: bool = True) -> dict[str, Any]:
        """Publish this rank's regions and flags; return once every rank of the job has done so.

        With ``wait=False`` it publishes and returns at once (``reply["complete"]`` says whether the job
        is wired yet) — for a process that drives several ranks (``exchange_all`` publishes them all, then waits).
        """
        deadline = time.monotonic() + timeout
        self._await_attached()
        while True:
            with self._control:
                reply = self._conn.request(Exchange())
                self._exchanged = True
            if reply.get("complete") or not wait:
                return reply
            if time.monotonic() > deadline:
                raise TimeoutError(f"exchange: {reply.get('known', '?')} of {self.world} ranks of job "
                                   f"{self.job!r} known after {timeout}s")
            time.sleep(0.01)

    @typing.overload
    def channel(self, capacity: int = ..., kind: typing.Literal["ring"] = ..., timeout: float = ...) -> ChannelHandle:
        ...

    @typing.overload
    def channel(self, capacity: int = ..., *, kind: typing.Literal["ibgda"], timeout: float = ...
                ) -> IbgdaChannelHandle:
        ...

    def channel(self, capacity: int | None = None, kind: str = "ring",
                timeout: float = 30.0) -> ChannelHandle | IbgdaChannelHandle:
        """Open a channel: ``kind="ring"`` (default), a command ring of ``capacity`` slots (default: the
        daemon's ``proxy.ring_capacity``) drained by the daemon's proxy; ``kind="ibgda"``, one queue pair
        per peer rank of ``capacity`` WQEs (256) that kernels post to themselves (``gpuclient.ibgda_channel``;
        exchange first). Both hand kernels the same calls through ``device_handle()``."""
        self._await_attached()
        with self._control:
            return self._channel(capacity, kind, timeout)

    def _channel(self, capacity: int | None, kind: str, timeout: float) -> ChannelHandle | IbgdaChannelHandle:
        if kind == "ibgda":
            from gpuclient.ibgda_channel import open_channel

            ibgda = open_channel(self, capacity or 256, timeout)
            self.ibgda_channels.append(ibgda)
            return ibgda
        if kind != "ring":
            raise ValueError(f"channel kind must be 'ring' or 'ibgda', not {kind!r}")
        reply = self._conn.request(ChannelRequest(capacity=capacity or 0))
        fd = self._conn.take_fd(int(reply["fd"]), "ring")  # by descriptor: no path
        keep = os.dup(fd)  # for a restarted daemon: the same ring, passed back
        ring = RingFile.from_fd(fd)
        ch = ChannelHandle(self, int(reply["channel"]), ring)
        ch._fd = keep
        self.channels.append(ch)
        return ch

    def wait(self, slot: int, at_least: int, timeout: float = 30.0) -> int:
        """Wait until flag ``slot`` reaches ``at_least`` (wraparound-safe); returns the value seen.

        Raises :class:`ChannelError` if the daemon reports an error for this session (a lost peer, say)
        instead of waiting forever. Per-command errors stay in each channel's error word
        (``ch.status()``, raised by ``ch.quiet()``): they do not interrupt waits on unrelated flags.
        """
        flags = self.flag_array
        if flags is None:
            raise RuntimeError("call session.flags(count) before waiting on a flag")
        if not 0 <= slot < flags.count:
            raise IndexError(f"flag slot {slot} out of range (this session has {flags.count})")
        target = at_least & _U64_MASK
        deadline = time.monotonic() + timeout
        checked = time.monotonic()
        pause = 0.0
        while True:
            value = int(flags.values[slot])
            if (value - target) & _U64_MASK < 1 << 63:  # signed difference >= 0: wraparound-safe
                return value
            if flags.status:
                raise ChannelError(flags.status)
            now = time.monotonic()
            if now - checked > 0.01:  # a daemon killed outright writes no status word: its socket says it
                checked = now
                self._raise_if_gone()
            if now > deadline:
                raise TimeoutError(f"flag {slot} is {int(value)}, still below {at_least} after {timeout}s")
            time.sleep(pause)
            pause = min(pause * 2 or 1e-6, 1e-3)

    def stats(self) -> dict[str, Any]:
        return self._conn.request(Stats())

    def _raise_if_gone(self) -> None:
        """ChannelError(CLIENT_GONE) when the daemon ended this session, or stopped (died) and no next daemon
        took the session back within its restart grace period."""
        flags = self.flag_array
        if flags is not None and flags.status == ErrorCode.CLIENT_GONE:
            raise ChannelError(flags.status)
        if self.reattach is not None:
            if self.reattach.state == "gone":
                raise ChannelError(int(ErrorCode.CLIENT_GONE))
            return  # a daemon that went away is being waited for (gpuclient.reattach)
        if self._conn.daemon_gone():
            raise ChannelError(int(ErrorCode.CLIENT_GONE))

    def leave(self) -> None:
        """Leave the job; the daemon reclaims this session's rings, regions and flags."""
        self._await_attached()
        if self.reattach is not None:
            self.reattach.stop()
        with self._control:
            for ibgda in list(self.ibgda_channels):  # the queue pairs this process built, and their far ends
                ibgda.close()
            if self.reattach is None or self.reattach.state != "gone":
                self._conn.request(Leave())
            self._release()

    def _release(self) -> None:
        for fd in [self._flags_fd] + [ch._fd for ch in self.channels]:
            if fd >= 0:
                os.close(fd)
        self._flags_fd = -1
        for ch in self.channels:
            # unregister the ring (and flags) from CUDA before unmapping them: a registration left behind
            # would outlive the mapping, and a later ring mapped at the same address would be handed the
            # stale registration's pages (kernels would write where no proxy reads)
            device = ch._device_channel
            if device is not None:
                device.release()
                ch._device_channel = None
            ch.ring.close()
        self.channels.clear()
        self.ibgda_channels.clear()
        if self._ibgda_domains:
            from gpuclient.ibgda_channel import close_domains

            close_domains(self)
