"""Completion bookkeeping for one RC connection: WR numbers, batch tokens, inflight.

Only the last WR of a batch is signaled, so in the good case one completion retires a whole batch (and
every unsignaled WR before it: RC completes in post order). When a WR fails, the QP goes to the error
state and the provider completes that WR and every later one with an error (the failing one with its own
status, the rest with IBV_WC_WR_FLUSH_ERR) — signaled or not, depending on the provider. Whatever
arrives, each token is reported exactly once, with the status of the first completion seen for its batch.

WR numbers are per connection and start at 1; a work request id is ``key << 48 | number`` so one CQ can
serve every connection of the rail and a completion finds its connection without a QP-number lookup.
"""

from __future__ import annotations

from collections import deque

__all__ = ["SEQ_BITS", "SEQ_MASK", "OrderedBatches"]

SEQ_BITS = 48
SEQ_MASK = (1 << SEQ_BITS) - 1


class OrderedBatches:
    """WRs posted and completed on one RC QP, grouped into token-carrying batches."""

    __slots__ = ("posted", "completed", "batches", "error")

    def __init__(self, base: int = 0) -> None:
        # WR numbers start after ``base`` (random per connection, so a stale completion of an earlier
        # connection that had the same key never matches)
        self.posted = base  # number of the last WR posted
        self.completed = base  # number of the last WR known complete (any status)
        self.batches: deque[list[int]] = deque()  # [last WR number, token, reported]
        self.error = 0  # first error status seen; the QP is unusable from then on

    def inflight(self) -> int:
        return self.posted - self.completed

    def add_batch(self, n_wrs: int, token: int) -> int:
        """Account ``n_wrs`` posted WRs ending a batch; returns the last one's number (to signal)."""
        self.posted += n_wrs
        self.batches.append([self.posted, token, 0])
        return self.posted

    def on_completion(self, seq: int, status: int, vendor_err: int, out: list[tuple[int, int, int]]) -> None:
        """A completion for WR ``seq``; appends (token, status, vendor_err) for batches it settles."""
        if seq <= self.completed or seq > self.posted:
            return  # a stale entry (e.g. from before a reconnect) or not ours
        self.completed = seq
        failed_before = self.error
        if status and not self.error:
            self.error = status
        batches = self.batches
        while batches and batches[0][0] < seq:
            # every WR of this batch completed before ``seq``; normally its signaled completion already
            # reported it. If not (a provider that drops completions), it succeeded unless the QP had
            # already failed, in which case it was flushed like ``seq``.
            _last, token, reported = batches.popleft()
            if not reported:
                out.append((token, status if failed_before else 0, vendor_err if failed_before else 0))
        if batches:
            batch = batches[0]
            if not batch[2] and (status or batch[0] == seq):
                out.append((batch[1], status, vendor_err))
                batch[2] = 1
            if batch[0] == seq:
                batches.popleft()

    def drop(self) -> list[int]:
        """Forget everything outstanding (the QP is being destroyed); returns unreported tokens."""
        tokens = [b[1] for b in self.batches if not b[2]]
        self.batches.clear()
        self.completed = self.posted
        return tokens
