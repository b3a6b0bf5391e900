"""Limits that more than one part of transportd depends on, stated once.

A value one side accepts must never be refused by the other later: a config value a rail worker refuses at
run time would surface as a worker traceback, not a :class:`~cmd_ring.errors.ConfigError` naming the key;
a join the protocol accepts but the proxy's tables cannot hold would fail the client's first command
instead of its join. So the config's and the protocol's schemas (their ``Meta`` bounds) and the code that
relies on each bound read these. ``tests/transportd/test_limits.py`` drives each pair at the bound and one
step past it.
"""

from __future__ import annotations

__all__ = [
    "MAX_BATCH",
    "MAX_DEVICE",
    "MAX_RAILS",
    "MAX_CHANNEL_CAPACITY",
    "MAX_IBGDA_WQES",
    "MAX_INFLIGHT_CAP",
    "MAX_REGIONS",
    "MAX_WORLD",
    "MIN_BATCH",
    "MIN_CHANNEL_CAPACITY",
    "MIN_IBGDA_WQES",
    "MIN_INFLIGHT_CAP",
    "MAX_TAKE",
    "MIN_TAKE",
]

#: Commands per connection per batch: at least one; at most 8 (the batch-size histogram has 8 buckets,
#: and a ConnectX doorbell batch of 8 WQEs is where posting cost stops falling).
MIN_BATCH = 1
MAX_BATCH = 8

#: Work requests posted and not completed per connection: at least 2, because a PUT_SIGNAL is two WRs
#: (payload, then flag) and must fit as a whole; at most 65536 (the send queue is sized from it).
MIN_INFLIGHT_CAP = 2
MAX_INFLIGHT_CAP = 1 << 16

#: Records a worker takes from one ring in one pass: at least one; at most what the largest ring holds.
MIN_TAKE = 1
MAX_TAKE = 1 << 20

#: Ranks in one job: a command record names its peer as a u16, and 0xFFFF is what the device API (and the
#: Triton calls) write for a rank that does not fit, which must never address a rank: ranks are 0..65534.
MAX_WORLD = 0xFFFF

#: Regions one rank registers: a command record names a region as a u16, so ids are 0..65535.
MAX_REGIONS = 1 << 16

#: Command-ring slots of a channel, a power of two (the config's default and a client's ``channel``).
MIN_CHANNEL_CAPACITY = 8
MAX_CHANNEL_CAPACITY = 1 << 20

#: Send-queue WQEBBs of an IBGDA queue pair, a power of two (the queue's memory holds at most this many).
MIN_IBGDA_WQES = 8
MAX_IBGDA_WQES = 1 << 15

#: Local GPU index of a client or a rail (-1: a CPU-only client, or a rail's GPU unknown).
MAX_DEVICE = 63

#: NICs (rails) per node, in the config's [[rails]] and a hello's rail count.
MAX_RAILS = 16
