"""The one small interface between the proxy and a transport backend (ib, efa, null).

The proxy turns ring records into *plans*: one row per work item for one connection, already resolved
through the region and flag tables (local address/lkey, remote address/rkey). A backend turns plan rows
into work requests and reports completions. Backends know nothing about rings; the proxy knows nothing
about verbs. The daemon picks a backend by name in exactly one place (:func:`transportd.backends.open_backend`).

Plan rows (``PLAN_DTYPE``), posted in row order on one connection:

- ``WRITE``   length bytes laddr (lkey) -> raddr (rkey).
- ``SIGNAL``  update the flag word at raddr (rkey): ADD ``value`` or SET ``value`` (``signal_op``).
              It must not become visible before every earlier WRITE of this connection that it covers
              is placed (docs/design.md, "Flags follow their data"). ``dst_rank``/``slot`` name the flag
              for backends that publish flags at the receiver (efa).
- ``FENCE``   later rows of this connection are delivered after earlier ones are placed.

``token`` is the proxy's completion token, one per posted batch: when a backend reports it complete, every
row posted with that token (and everything before it on the connection) has completed locally. A backend
reports each token once, after the last WR of its batch completes (ib signals only that WR; efa signals
every WR and counts them), with the first error status seen if any WR failed; the proxy ignores tokens it
no longer tracks. The proxy never modifies a plan after posting it, so a backend may keep views of it.

``post_batches`` is an optional fast path: many batches, each for its own connection, in one call, so a
backend can loop in compiled code (or, for the null backend, not loop at all). The proxy uses it when a
backend has it and falls back to one ``post`` call per batch otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = [
    "PlanOp",
    "SignalOp",
    "PLAN_DTYPE",
    "COMPLETION_DTYPE",
    "MemoryKey",
    "Backend",
    "BatchPoster",
    "FlagPublisher",
    "FLAG_SEED_DTYPE",
    "empty_plan",
]


class PlanOp(enum.IntEnum):
    WRITE = 1
    SIGNAL = 2
    FENCE = 3


class SignalOp(enum.IntEnum):
    ADD = 0
    SET = 1


PLAN_DTYPE = np.dtype(
    [
        ("op", "u1"),
        ("signal_op", "u1"),
        ("dst_rank", "<u2"),
        ("length", "<u4"),
        ("laddr", "<u8"),
        ("raddr", "<u8"),
        ("lkey", "<u4"),
        ("rkey", "<u4"),
        ("value", "<u8"),
        ("slot", "<u4"),
        ("chunk_id", "<u4"),
        ("token", "<u8"),
    ],
    align=True,
)

# Completions a backend reports: the token, and a status (0 = success, else the verbs wc status).
COMPLETION_DTYPE = np.dtype([("token", "<u8"), ("status", "<u4"), ("vendor_err", "<u4")], align=True)


#: A flag value as a peer announces it (``PeerRegions.flag_seeds``): a nonzero counter of its flag array.
FLAG_SEED_DTYPE = np.dtype([("slot", "<u4"), ("pad", "<u4"), ("value", "<u8")])
assert FLAG_SEED_DTYPE.itemsize == 16


def empty_plan(n: int = 0) -> np.ndarray:
    return np.zeros(n, dtype=PLAN_DTYPE)


@dataclass(frozen=True, slots=True)
class MemoryKey:
    """A registered region as this rail sees it: local key for sources, remote key for peers."""

    addr: int  # the address WRs use for this region (a VA, or an iova/offset for dmabuf MRs)
    length: int
    lkey: int
    rkey: int


class FlagPublisher(Protocol):
    """Receiver side (efa): publish a flag update once everything it covers has arrived."""

    def __call__(self, conn_id: int, dst_rank: int, slot: int, op: SignalOp, value: int) -> None: ...


class Backend(Protocol):
    """One rail's NIC as the proxy sees it.

    ``name`` is the backend kind the class implements; what it can do beyond these methods is declared for
    that kind in :data:`transportd.backends.TRAITS` (a compiled poster, IBGDA domains, receive-side work,
    flags the receiving daemon publishes), never probed on the object.
    """

    name: str

    def local_address(self) -> dict[str, Any]:
        """What a peer needs to reach this rail (msgpack-able)."""

    def register_memory(self, addr: int, length: int, *, remote_write: bool, remote_atomic: bool,
                        accessor: Any = None) -> MemoryKey:
        """Register [addr, addr+length) on this rail."""

    def deregister_memory(self, key: MemoryKey) -> None: ...

    def create_endpoint(self, conn_id: int, job: str) -> dict[str, Any]:
        """Create the local end of connection ``conn_id``; returns what the remote end must know."""

    def connect(self, conn_id: int, remote: dict[str, Any]) -> None:
        """Connect ``conn_id`` to the remote end described by ``remote`` (its create_endpoint result)."""

    def close_connection(self, conn_id: int) -> None: ...

    def post(self, conn_id: int, plan: np.ndarray) -> int:
        """Post ``plan`` (PLAN_DTYPE rows, in order); returns the number of WRs it became."""

    def poll(self, max_completions: int = 256) -> np.ndarray:
        """Completed tokens since the last call (COMPLETION_DTYPE)."""

    def inflight(self, conn_id: int) -> int:
        """WRs posted on ``conn_id`` and not yet completed."""

    def set_flag_publisher(self, publisher: FlagPublisher) -> None: ...

    def seed_signals(self, conn_id: int, base: int, rkey: int, seeds: bytes) -> None:
        """The remote flag words at ``base + 8 * slot`` (``rkey``) already hold these values (``seeds``:
        FLAG_SEED_DTYPE records the receiver announced): a backend that writes flags as absolute values
        from a shadow of its own (ib, write and fence modes) starts the words ``conn_id`` never signalled
        there, so that counters which outlived a daemon restart go on counting. Others do nothing."""

    def close(self) -> None: ...


class BatchPoster(Protocol):
    """The optional fast path of a Backend (see the module doc)."""

    def post_batches(self, conn_ids: np.ndarray, plan: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Post batch ``i`` = ``plan[bounds[i]:bounds[i+1]]`` on ``conn_ids[i]``, in order; WRs per batch."""
