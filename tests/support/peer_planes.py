"""Peer planes over real zmq TCP sockets in one process: each plane's events in a log, and a pump that polls
planes until a condition holds (the peer-plane and worker-link tests)."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.waiting import wait_until
from transportd.control.peers import PeerPlane
from transportd.errors import ListenError


class Events:
    """The log of what one plane reported: ``(op, node)`` for messages, ``("up"|"down", node)`` for peers."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def plane(self, node: str, port: int, static: tuple[str, ...]) -> PeerPlane:
        def bind() -> PeerPlane | None:
            try:
                return PeerPlane(node, "ib", 1, f"tcp://127.0.0.1:{port}", static,
                                 on_message=lambda n, m: self.log.append((m.op, n)),
                                 on_peer_up=lambda n: self.log.append(("up", n)),
                                 on_peer_down=lambda n: self.log.append(("down", n)),
                                 heartbeat_interval_s=0.05, heartbeat_timeout_s=60.0)  # no timeout in a test
            except ListenError as exc:  # an earlier life's socket in this process is still being closed
                if not exc.in_use:
                    raise
                return None

        return wait_until(bind, f"port {port} to be free for node {node}'s plane")


def pump(planes: list[PeerPlane], until: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll every plane (5 ms each) until ``until()`` holds; fail after ``timeout_s``."""
    def step() -> bool:
        if until():
            return True
        for plane in planes:
            plane.poll(5)
        return False

    wait_until(step, "the peer planes' events", timeout_s, interval=0)  # poll(5) is the pause
