"""The NIC model: a soft device's link, shaped to a bandwidth, a base latency and a message rate.

One link per device, shared by its QPs, with a next-free time: a message starts when the link is free (or
now, if it has been idle), occupies it for ``max(bytes / bandwidth, 1 / message_rate)``, and lands
``latency`` after its last byte left. A stream of messages therefore lands at the configured rate whatever
the machine's own speed (which must be higher), and each message is at least ``latency`` late. Landing
times never decrease, so the departure queue that holds messages until then (``SoftDevice.depart``)
keeps every QP's order.

A message leaves for its peer when it lands, or, where its bytes are placed as the link carries them
(`departure`: an RC direct write, whose bytes the responder copies from the requester's memory), when its
first byte lands, so the copy runs while the link carries the rest, as a NIC places a write packet by
packet. Departure times never decrease either.

What a message costs the link: a write or send its payload (direct writes included: the modeled NIC
carries the bytes the soft wire does not); a read or an atomic its request alone (read responses and
acknowledgements travel unshaped).
"""

from __future__ import annotations

__all__ = ["LinkModel"]


class LinkModel:
    """Next-free-time schedule of one link; the caller serializes calls."""

    __slots__ = ("free", "last", "started", "departed", "first_start", "messages", "bytes", "busy")

    def __init__(self) -> None:
        self.free = 0.0  # when the link can start the next message
        self.last = 0.0  # the latest landing time handed out
        self.started = 0.0  # when the message scheduled last starts on the link
        self.departed = 0.0  # the latest departure time handed out (`departure`)
        self.first_start = -1.0  # start of the first message scheduled since the last reset
        self.messages = 0
        self.bytes = 0
        self.busy = 0.0  # total occupancy scheduled (s)

    @staticmethod
    def occupancy(nbytes: int, bandwidth: float | None, message_rate: float | None) -> float:
        """Seconds one message of ``nbytes`` holds the link."""
        occ = nbytes / bandwidth if bandwidth else 0.0
        if message_rate:
            occ = max(occ, 1.0 / message_rate)
        return occ

    def schedule(self, now: float, nbytes: int, bandwidth: float | None, latency: float,
                 message_rate: float | None) -> float:
        """Reserve the link for one message posted at ``now``; when it lands."""
        start = self.free if self.free > now else now
        self.started = start
        occ = self.occupancy(nbytes, bandwidth, message_rate)
        self.free = start + occ
        land = self.free + latency
        if land < self.last:  # a lower latency configured meanwhile: still never ahead of earlier messages
            land = self.last
        self.last = land
        if self.first_start < 0:
            self.first_start = start
        self.messages += 1
        self.bytes += nbytes
        self.busy += occ
        return land

    def departure(self, land: float, latency: float, streamed: bool) -> float:
        """When the message `schedule` just placed (landing at ``land``) leaves for its peer: at its landing,
        or, ``streamed``, as its first byte lands (``latency`` after its start); never before a message
        scheduled earlier leaves, so the departures keep the order of the landings."""
        leave = self.started + latency if streamed else land
        if leave < self.departed:
            leave = self.departed
        self.departed = leave
        return leave

    def reset_stats(self) -> None:
        self.first_start = -1.0
        self.messages = 0
        self.bytes = 0
        self.busy = 0.0

    def stats(self) -> dict[str, float]:
        """Messages and bytes scheduled, the link's busy time, and the span from the first start to the
        last landing (equal to busy + latency when the link never went idle)."""
        span = self.last - self.first_start if self.first_start >= 0 else 0.0
        return {"messages": self.messages, "bytes": self.bytes, "busy_s": self.busy, "span_s": span}
