"""The proxy's limits, in one place: the config checks them at load and the proxy at construction.

A value the config accepts must never be refused by a rail worker at run time (that would surface as a
worker traceback, not a :class:`~transportd.errors.ConfigError` naming the key), so both sides read these.
``tests/transportd/test_limits.py`` builds a real proxy at each bound and one step past it.
"""

from __future__ import annotations

__all__ = ["MAX_BATCH", "MAX_INFLIGHT_CAP", "MIN_BATCH", "MIN_INFLIGHT_CAP"]

#: Commands per connection per batch: at least one; at most 8 (the batch-size histogram has 8 buckets,
#: and a ConnectX doorbell batch of 8 WQEs is where posting cost stops falling).
MIN_BATCH = 1
MAX_BATCH = 8

#: Work requests posted and not completed per connection: at least 2, because a PUT_SIGNAL is two WRs
#: (payload, then flag) and must fit as a whole; at most 65536 (the send queue is sized from it).
MIN_INFLIGHT_CAP = 2
MAX_INFLIGHT_CAP = 1 << 16
