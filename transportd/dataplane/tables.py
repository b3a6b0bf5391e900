"""A job's resolve tables: one rank's source regions (:class:`RegionTable`) and the job's peers
(:class:`PeerTable`: connections, flag arrays, remote regions).

The proxy keeps one per job and one per local rank (:class:`~transportd.dataplane.proxy_base.ProxyBase`)
and hands the engine a view of a table's arrays after every change that may move them; the engine resolves
records through those views in C (``transportd/core/validate.h``, which follows this layout). The numpy
model resolves through the same tables (:mod:`transportd_models.translate`). The tables are views
themselves: what a rank registered is recorded by the daemon's main process, the region registry's one
owner (:class:`transportd.daemon.state.LocalRank`, ``regions``; a peer's, as its node announced them,
:class:`transportd.daemon.state.RemoteRank`), which tells each rail worker what to put here. Records carry
small integer ids (peer rank, region ids, flag slot) and the tables resolve them to addresses and keys.

Layout (for speed): every table has one entry past its last id, a *sentinel* that is never valid (no
connection, length 0, no flag slots). Ids out of range are clamped onto it, so one gather both checks and
resolves them with no masking; an unregistered region has length 0, so the bounds check alone rejects it
on the fast path.
"""

from __future__ import annotations

import numpy as np

from transportd.limits import MAX_REGIONS, MAX_WORLD

__all__ = ["DEFAULT_MAX_LENGTH", "MAX_REGION_ID", "PeerTable", "RegionTable"]

DEFAULT_MAX_LENGTH = 1 << 31  # a verbs port's usual max_msg_sz
MAX_REGION_ID = MAX_REGIONS - 1  # region ids are u16 in the record


def _check_region_id(region: int) -> None:
    if not 0 <= region <= MAX_REGION_ID:
        raise ValueError(f"region id {region} is outside 0..{MAX_REGION_ID} (a record carries it as u16)")


def _capacity_for(index: int) -> int:
    """The power of two above ``index`` (room for ids 0..index)."""
    return 1 << index.bit_length()


class RegionTable:
    """One rank's local source regions by id: address, length and lkey, plus a valid mask.

    A view, on one rail, of the main process's region registry (``LocalRank.regions``), filled through
    the worker's ``SetSourceRegion``; the engine reads a view of these arrays in turn (the proxy hands it
    the arrays again after a region is set, since setting one may grow them).

    Entries ``0 .. size-1`` hold ids; entry ``size`` is the sentinel. Arrays grow to the next power of two
    above the highest id registered.
    """

    def __init__(self) -> None:
        self.size = 1
        self.addr = np.zeros(2, dtype=np.uint64)
        self.length = np.zeros(2, dtype=np.uint64)  # 0 while not valid
        self.key = np.zeros(2, dtype=np.uint32)
        self.valid = np.zeros(2, dtype=bool)

    def _fit(self, region: int) -> None:
        if region < self.size:
            return
        size = _capacity_for(region)
        for name in ("addr", "length", "key", "valid"):
            old = getattr(self, name)
            new = np.zeros(size + 1, dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)
        self.size = size

    def set(self, region: int, addr: int, length: int, key: int) -> None:
        """Register (or replace) region ``region``."""
        _check_region_id(region)
        self._fit(region)
        self.addr[region], self.length[region], self.key[region] = addr, length, key
        self.valid[region] = True

    def remove(self, region: int) -> None:
        """Forget region ``region``; records naming it are rejected with BAD_REGION from now on."""
        if 0 <= region < self.size:
            self.valid[region] = False
            self.length[region] = 0

    def clear(self) -> None:
        """Forget every region."""
        self.valid[:] = False
        self.length[:] = 0

    def __len__(self) -> int:
        return int(self.valid.sum())


class PeerTable:
    """A job's view of its peers, by rank: connection, flag array and remote regions.

    ``conn`` holds the proxy's connection index per rank (-1: none bound). ``code`` is nonzero for a rank
    whose connection failed: its records are rejected with that code (PEER_LOST) instead of being posted.
    Ranks ``0 .. rows-1`` have entries and ``rows`` is the sentinel; remote regions are a flat
    ``(rows+1) x (cols+1)`` table (row stride ``cols + 1``, column ``cols`` the sentinel). Tables may be
    filled before the job's ``world`` is known (peers announce regions before a local channel opens); until
    then every peer is out of range, and :meth:`set_world` then trims the rows to exactly ``world``.
    """

    def __init__(self, world: int = 0) -> None:
        self.world = 0
        self.rows = 0
        self.cols = 1
        self.conn = np.full(1, -1, dtype=np.int64)
        self.code = np.zeros(1, dtype=np.uint16)
        self.flag_base = np.zeros(1, dtype=np.uint64)
        self.flag_slots = np.zeros(1, dtype=np.uint64)
        self.flag_rkey = np.zeros(1, dtype=np.uint32)
        self.addr = np.zeros(2, dtype=np.uint64)
        self.length = np.zeros(2, dtype=np.uint64)  # 0 while not valid
        self.rkey = np.zeros(2, dtype=np.uint32)
        self.valid = np.zeros(2, dtype=bool)
        if world:
            self.set_world(world)

    def _resize(self, rows: int, cols: int) -> None:
        keep_rows, keep_cols = min(rows, self.rows), min(cols, self.cols)
        for name, fill in (("conn", -1), ("code", 0), ("flag_base", 0), ("flag_slots", 0), ("flag_rkey", 0)):
            old = getattr(self, name)
            new = np.full(rows + 1, fill, dtype=old.dtype)
            new[:keep_rows] = old[:keep_rows]
            setattr(self, name, new)
        for name in ("addr", "length", "rkey", "valid"):
            old = getattr(self, name).reshape(self.rows + 1, self.cols + 1)
            new = np.zeros((rows + 1, cols + 1), dtype=old.dtype)
            new[:keep_rows, :keep_cols] = old[:keep_rows, :keep_cols]
            setattr(self, name, new.reshape(-1))
        self.rows, self.cols = rows, cols

    def set_world(self, world: int) -> None:
        """Fix the job's world size (ranks ``0..world-1`` are valid peers)."""
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world size must be in 1..{MAX_WORLD} (peer is u16 in the record), got {world}")
        if self.world and world != self.world:
            raise ValueError(f"the world size is already {self.world}")
        self._resize(world, self.cols)
        self.world = world

    def _ensure(self, rank: int, region: int) -> None:
        if not 0 <= rank < MAX_WORLD:
            raise ValueError(f"rank {rank} is outside 0..{MAX_WORLD - 1} (peer is u16 in the record)")
        if self.world and rank >= self.world:
            raise ValueError(f"rank {rank} is outside this job's world of {self.world}")
        _check_region_id(region)
        rows = self.rows if rank < self.rows else _capacity_for(rank)
        cols = self.cols if region < self.cols else _capacity_for(region)
        if (rows, cols) != (self.rows, self.cols):
            self._resize(rows, cols)

    def _at(self, rank: int, region: int) -> int:
        return rank * (self.cols + 1) + region

    def bind(self, rank: int, conn: int) -> None:
        """Route records for ``rank`` to connection index ``conn``."""
        self._ensure(rank, 0)
        self.conn[rank] = conn
        self.code[rank] = 0

    def unbind(self, rank: int, code: int = 0) -> None:
        """No connection for ``rank``: its records get ``code``, or BAD_PEER when code is 0."""
        self._ensure(rank, 0)
        self.conn[rank] = -1
        self.code[rank] = code

    def set_region(self, rank: int, region: int, addr: int, length: int, rkey: int) -> None:
        """Register (or replace) ``rank``'s remote region ``region``."""
        self._ensure(rank, region)
        at = self._at(rank, region)
        self.addr[at], self.length[at], self.rkey[at] = addr, length, rkey
        self.valid[at] = True

    def remove_region(self, rank: int, region: int) -> None:
        if 0 <= rank < self.rows and 0 <= region < self.cols:
            at = self._at(rank, region)
            self.valid[at] = False
            self.length[at] = 0

    def set_flags(self, rank: int, base: int, slots: int, rkey: int) -> None:
        """``rank``'s flag array: ``slots`` u64 words from ``base`` (8-byte aligned, for NIC atomics)."""
        self._ensure(rank, 0)
        if base % 8:
            raise ValueError(f"flag array base {base:#x} is not 8-byte aligned")
        self.flag_base[rank], self.flag_slots[rank], self.flag_rkey[rank] = base, slots, rkey

    def remove_flags(self, rank: int) -> None:
        if 0 <= rank < self.rows:
            self.flag_slots[rank] = 0

    def forget(self, rank: int) -> None:
        """``rank`` left the job: unbound (its records get BAD_PEER), no flags, no regions."""
        if 0 <= rank < self.rows:
            self.unbind(rank)
            self.remove_flags(rank)
            row = slice(self._at(rank, 0), self._at(rank, self.cols))
            self.valid[row] = False
            self.length[row] = 0

    def connections(self) -> np.ndarray:
        """The distinct connection indexes this job's records may feed."""
        return np.unique(self.conn[self.conn >= 0])

