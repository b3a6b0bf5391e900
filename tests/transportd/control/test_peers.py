"""The peer plane over real zmq TCP sockets: hellos, goodbyes and a peer daemon's next life."""

from __future__ import annotations

import time

import zmq

from tests.support.peer_planes import Events, pump
from transportd.control.protocol import PeerBye, PeerRegions
from transportd_cli.localcluster import free_port


def test_a_restarted_peer_is_reported_down_then_up_before_any_heartbeat_timeout() -> None:
    pa, pb = free_port(), free_port()
    ea, eb = Events(), Events()
    a = ea.plane("a", pa, (f"127.0.0.1:{pb}",))
    b = eb.plane("b", pb, (f"127.0.0.1:{pa}",))
    try:
        pump([a, b], lambda: ("up", "b") in ea.log and ("up", "a") in eb.log)
        first = a.peers["b"].incarnation
        assert first == b.incarnation != 0
        b.close()  # the daemon dies without a goodbye and comes back on the same address
        b = Events().plane("b", pb, (f"127.0.0.1:{pa}",))
        assert b.incarnation != first
        pump([a, b], lambda: ea.log.count(("up", "b")) == 2 and "a" in b.peers)
        assert ea.log == [("up", "b"), ("down", "b"), ("up", "b")]
        assert a.peers["b"].incarnation == b.incarnation
        # messages from the new life reach the handler
        assert b.send("a", PeerRegions(job="j", rank=1, regions=()))
        pump([a, b], lambda: ("peer_regions", "b") in ea.log)
    finally:
        a.close()
        b.close()


def test_a_goodbye_reports_the_peer_down_once_and_its_next_life_up() -> None:
    pa, pb = free_port(), free_port()
    ea = Events()
    a = ea.plane("a", pa, (f"127.0.0.1:{pb}",))
    b = Events().plane("b", pb, (f"127.0.0.1:{pa}",))
    try:
        # both links answered their hellos: from now on each node sends on its own link only, so nothing b
        # sent before its goodbye can overtake it on the other link
        pump([a, b], lambda: all(p.peers.get(n) and p.peers[n].dealer is not None for p, n in ((a, "b"), (b, "a"))))
        b.broadcast(PeerBye(node="b", reason="shutdown"))
        b.goodbye("shutdown")
        pump([a, b], lambda: ("down", "b") in ea.log)
        for _ in range(20):  # b keeps polling: nothing, not even a heartbeat echo, may follow its goodbye
            a.poll(5)
            b.poll(5)
        assert ea.log == [("up", "b"), ("down", "b")]  # the second goodbye changes nothing; no handler sees it
        b.close()
        b = Events().plane("b", pb, (f"127.0.0.1:{pa}",))
        pump([a, b], lambda: ea.log.count(("up", "b")) == 2)
        assert ea.log == [("up", "b"), ("down", "b"), ("up", "b")]
    finally:
        a.close()
        b.close()


def test_messages_before_a_hello_are_warned_about_once(caplog) -> None:
    """A restarted peer's heartbeats can arrive before its hello: one warning, not one per message."""
    import logging

    from transportd.control import codec
    from transportd.control.protocol import PeerHeartbeat

    pa = free_port()
    a = Events().plane("a", pa, ())
    early = zmq.Context.instance().socket(zmq.DEALER)
    early.linger = 0
    early.routing_id = b"b"
    early.connect(f"tcp://127.0.0.1:{pa}")
    try:
        with caplog.at_level(logging.DEBUG, logger="transportd.control.peers"):
            for seq in range(20):
                early.send(codec.encode(PeerHeartbeat(seq * 2, time.time()).to_msg()))
            pump([a], lambda: sum("before its hello" in r.getMessage() for r in caplog.records) == 19)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == ["messages from b, which has not said hello, are dropped until it does "
                            "(first: peer_heartbeat)"]
        assert "b" not in a.peers
    finally:
        early.close()
        a.close()


def test_a_hello_of_the_life_that_said_goodbye_does_not_bring_it_back() -> None:
    """A hello sent before the goodbye can arrive after it (hellos are answered on the other link): that life
    is over; only a hello of a later life brings the node back up, and a late one of an earlier life is no
    restart."""
    from transportd.control import codec
    from transportd.control.protocol import PeerHeartbeat, PeerHello

    pa = free_port()
    ea = Events()
    a = ea.plane("a", pa, ())
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    raw.routing_id = b"b"
    raw.connect(f"tcp://127.0.0.1:{pa}")

    def say(msg) -> None:
        raw.send(codec.encode(msg.to_msg()))

    try:
        say(PeerHello(node="b", backend="ib", rails=1, incarnation=7))
        say(PeerBye(node="b", reason="shutdown"))
        say(PeerHello(node="b", backend="ib", rails=1, incarnation=7))  # overtaken, from before the goodbye
        say(PeerHeartbeat(seq=2, t=0.0))
        say(PeerRegions(job="j", rank=1, regions=()))
        say(PeerHello(node="b", backend="ib", rails=1, incarnation=8))  # the next life
        say(PeerHello(node="b", backend="ib", rails=1, incarnation=7))  # queued before the restart, late
        say(PeerRegions(job="j", rank=1, regions=()))
        pump([a], lambda: ("peer_regions", "b") in ea.log)
        assert ea.log == [("up", "b"), ("down", "b"), ("up", "b"), ("peer_regions", "b")]
        assert a.peers["b"].incarnation == 8
    finally:
        raw.close()
        a.close()


def test_a_hello_whose_link_closed_before_it_was_read_is_no_error() -> None:
    """A peer that says hello and dies at once (or restarts) leaves its hello queued on a link that is gone:
    answering it finds no one (ROUTER_MANDATORY: EHOSTUNREACH), and that must not escape ``poll``."""
    from transportd.control import codec
    from transportd.control.protocol import PeerHello

    pa = free_port()
    ea = Events()
    a = ea.plane("a", pa, ())
    monitor = a.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 5000  # the hello is delivered before the link goes
    raw.routing_id = b"b"
    raw.connect(f"tcp://127.0.0.1:{pa}")
    try:
        raw.send(codec.encode(PeerHello(node="b", backend="ib", rails=1, incarnation=5).to_msg()))
        raw.close()
        assert monitor.poll(10_000), "the router never saw the link close"
        monitor.recv_multipart()
        pump([a], lambda: ("up", "b") in ea.log)  # read after the link closed, answered to no one
        assert a.peers["b"].incarnation == 5
    finally:
        a.router.disable_monitor()
        monitor.close()
        a.close()
