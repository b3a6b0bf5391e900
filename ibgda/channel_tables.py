"""Build a ``tpd::IbgdaChannel`` from host-side facts: queue pairs per peer, regions, flag arrays.

Everything a kernel reaches through the channel lives in memory the caller allocates (``alloc``): GPU
memory for a kernel (``cuMemAlloc`` + a host-to-device copy), plain host memory for the CPU tests, which
run the device code on the host. The builder knows nothing about where queues live; it takes each
QueuePair record as the GPU must see it (:meth:`ibgda.soft_mlx5.SoftMlx5Queue.queue_pair`,
:meth:`ibgda.host_mlx5.Mlx5Queue.queue_pair`) and fills in the QpState address it allocates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ibgda.device_handle import ABI, CHANNEL_DTYPE, QP_STATE_DTYPE, QUEUE_PAIR_DTYPE, REGION_DTYPE, SignalMode

__all__ = ["Alloc", "ChannelTables", "HostAlloc", "RegionKey", "build_channel"]

# (address, length, key): a registered range as the NIC addresses it (key: lkey locally, rkey remotely)
RegionKey = tuple[int, int, int]
# alloc(image) -> address of a copy of ``image`` (bytes) that the posting code can reach, 128-byte aligned
Alloc = Callable[[bytes], int]


class HostAlloc:
    """``Alloc`` over host memory (for running the device code on the CPU); keeps every block alive."""

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []

    def __call__(self, image: bytes) -> int:
        raw = np.zeros(len(image) + 128, dtype=np.uint8)
        off = (-raw.ctypes.data) % 128
        block = raw[off:off + len(image)]
        block[:] = np.frombuffer(image, dtype=np.uint8)
        self.blocks.append(raw)
        return int(block.ctypes.data)


@dataclass
class ChannelTables:
    """The channel record (pass ``record.tobytes()`` as the kernel argument) and where its parts went."""

    record: np.ndarray            # CHANNEL_DTYPE, shape (1,)
    qp_states: dict[int, int]     # peer rank -> address of its QpState
    shadow: int                   # address of the write/fence-mode shadow counters
    error: int                    # address of the error words (code, count)
    extra: dict[str, int] = field(default_factory=dict)


def build_channel(*, rank: int, world: int, alloc: Alloc, queue_pairs: Mapping[int, np.ndarray],
                  local_regions: Sequence[RegionKey], remote_regions: Mapping[int, Sequence[RegionKey]],
                  remote_flags: Mapping[int, RegionKey], flags: int, flag_count: int,
                  signal_mode: SignalMode | str = SignalMode.WRITE) -> ChannelTables:
    """Lay out and allocate everything a ``tpd::IbgdaChannel`` points at.

    ``queue_pairs[r]``: the QueuePair record (QUEUE_PAIR_DTYPE) of the QP to rank ``r``; ranks without one
    are refused by the device code (BAD_PEER). ``local_regions[i]``: region ``i`` of this rank, with its
    lkey. ``remote_regions[r][i]``: rank ``r``'s region ``i`` with its rkey. ``remote_flags[r]``: rank
    ``r``'s flag array. ``flags``: address of this rank's flag words (what tpd::wait polls).
    """
    mode = SignalMode[signal_mode.upper()] if isinstance(signal_mode, str) else SignalMode(signal_mode)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    bad = [r for r in (*queue_pairs, *remote_regions, *remote_flags) if not 0 <= r < world]
    if bad:
        raise ValueError(f"ranks {sorted(set(bad))} outside a world of {world}")
    nregions = max([len(local_regions), *(len(v) for v in remote_regions.values())], default=0)
    qps = np.zeros(world, dtype=QUEUE_PAIR_DTYPE)
    states = {}
    for r, rec in queue_pairs.items():
        qps[r] = np.asarray(rec, dtype=QUEUE_PAIR_DTYPE).reshape(-1)[0]
        wqe_cnt = int(qps[r]["wqe_cnt"])
        if wqe_cnt < 8 or wqe_cnt & (wqe_cnt - 1) or int(qps[r]["ncqes"]) < wqe_cnt:
            raise ValueError(f"QP to rank {r}: wqe_cnt {wqe_cnt} must be a power of two >= 8 and <= ncqes")
        states[r] = alloc(bytes(QP_STATE_DTYPE.itemsize))
        qps[r]["state"] = states[r]
    local = np.zeros(max(nregions, 1), dtype=REGION_DTYPE)
    for i, (addr, length, key) in enumerate(local_regions):
        local[i] = (addr, length, key, 0)
    remote = np.zeros(max(world * nregions, 1), dtype=REGION_DTYPE)
    for r, regions in remote_regions.items():
        for i, (addr, length, key) in enumerate(regions):
            remote[r * nregions + i] = (addr, length, key, 0)
    rflags = np.zeros(world, dtype=REGION_DTYPE)
    for r, (addr, length, key) in remote_flags.items():
        rflags[r] = (addr, length, key, 0)
    shadow = alloc(bytes(8 * max(world * flag_count, 1)))
    error = alloc(bytes(8))
    rec = np.zeros(1, dtype=CHANNEL_DTYPE)
    rec[0] = (alloc(qps.tobytes()), alloc(local.tobytes()), alloc(remote.tobytes()), alloc(rflags.tobytes()), shadow,
              flags, error, flag_count, rank, world, nregions, int(mode), ABI)
    return ChannelTables(record=rec, qp_states=states, shadow=shadow, error=error)
