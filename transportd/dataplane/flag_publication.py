"""How a rail's worker publishes flags into GPU memory without a CUDA context switch (``flags.publication``),
and the one publisher it calls (:class:`RailFlags`).

On efa the receiving daemon, not the NIC, writes a flag once every piece it covers arrived (docs/design.md,
"Flags follow their data"). Host flag files are plain stores into host memory the GPU maps. GPU flag words need a way in
from a host thread, and the obvious one — ``cuMemcpyHtoD`` in the daemon's own CUDA context — waits for
a time slice of that context while the client's kernel is resident: 2.38 ms per copy on the H200. So each
rail picks, at start, by what the node has (:func:`choose_publication`):

``gdrcopy``
    ``libgdrapi`` (:class:`~transportd.dataplane.gpu_memory.GdrCopy`) where the ``gdrdrv`` module is loaded
    (its device node exists): the flag pages are pinned and mapped into the worker through the GPU's BAR
    and the compiled data path stores into them as it stores host flags — how NCCL, NVSHMEM and MSCCL++
    reach GPU memory from a host thread.
``loopback``
    an RDMA write through the rail's own NIC into the GPU flag word (GPUDirect), where there is no
    gdrdrv. Over softverbs this is a real loopback QP write into memory registered with the GPU accessor.
``host-mapped``
    neither is possible: ``session.flags()`` defaults to host flags (pinned host memory mapped into the
    GPU) on this node; a client that asks for device flags explicitly gets ``cuda-copy``.
``cuda-copy``
    copies through the daemon's CUDA context, posted at the end of each poll and waited for by nobody
    (:meth:`GpuFlagWords._post_copies`); a flag lands when its copy runs. The log says what that costs.

Every path keeps a host shadow of each counter (the rank's host flag file, shared by the rails' workers):
an ADD is one atomic add on the shadow and one store (or write) of the new value, never a read of GPU
memory. Rails whose NIC writes flags itself (ib) report ``nic``.

:class:`RailFlags` holds a rail's flag arrays (host flag files, and GPU flag words: :class:`GpuFlagWords`)
and is the backend's publisher: the worker maps and drops arrays through it, and the backend hands it
each flag that arrived (and the end of each poll).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transportd import _core
from transportd.backends import traits_of
from transportd.backends.interface import MemoryKey, SignalOp
from transportd.dataplane.flagfile import FlagFile
from transportd.dataplane.gpu_memory import GdrCopy, GpuMemory, IpcRegion
from transportd.errors import GdrCopyError

__all__ = [
    "COPY_COST",
    "CUDA_COPY",
    "GDRCOPY",
    "HOST_MAPPED",
    "LOOPBACK",
    "NIC",
    "GpuFlagWords",
    "PublicationChoice",
    "RailFlags",
    "choose_publication",
    "words_path",
]

log = logging.getLogger("transportd.flags")

GDRCOPY, LOOPBACK, HOST_MAPPED, CUDA_COPY, NIC = "gdrcopy", "loopback", "host-mapped", "cuda-copy", "nic"

#: What the last resort costs, for the log line that announces it.
COPY_COST = ("each flag is a copy through the daemon's CUDA context, which runs only in a time slice of that "
             "context while the client's kernel runs: 2.38 ms per flag measured on an H200 without CUDA MPS (the "
             "worker does not wait for it; under MPS the copies run beside the kernel); load gdrdrv (GDRCopy) or "
             "use host flags to avoid it")


@dataclass
class PublicationChoice:
    """A rail's choice: ``path`` (one of the module's names), why, and whether the config forced it."""

    path: str
    reason: str
    forced: bool = False
    gdr: GdrCopy | None = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "forced": self.forced}

    def close(self) -> None:
        """Close libgdrapi (after the backend: its compiled path stores through the mappings until then)."""
        if self.gdr is not None:
            self.gdr.close()


def choose_publication(setting: str, *, receiver_publishes: bool, loopback: str | None, gdrdrv_device: str,
                       gdrcopy_library: str = "") -> PublicationChoice:
    """Pick the rail's path for ``flags.publication = setting``.

    ``receiver_publishes``: the backend publishes flags at the receiver (efa); else the NIC writes them
    (``nic``). ``loopback``: None where the backend can write into its own registered memory through its
    NIC, else why not. A forced path that cannot work raises :class:`ValueError` naming why.
    """
    if not receiver_publishes:
        return PublicationChoice(NIC, "the sender's NIC writes the flags (RDMA write or atomic)")
    forced = setting != "auto"

    def gdr() -> PublicationChoice | str:
        if not os.path.exists(gdrdrv_device):
            return f"{gdrdrv_device} is absent (the gdrdrv kernel module is not loaded)"
        try:
            lib = GdrCopy(gdrcopy_library)
        except GdrCopyError as exc:
            return str(exc)
        return PublicationChoice(GDRCOPY, f"gdrdrv at {gdrdrv_device}, {lib.library}: GPU flag pages mapped through "
                                    "the BAR, published by CPU stores", forced, lib)

    if setting in ("auto", GDRCOPY):
        got = gdr()
        if isinstance(got, PublicationChoice):
            return got
        if forced:
            raise ValueError(f"flags.publication = \"gdrcopy\": {got}")
        no_gdr = got
    if setting in ("auto", LOOPBACK):
        if loopback is None:
            why = "RDMA write through the rail's own NIC into the GPU flag words"
            return PublicationChoice(LOOPBACK, why if forced else f"no GDRCopy ({no_gdr}); {why}", forced)
        if forced:
            raise ValueError(f"flags.publication = \"loopback\": {loopback}")
    if setting == CUDA_COPY:
        return PublicationChoice(CUDA_COPY, "forced by flags.publication: " + COPY_COST, True)
    if setting in ("auto", HOST_MAPPED):
        why = ("flags default to host memory mapped into the GPU; device flags asked for explicitly fall back "
               "to cuda-copy")
        if not forced:
            why = f"no GDRCopy ({no_gdr}), no loopback write ({loopback}); {why}"
        return PublicationChoice(HOST_MAPPED, why, forced)
    raise ValueError(f"unknown flags.publication {setting!r}")


def words_path(path: str) -> str:
    """How a rail on ``path`` publishes GPU flag words a client registered: its own path where it has one
    into GPU memory; else (``host-mapped``: device flags asked for explicitly) ``cuda-copy``. On ``nic``
    rails the sender's NIC writes them and the worker never publishes; ``cuda-copy`` stands by."""
    return path if path in (GDRCOPY, LOOPBACK, CUDA_COPY) else CUDA_COPY


class GpuFlagWords:
    """A rank's ``count`` flag words at ``address`` (GPU memory opened in this worker) and how they are
    published: ``path`` is ``gdrcopy`` (``mapping`` holds the BAR mapping; the backend's compiled path
    stores, :meth:`publish` is not called), ``loopback`` (``loopback``: the rail's
    :class:`~efa.loopback.LoopbackWriter`; :meth:`end_pass` writes what :meth:`publish` queued) or
    ``cuda-copy`` (``accessor``: a :class:`~transportd.dataplane.gpu_memory.GpuAccessor`, whose
    ``post_words`` copies the words in order without waiting; :meth:`end_pass` posts what :meth:`publish`
    queued).

    ``shadow``: the host words holding each counter's current value (the rank's flag file, mapped in
    every rail worker, which all publish through it). ``rkey`` is set once the words are registered.
    ``region``, released with the words, is the IPC mapping (None where the caller owns the memory).
    """

    def __init__(self, address: int, count: int, shadow: Any, path: str, *, region: IpcRegion | None = None,
                 accessor: Any = None, loopback: Any = None, mapping: Any = None) -> None:
        if path not in (GDRCOPY, LOOPBACK, CUDA_COPY):
            raise ValueError(f"GPU flag words cannot be published by {path!r}")
        self.region = region
        self.accessor = accessor
        self.count = count
        self.address = address
        self.nbytes = 8 * count
        self.shadow = shadow
        self.path = path
        self.loopback = loopback
        self.mapping = mapping
        self.rkey = 0
        self._dirty: dict[int, None] = {}  # slots whose shadow moved since their last write
        self._inflight: dict[int, int] = {}  # loopback: slot -> the value its write on the wire carries
        self._posted: deque[tuple[int, dict[int, int]]] = deque()  # cuda-copy: (ticket, slot -> value), in order
        self._latest: dict[int, int] = {}  # cuda-copy: slot -> the ticket of the last batch that carries it
        self.copies = 0

    def publish(self, slot: int, op: SignalOp, value: int) -> None:
        """Apply one update to the shadow and queue the slot: :meth:`end_pass` writes it."""
        _core.flag_shadow_publish(0, self.shadow.address + 8 * slot, int(op), value)
        self._dirty[slot] = None

    @property
    def busy(self) -> bool:
        """A write is owed, on the wire (loopback) or not yet landed (cuda-copy)."""
        return bool(self._dirty or self._inflight or self._posted)

    @property
    def inflight(self) -> int:
        """Loopback: writes on the wire."""
        return len(self._inflight)

    def end_pass(self) -> None:
        """Write each queued slot's current shadow value: by :meth:`_post_copies` (cuda-copy), or (loopback) by a
        write posted now, except for a slot whose last write is still on the wire (SRD may deliver two writes
        of one word in either order): it goes once that one completed (:meth:`written`)."""
        if self.path == CUDA_COPY:
            self._post_copies()
            return
        ready = [s for s in self._dirty if s not in self._inflight]
        if not ready:
            return
        values = self.shadow.values
        writes = []
        for s in ready:
            del self._dirty[s]
            value = self._inflight[s] = int(values[s])
            writes.append((self, s, self.address + 8 * s, self.rkey, value))
        try:
            self.loopback.post(writes)
        except BaseException:
            for s in ready:  # still owed: fall_back_to_copy writes them
                del self._inflight[s]
                self._dirty[s] = None
            raise

    def _post_copies(self) -> None:
        """cuda-copy: post the queued slots' shadow values as one batch of word copies, which land in order
        behind the earlier batches (nothing waits for them). A batch that landed with a value the shadow has
        since passed, and no later batch of this worker carrying the slot, is written again: another rail's
        worker publishes through the same shadow, and its copy of the newer value may have landed first."""
        values = self.shadow.values
        posted = self._posted
        while posted and self.accessor.landed(posted[0][0]):
            ticket, carried = posted.popleft()
            for s, value in carried.items():
                if self._latest.get(s) == ticket:
                    del self._latest[s]
                    if int(values[s]) != value:
                        self._dirty[s] = None
        if not self._dirty:
            return
        slots = sorted(self._dirty)
        carried = {s: int(values[s]) for s in slots}
        ticket = self.accessor.post_words([(self.address + 8 * s, carried[s]) for s in slots])
        self._dirty = {}
        posted.append((ticket, carried))
        for s in slots:
            self._latest[s] = ticket
        self.copies += len(slots)

    def written(self, slot: int, value: int) -> None:
        """Loopback: the write of ``value`` into ``slot`` completed; write again if the shadow moved meanwhile
        (another rail's worker publishes through it too)."""
        self._inflight.pop(slot, None)
        if int(self.shadow.values[slot]) != value:
            self._dirty[slot] = None

    def wait_landed(self) -> None:
        """cuda-copy: wait for the batches posted so far (the words' memory is about to go); owed slots are
        dropped with them."""
        self._dirty = {}
        if self._posted:
            self.accessor.wait_landed(self._posted[-1][0])
            self._posted.clear()
            self._latest.clear()

    def fall_back_to_copy(self, accessor: Any) -> None:
        """The loopback path failed: publish by copies from now on, starting with the slots still queued."""
        self.path, self.accessor = CUDA_COPY, accessor
        accessor.open_word_ring()
        self._dirty = dict.fromkeys([*self._dirty, *self._inflight])
        self._inflight = {}
        self._post_copies()

    def release(self) -> None:
        if self.mapping is not None:
            self.mapping.release()  # unmap the BAR pages before the memory they map goes
            self.mapping = None
        if self.region is not None:
            self.region.release()
        self.shadow.close()


class RailFlags:
    """A rail worker's flag arrays, by (job, rank): host flag files (:class:`FlagFile`) and GPU flag words
    (:class:`GpuFlagWords`), each with its registration; and the rail's one flag publisher.

    The backend calls :meth:`publish` for each flag it publishes at the receiver (efa; a flag the compiled
    path stores itself never comes here) and, for receiver-publishing backends, :meth:`end_pass` after
    each poll. ``conn_jobs`` (the worker's, connection id -> job) says which job an arrival belongs to.
    """

    def __init__(self, backend: Any, publication: PublicationChoice, gpu: GpuMemory, conn_jobs: Mapping[int, str],
                 rail: int) -> None:
        self.backend = backend
        self.publication = publication
        self.gpu = gpu
        self.conn_jobs = conn_jobs
        self.rail = rail
        self.arrays: dict[tuple[str, int], tuple[FlagFile | GpuFlagWords, MemoryKey]] = {}
        self.loopback: Any = None  # the backend's LoopbackWriter, opened with the first GPU flags it serves
        self._busy: set[GpuFlagWords] = set()  # words with a write owed, on the wire or not landed
        self._copied = 0  # cuda-copy words posted for arrays that have left
        if traits_of(backend).publishes_flags:
            backend.set_flag_publisher(self.publish, self.end_pass)
        else:
            backend.set_flag_publisher(self.publish)

    @classmethod
    def for_rail(cls, flags: Any, backend: Any, gpu: GpuMemory, conn_jobs: Mapping[int, str],
                 rail: int) -> RailFlags:
        """Choose rail ``rail``'s path into GPU flag words from the ``[flags]`` config (once, logged)."""
        publishes = traits_of(backend).publishes_flags
        choice = choose_publication(
            flags.publication, receiver_publishes=publishes,
            loopback=backend.loopback_unavailable() if publishes else "the backend has no loopback write",
            gdrdrv_device=flags.gdrdrv_device, gdrcopy_library=flags.gdrcopy_library)
        level = logging.WARNING if choice.path in (CUDA_COPY, HOST_MAPPED) else logging.INFO
        log.log(level, "rail %d flag publication: %s%s (%s)", rail, choice.path,
                " (forced by flags.publication)" if choice.forced else "", choice.reason)
        return cls(backend, choice, gpu, conn_jobs, rail)

    @property
    def path(self) -> str:
        return self.publication.path

    # --- arrays ----------------------------------------------------------------------------------------
    def map_host(self, job: str, rank: int, flags: FlagFile, count: int) -> MemoryKey:
        """Register a rank's host flag file (owned from now on) for remote writes and atomics."""
        try:
            if flags.count != count:
                raise ValueError(f"the flag array holds {flags.count} flags, not {count}")
            mkey = self.backend.register_memory(flags.address, flags.nbytes, remote_write=True, remote_atomic=True)
        except BaseException:
            flags.close()
            raise
        self.arrays[(job, rank)] = (flags, mkey)
        if traits_of(self.backend).publishes_flags:  # efa: the compiled path stores these flags itself
            self.backend.set_host_flags(job, rank, flags.address, flags.count)
        return mkey

    def map_gpu(self, job: str, rank: int, handle: bytes, offset: int, count: int, device: int,
                shadow: FlagFile) -> tuple[MemoryKey, str]:
        """A rank's flag words in GPU memory (the client's allocation, by IPC handle) with ``shadow`` (owned
        from now on) holding their counters: registered, and published on this rail's path. Returns the
        key and how they are published (``nic`` where the sender's NIC writes them)."""
        gpu = self.gpu
        try:
            region = gpu.open(handle, offset, 8 * count, device)
        except BaseException:
            shadow.close()
            raise
        accessor = gpu.accessor(device)
        path = words_path(self.publication.path)
        if self.publication.path == HOST_MAPPED:
            log.warning("rail %d: job %s rank %d asked for device flags explicitly; this rail has no way into GPU "
                        "memory but cuda-copy: %s", self.rail, job, rank, COPY_COST)
        mapping = None
        if path == GDRCOPY:
            mapping, path = self._gdr_map(job, rank, region, count, device)
        words = GpuFlagWords(region.addr, count, shadow, path, region=region, accessor=accessor, mapping=mapping)
        try:
            if path == CUDA_COPY:
                accessor.open_word_ring()
            mkey = self.backend.register_memory(words.address, words.nbytes, remote_write=True, remote_atomic=True,
                                                accessor=accessor)
            words.rkey = mkey.rkey
            if path == LOOPBACK and self.loopback is None:
                self.loopback = self.backend.open_flag_loopback()
            words.loopback = self.loopback
        except BaseException:
            words.release()
            raise
        if mapping is not None:  # the compiled path stores these itself: no Python per flag
            self.backend.set_mapped_flags(job, rank, mapping.ptr, count, shadow.address)
        self.arrays[(job, rank)] = (words, mkey)
        return mkey, self.publication.path if self.publication.path == NIC else path

    def _gdr_map(self, job: str, rank: int, region: IpcRegion, count: int, device: int) -> tuple[Any, str]:
        """The words' BAR mapping and ``gdrcopy``; or, where GDRCopy cannot map them, None and the path
        they fall back to (the flags must still arrive)."""
        gdr = self.publication.gdr
        assert gdr is not None
        try:
            self.gpu.sync_memops(region.addr, device)
        except Exception as exc:  # wanted for ordering with the driver's own copies, not for our stores
            log.warning("rail %d: CU_POINTER_ATTRIBUTE_SYNC_MEMOPS not set on job %s rank %d's flags (%s)",
                        self.rail, job, rank, exc)
        try:
            return gdr.map(region.addr, 8 * count), GDRCOPY
        except GdrCopyError as exc:  # e.g. memory gdrdrv cannot pin
            path = LOOPBACK if self.backend.loopback_unavailable() is None else CUDA_COPY
            log.error("rail %d: GDRCopy could not map job %s rank %d's flags (%s); publishing them by %s%s",
                      self.rail, job, rank, exc, path, "" if path == LOOPBACK else ": " + COPY_COST)
            return None, path

    def drop(self, job: str, rank: int) -> None:
        """Deregister and release a rank's flag array (if this rail has one)."""
        entry = self.arrays.pop((job, rank), None)
        if entry is not None:
            if isinstance(entry[0], GpuFlagWords) and entry[0] in self._busy:
                self._busy.discard(entry[0])
                self._settle(entry[0])
            if traits_of(self.backend).publishes_flags:
                self.backend.clear_host_flags(job, rank)
            self.backend.deregister_memory(entry[1])
            if isinstance(entry[0], FlagFile):
                entry[0].close()
            else:
                self._copied += entry[0].copies
                entry[0].release()

    def _hand_back(self, wait: bool = False) -> None:
        """Give the loopback writes that completed back to their words (``wait``: at least one)."""
        for words, slot, value in self.loopback.reap(wait):
            words.written(slot, value)

    def _settle(self, words: GpuFlagWords) -> None:
        """Wait for ``words``' writes on the wire (loopback) or posted (cuda-copy): its memory is about to be
        deregistered and closed, and a loopback write that then failed would fail the writer for every rank."""
        try:
            if words.path == CUDA_COPY:
                words.wait_landed()
            while words.inflight:
                self._hand_back(wait=True)
        except Exception as exc:
            log.warning("rail %d: flag writes of a leaving rank did not complete (%s)", self.rail, exc)

    # --- publishing (the backend calls these) -----------------------------------------------------------
    def publish(self, conn_id: int, dst_rank: int, slot: int, op: SignalOp, value: int) -> None:
        """Receiver-side flag publishing (efa): everything this flag covers has arrived."""
        job = self.conn_jobs.get(conn_id)
        entry = self.arrays.get((job, dst_rank)) if job is not None else None
        if entry is None:
            log.warning("flag update for unknown rank %d on connection %d dropped", dst_rank, conn_id)
            return
        target = entry[0]
        if isinstance(target, GpuFlagWords):  # GPU flag words publish themselves, at the end of the pass
            target.publish(slot, op, value)
            self._busy.add(target)
            return
        values = target.values
        if op == SignalOp.SET:
            values[slot] = value
        else:
            values[slot] += value

    def loopback_stats(self) -> dict[str, int] | None:
        """The loopback writer's flag writes, its batches and the time they held the worker (each batch is
        waited for); None where this rail writes no flags by loopback."""
        lb = self.loopback
        if lb is None:
            return None
        return {"writes": lb.writes, "batches": lb.batches, "wait_ns": lb.wait_ns}

    def copied_words(self) -> int:
        """Flag words this rail has posted by cuda-copy (with the ones its words' arrays that left posted)."""
        arrays = (entry[0] for entry in self.arrays.values())
        return self._copied + sum(words.copies for words in arrays if isinstance(words, GpuFlagWords))

    def end_pass(self) -> bool:
        """After a poll (efa): hand the loopback writes that completed back to their words, then post what the
        words owe. True while a write is owed, on the wire or not yet landed: the backend calls again after its
        next poll."""
        busy = self._busy
        if not busy:
            return False
        try:
            if self.loopback is not None and self.loopback.inflight:
                self._hand_back()
            for words in list(busy):
                words.end_pass()
        except Exception as exc:
            if not any(words.path == LOOPBACK for words in busy):
                raise  # a copy failed: the CUDA context is unusable, and the worker says so
            # the flags must still arrive: by copy, and say what that costs
            log.error("rail %d: loopback flag write failed (%s); these flags fall back to cuda-copy: %s",
                      self.rail, exc, COPY_COST)
            for words in busy:
                if words.path == LOOPBACK:
                    words.fall_back_to_copy(self.gpu.accessor(words.region.device) if words.region else None)
        self._busy = {words for words in busy if words.busy}
        return bool(self._busy)

    def close(self) -> None:
        """Close the loopback writer (before the backend, whose QP it writes through)."""
        if self.loopback is not None:
            self.loopback.close()
            self.loopback = None
