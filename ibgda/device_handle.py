"""numpy twins of the IBGDA device handles (``queue_pair.cuh``, ``channel.cuh``), byte for byte.

The host fills these and copies them to the GPU (or, in the CPU tests, hands their addresses to the
same code compiled for the host). All fields are native (little-endian) words; only what the NIC reads
is big-endian, and none of that is here. A probe test compiles the header and compares every offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum

import numpy as np

__all__ = [
    "ABI", "CHANNEL_DTYPE", "QP_STATE_DTYPE", "QUEUE_PAIR_DTYPE", "REGION_DTYPE", "SignalMode", "qp_error_fields",
    "queue_pair_record",
]

ABI = 1  # TPD_IBGDA_ABI


class SignalMode(IntEnum):
    """tpd::ibgda::SignalMode: the ib backend's signal.mode names, same order."""

    WRITE = 0
    ATOMIC = 1
    FENCE = 2


# QpState: three 128-byte lines, one per writer role (claim / ticket / CQ poller); rings counts doorbells.
QP_STATE_DTYPE = np.dtype({
    "names": ["claimed", "posted", "signaled", "fence_next", "rings", "done", "cq_ci", "cq_lock", "error"],
    "formats": ["<u8", "<u8", "<u8", "<u4", "<u4", "<u8", "<u8", "<u4", "<u4"],
    "offsets": [0, 128, 136, 144, 148, 256, 264, 272, 276],
    "itemsize": 384,
})

# QueuePair: the device handle of one RC QP (addresses as the GPU sees them).
QUEUE_PAIR_DTYPE = np.dtype({
    "names": ["sq", "dbrec", "bf", "cq", "cq_dbrec", "state", "scratch", "qpn", "wqe_cnt", "ncqes",
              "scratch_lkey"],
    "formats": ["<u8"] * 7 + ["<u4"] * 4,
    "offsets": [0, 8, 16, 24, 32, 40, 48, 56, 60, 64, 68],
    "itemsize": 72,
})

def queue_pair_record(addresses: Mapping[str, int], *, qpn: int, wqe_cnt: int, ncqes: int, scratch: int,
                      scratch_lkey: int, state: int = 0) -> np.ndarray:
    """One QUEUE_PAIR_DTYPE record: ``addresses`` (sq, cq, dbrec, cq_dbrec, bf) as the poster reaches them,
    ``scratch`` 8 bytes registered with ``scratch_lkey``, ``state`` a zeroed QpState (build_channel fills it)."""
    rec = np.zeros(1, dtype=QUEUE_PAIR_DTYPE)
    for name, addr in addresses.items():
        rec[name] = addr
    rec["state"], rec["scratch"], rec["scratch_lkey"] = state, scratch, scratch_lkey
    rec["qpn"], rec["wqe_cnt"], rec["ncqes"] = qpn, wqe_cnt, ncqes
    return rec


# Region: a registered range as the NIC addresses it (key = lkey in local tables, rkey in remote ones).
REGION_DTYPE = np.dtype({"names": ["addr", "length", "key", "reserved"], "formats": ["<u8", "<u8", "<u4", "<u4"],
                         "offsets": [0, 8, 16, 20], "itemsize": 24})

# tpd::IbgdaChannel, passed to kernels by value.
CHANNEL_DTYPE = np.dtype({
    "names": ["qps", "local", "remote", "remote_flags", "shadow", "flags", "error", "flag_count", "rank", "world",
              "nregions", "signal_mode", "abi"],
    "formats": ["<u8"] * 7 + ["<u4"] * 6,
    "offsets": [0, 8, 16, 24, 32, 40, 48, 56, 60, 64, 68, 72, 76],
    "itemsize": 80,
})


def qp_error_fields(word: int) -> tuple[int, int, int]:
    """QpState.error -> (syndrome, vendor_err, cqe opcode); (0, 0, 0) when no error."""
    return word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF
