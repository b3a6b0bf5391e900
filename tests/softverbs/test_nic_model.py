"""The NIC model (softverbs._link): a shaped device lands a stream of writes at the configured bandwidth and
message rate, each request at least the base latency late, and keeps every QP's order; a request to the
device itself (loopback) is not shaped, and a device placing a peer's stream still sends its own on time.

The schedule is asserted exactly (the model's arithmetic); wall-clock measurements only where the brief
is the point, at rates far below what this machine does unshaped (about 100 MB/s against GB/s), and with
a band that a loaded machine cannot miss from below (the model never lets a write land early) and has a
10 % margin above.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from softverbs import soft
from softverbs._device import DeviceOptions
from softverbs._link import LinkModel
from softverbs._responder import WRITE_RUN_MAX
from tests.support.device_memory import ShmDeviceMemory
from tests.support.verbs_resources import QKEY, RCPair, SRDPair, open_provider, poll, wait_until


# --- the model's arithmetic ---------------------------------------------------------------------------------
def test_a_stream_is_spaced_by_its_bytes_over_the_bandwidth() -> None:
    link = LinkModel()
    lands = [link.schedule(10.0, 1000, 1e6, 0.0, None) for _ in range(4)]  # posted together at t = 10
    assert lands == pytest.approx([10.001, 10.002, 10.003, 10.004])
    assert link.stats() == pytest.approx({"messages": 4, "bytes": 4000, "busy_s": 0.004, "span_s": 0.004})


def test_the_message_rate_bounds_small_messages_and_latency_adds_to_each() -> None:
    link = LinkModel()
    assert link.schedule(0.0, 8, 1e9, 0.5, 100.0) == pytest.approx(0.51)  # 1/100 s beats 8 ns of bytes
    assert link.schedule(0.0, 8, 1e9, 0.5, 100.0) == pytest.approx(0.52)
    assert link.schedule(0.0, 10**8, 1e9, 0.5, 100.0) == pytest.approx(0.62)  # 100 ms of bytes beats 10 ms
    assert LinkModel.occupancy(100, None, None) == 0.0


def test_an_idle_link_starts_at_once_and_landing_never_goes_back() -> None:
    link = LinkModel()
    assert link.schedule(0.0, 1000, 1e6, 0.0, None) == pytest.approx(0.001)
    assert link.schedule(5.0, 1000, 1e6, 0.0, None) == pytest.approx(5.001)  # idle in between: from now
    assert link.stats()["span_s"] == pytest.approx(5.001)  # span > busy: the link went idle
    assert link.schedule(5.0, 1000, 1e6, 1.0, None) == pytest.approx(6.002)
    assert link.schedule(5.0, 1000, 1e6, 0.0, None) == pytest.approx(6.002)  # a lower latency: not earlier


def test_a_streamed_message_leaves_as_its_first_byte_lands_and_departures_never_go_back() -> None:
    link = LinkModel()
    land = link.schedule(0.0, 1000, 1e6, 0.5, None)
    assert (land, link.departure(land, 0.5, streamed=True)) == pytest.approx((0.501, 0.5))
    land = link.schedule(0.0, 1000, 1e6, 0.5, None)  # starts at 0.001, when the link is free
    assert link.departure(land, 0.5, streamed=False) == pytest.approx(0.502)
    land = link.schedule(0.0, 1000, 1e6, 0.1, None)  # a lower latency: its first byte would land at 0.102
    assert link.departure(land, 0.1, streamed=True) == pytest.approx(0.502)  # not before the one before left


# --- a shaped device ----------------------------------------------------------------------------------------
@pytest.fixture
def shaped() -> Any:
    provider = open_provider("soft")
    soft.device_stats("softib0", reset=True)
    yield provider
    soft.configure("softib0", nic_bandwidth=None, nic_latency_s=0.0, nic_message_rate=None,
                   nic_spin_s=DeviceOptions().nic_spin_s, nic_streaming=True)


@contextmanager
def _across(provider: Any, device: str = "softib0", **options: Any) -> Iterator[SimpleNamespace]:
    """A client QP on ``device`` (the device the tests shape) and its server on a second device: what a pair on
    one device sends is loopback, which never takes the wire and which the model leaves unshaped. Looks like
    an RCPair: ``client``, ``server``, ``send_wr`` (onto the server's MR), ``v``, and the server's ``ctx``."""
    name = f"softib-{uuid.uuid4().hex[:6]}"
    soft.add_device(name, "ib")
    with RCPair(provider, device, connect=False, **options) as a, \
            RCPair(provider, name, connect=False, **options) as b:
        a.connect(a.client, b.server)
        b.connect(b.server, a.client)

        def send_wr(opcode: Any, sge: Any, **kw: Any) -> Any:
            return a.send_wr(opcode, sge, **{"rkey": b.server.mr.rkey, "raddr": b.server.mr.buf, **kw})

        yield SimpleNamespace(v=a.v, client=a.client, server=b.server, send_wr=send_wr, ctx=b.ctx)


def _stream(pair: Any, n: int, size: int, nap: float = 0.0) -> float:
    """Post ``n`` writes of ``size`` bytes at once (the last signaled); seconds until its completion. The
    poll spins: ``nap`` seconds of sleep before it leave the device's I/O thread the interpreter."""
    e = pair.v.enums
    wrs = [pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(i * size % pair.client.mr.length, size), wr_id=i,
                        flags=int(e.IBV_SEND_SIGNALED) if i == n - 1 else 0,
                        raddr=pair.server.mr.buf + i * size % pair.server.mr.length) for i in range(n)]
    for a, b in zip(wrs, wrs[1:], strict=False):
        a.next_wr = b
    t0 = time.monotonic()
    pair.client.qp.post_send(wrs[0])
    time.sleep(nap)
    (wc,) = poll(pair.client.cq, timeout=60)
    assert wc.status == e.IBV_WC_SUCCESS
    return time.monotonic() - t0


def test_a_shaped_stream_lands_at_the_configured_bandwidth(shaped) -> None:
    """24 MiB at 100 MB/s, post to last completion. Never faster than the link (every attempt); within 10 %
    of it in one of three attempts: a loaded machine may stall the device's I/O thread for a while, the
    model never lets that make up a rate it does not have."""
    bandwidth, n, size = 100e6, 96, 256 << 10
    expected = n * size / bandwidth  # 0.25 s
    soft.configure("softib0", nic_bandwidth=bandwidth)
    ratios = []
    with _across(shaped, max_send_wr=128, mr_size=4 << 20) as pair:
        for _ in range(3):
            soft.device_stats("softib0", reset=True)
            elapsed = _stream(pair, n, size, nap=0.9 * expected)
            link = soft.device_stats("softib0")["link"]
            assert link["messages"] == n and link["bytes"] == n * size
            assert link["busy_s"] == pytest.approx(expected)
            assert link["span_s"] == pytest.approx(expected)  # posted faster than the link drains: never idle
            assert elapsed >= expected * 0.999, "a write landed before the link had carried it"
            ratios.append(elapsed / expected)
            if ratios[-1] <= 1.10:
                break
    assert min(ratios) <= 1.10, f"measured {[round(100 / r, 1) for r in ratios]} MB/s against 100 configured"


def test_base_latency_delays_every_write_by_at_least_the_configured_time(shaped) -> None:
    soft.configure("softib0", nic_latency_s=0.05)
    with _across(shaped) as pair:
        assert all(_stream(pair, 1, 64) >= 0.05 for _ in range(3))


def test_the_message_rate_spaces_small_writes(shaped) -> None:
    soft.configure("softib0", nic_message_rate=400.0)
    with _across(shaped, max_send_wr=128) as pair:
        elapsed = _stream(pair, 80, 64)  # 0.2 s at 400 writes/s
        link = soft.device_stats("softib0")["link"]
    assert link["span_s"] == pytest.approx(0.2) and elapsed >= 0.2 * 0.999


def test_a_shaped_qp_keeps_its_order_and_unshaping_lets_no_write_pass_a_queued_one(shaped) -> None:
    """Data then flag, shaped: the flag lands after every data byte. Unshaping while writes wait in the
    departure queue: later writes queue behind them."""
    soft.configure("softib0", nic_bandwidth=20e6, nic_latency_s=0.01)
    with _across(shaped, max_send_wr=64) as pair:
        e = pair.v.enums
        log: list[int] = []
        soft.set_placement_observer(pair.ctx, lambda qpn, addr, length: log.append(addr - pair.server.mr.buf))
        try:
            first = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, 256 << 10), flags=0)
            pair.client.qp.post_send(first)
            soft.configure("softib0", nic_bandwidth=None, nic_latency_s=0.0)
            flag = pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(512 << 10, 8),
                                raddr=pair.server.mr.buf + (512 << 10))
            pair.client.qp.post_send(flag)
            assert poll(pair.client.cq)[0].status == e.IBV_WC_SUCCESS
        finally:
            soft.set_placement_observer(pair.ctx, None)
    assert log[-1] == 512 << 10 and log[0] == 0


# --- who sends a shaped request: the posting thread when it lands soon, else the I/O thread -------------------
def _post_logged(pair: Any, writes: list[tuple[int, int]]) -> tuple[float, float, list[tuple[float, int]]]:
    """Post ``writes`` ((offset, bytes) from the client's MR to the same offset of the server's; the last
    signaled) in one chain; wait for its completion. (post time, when post_send returned, [(time, offset)] of
    each placement at the server, in order)."""
    e = pair.v.enums
    log: list[tuple[float, int]] = []
    soft.set_placement_observer(pair.ctx, lambda qpn, addr, length: log.append((time.monotonic(),
                                                                              addr - pair.server.mr.buf)))
    try:
        wrs = [pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(off, n), wr_id=i, raddr=pair.server.mr.buf + off,
                            flags=int(e.IBV_SEND_SIGNALED) if i == len(writes) - 1 else 0)
               for i, (off, n) in enumerate(writes)]
        for a, b in zip(wrs, wrs[1:], strict=False):
            a.next_wr = b
        t0 = time.monotonic()
        pair.client.qp.post_send(wrs[0])
        returned = time.monotonic()
        assert [wc.status for wc in poll(pair.client.cq, timeout=30)] == [e.IBV_WC_SUCCESS]
    finally:
        soft.set_placement_observer(pair.ctx, None)
    return t0, returned, log


def test_requests_that_land_within_the_wait_leave_from_the_posting_thread_once_they_land(shaped) -> None:
    """Latency 20 ms, ``nic_spin_s`` 50 ms: three small writes in one post land within it, so the posting
    thread sends them itself: its post returns only once they land (it waited for the model), none went through
    the departure queue, and each is placed no earlier than the model says, in order. With the wait 0 the same
    post hands them to the queue (the I/O thread sends them), and they still land no earlier."""
    latency = 0.02
    soft.configure("softib0", nic_latency_s=latency, nic_spin_s=0.05)
    writes = [(0, 64), (4096, 64), (8192, 8)]
    with _across(shaped) as pair:
        soft.device_stats("softib0", reset=True)
        t0, returned, log = _post_logged(pair, writes)
        stats = soft.device_stats("softib0")
        assert (stats["sent_at_post"], stats["departed"]) == (3, 0)
        assert returned - t0 >= latency, "the posting thread sent a request before the model let it land"
        assert [off for _, off in log] == [off for off, _ in writes]
        assert all(t - t0 >= latency for t, _ in log)

        soft.configure("softib0", nic_spin_s=0.0)
        soft.device_stats("softib0", reset=True)
        t0, _, log = _post_logged(pair, writes)
        stats = soft.device_stats("softib0")
        assert (stats["sent_at_post"], stats["departed"]) == (0, 3)
        assert [off for _, off in log] == [off for off, _ in writes]
        assert all(t - t0 >= latency for t, _ in log)


def test_a_post_that_sends_one_request_itself_and_queues_the_next_keeps_its_order(shaped) -> None:
    """One post on a 20 MB/s link with 1 ms latency and a 5 ms wait: a flag (lands in 1 ms: the posting thread
    sends it), 256 KiB (lands 13 ms later: queued, so the flag must leave before it can), another flag (lands
    after the 256 KiB, the link carrying one message after another: queued behind it). RC places them in that
    order, and every write completes (a request overtaking another would be out of sequence)."""
    soft.configure("softib0", nic_bandwidth=20e6, nic_latency_s=0.001, nic_spin_s=0.005)
    writes = [(512 << 10, 8), (0, 256 << 10), ((512 << 10) + 64, 8)]
    with _across(shaped, max_send_wr=64) as pair:
        soft.device_stats("softib0", reset=True)
        t0, _, log = _post_logged(pair, writes)
        stats = soft.device_stats("softib0")
    assert (stats["sent_at_post"], stats["departed"]) == (1, 2)
    assert [off for _, off in log] == [off for off, _ in writes]
    assert log[1][0] - t0 >= (256 << 10) / 20e6 + 0.001  # the large write: no earlier than the link carried it


def _shaped_direct_writes(provider: Any, streaming: bool) -> SimpleNamespace:
    """Device memory (an RC direct write, copied from the requester's memory): 2 MiB on a 20 MB/s link with 1 ms
    latency, which lands 106 ms after its post (``lands``), with softib0's ``nic_streaming`` as given; then the
    same write with an 8-byte flag after it. ``placed`` and ``completed``: when the first write was placed and
    when it completed, ``flag_log``: the second post's placements, all from their posts; ``stats``: softib0's."""
    size, bandwidth, latency = 2 << 20, 20e6, 0.001
    with ShmDeviceMemory() as memory, _across(provider, max_send_wr=64, mr_size=4 << 20, client_memory=memory,
                                               server_memory=memory) as pair:
        pair.client.write_buf(0, bytes(range(256)) * (size // 256))
        _post_logged(pair, [(0, 64)])  # unshaped: the first write crosses the wire with the peer's IMPORT
        soft.configure("softib0", nic_bandwidth=bandwidth, nic_latency_s=latency, nic_spin_s=0.0,
                       nic_streaming=streaming)
        soft.device_stats("softib0", reset=True)
        t0, _, log = _post_logged(pair, [(0, size)])
        completed = time.monotonic() - t0
        assert pair.server.read_buf(0, size) == pair.client.read_buf(0, size)
        t1, _, flag_log = _post_logged(pair, [(0, size), (3 << 20, 8)])
        return SimpleNamespace(lands=size / bandwidth + latency, placed=log[0][0] - t0, completed=completed,
                               flag_log=[(t - t1, off) for t, off in flag_log], stats=soft.device_stats("softib0"))


def test_a_shaped_direct_write_is_copied_as_the_link_carries_it_and_completes_once_it_lands(shaped) -> None:
    """It leaves as its first byte lands, so the responder's copy is done long before its landing, as a NIC
    places a write packet by packet, but its completion waits for the landing. A flag posted after it is placed
    after it, and no earlier than the link carried the data."""
    run = _shaped_direct_writes(shaped, streaming=True)
    assert run.placed < run.lands - 0.05, "the data was copied only once its last byte landed"
    assert run.completed >= run.lands, "a write completed before the link had carried it"
    assert [off for _, off in run.flag_log] == [0, 3 << 20]
    assert run.flag_log[1][0] >= run.lands, "the flag was placed before the link had carried the data"
    assert run.stats["direct_sent"] == 3 and run.stats["streamed"] == 3


def test_with_streaming_off_a_shaped_direct_write_is_copied_only_once_it_has_landed(shaped) -> None:
    """``nic_streaming`` off (store and forward: a write is placed only once all of it has arrived): it leaves
    when its last byte lands, so its copy starts no earlier than that; the order and the completion as above."""
    run = _shaped_direct_writes(shaped, streaming=False)
    assert run.placed >= run.lands, "the data was copied before its last byte landed"
    assert run.completed >= run.lands
    assert [off for _, off in run.flag_log] == [0, 3 << 20]
    assert run.flag_log[0][0] >= run.lands and run.flag_log[1][0] >= run.lands
    assert run.stats["direct_sent"] == 3 and run.stats["streamed"] == 0


@pytest.mark.parametrize("streaming", [True, False])
def test_a_shaped_srd_direct_write_imm_is_reported_on_both_sides_only_once_it_lands(streaming: bool) -> None:
    """SRD (efa's write-with-immediate, from device memory): 2 MiB on a 20 MB/s link with 1 ms latency lands
    106 ms after its post. It leaves as its first byte lands, so its bytes are copied early, but the
    receiver's completion (what efa's daemon counts a piece by) and the sender's both wait for the landing,
    told it by the descriptor. With ``nic_streaming`` off it leaves once it has landed: copied no earlier."""
    provider = open_provider("soft")
    v = provider.v
    size, bandwidth, latency = 2 << 20, 20e6, 0.001
    lands = size / bandwidth + latency
    name = f"softefa-{uuid.uuid4().hex[:6]}"
    soft.add_device(name, "efa")
    with ShmDeviceMemory() as memory, SRDPair(provider, "softefa0", mr_size=4 << 20, client_memory=memory) as a, \
            SRDPair(provider, name, mr_size=4 << 20, server_memory=memory) as b:
        e = v.enums
        gr = v.addr.GlobalRoute(dgid=b.gid, sgid_index=0)
        ah = v.addr.AH(a.pd, attr=v.addr.AHAttr(port_num=1, is_global=1, gr=gr))
        log: list[float] = []
        soft.set_placement_observer(b.ctx, lambda qpn, addr, length: log.append(time.monotonic()))

        def post(op: str, n: int, imm: int = 0) -> float:
            qp = a.client.qp
            qp.wr_start()
            qp.wr_id, qp.wr_flags = n, int(e.IBV_SEND_SIGNALED)
            if op == "write":
                qp.wr_rdma_write(b.server.mr.rkey, b.server.mr.buf)
            else:
                qp.wr_rdma_write_imm(b.server.mr.rkey, b.server.mr.buf, imm)
            qp.wr_set_ud_addr(ah, b.server.qp.qp_num, QKEY)
            qp.wr_set_sge(a.client.sge(0, n))
            t0 = time.monotonic()
            qp.wr_complete()
            return t0

        try:
            a.client.write_buf(0, bytes(range(256)) * (size // 256))
            post("write", 64)  # unshaped: the first write crosses the wire with the peer's IMPORT
            assert poll(a.client.cq)[0].status == e.IBV_WC_SUCCESS
            soft.configure("softefa0", nic_bandwidth=bandwidth, nic_latency_s=latency, nic_spin_s=0.0,
                           nic_streaming=streaming)
            soft.device_stats("softefa0", reset=True)
            log.clear()
            t0 = post("write_imm", size, imm=0x01020304)
            (recv,) = poll(b.server.cq, timeout=10)
            received = time.monotonic() - t0
            (sent,) = poll(a.client.cq, timeout=10)
            completed = time.monotonic() - t0
            assert recv.status == sent.status == e.IBV_WC_SUCCESS
            assert b.server.read_buf(0, size) == a.client.read_buf(0, size)
            if streaming:
                assert log and log[-1] - t0 < lands - 0.05, "the data was copied only once its last byte landed"
            else:
                assert log and log[0] - t0 >= lands, "streaming off, the data was copied before its last byte landed"
            assert received >= lands, "the receiver was told of the write before the link had carried it"
            assert completed >= lands, "the write completed before the link had carried it"
            assert soft.device_stats("softefa0")["streamed"] == int(streaming)
        finally:
            soft.set_placement_observer(b.ctx, None)
            soft.configure("softefa0", nic_bandwidth=None, nic_latency_s=0.0, nic_spin_s=DeviceOptions().nic_spin_s,
                           nic_streaming=True)
            ah.close()


def test_a_reopened_device_starts_with_its_link_free(shaped) -> None:
    """The link's schedule goes when the device's last context closes, with the requests still queued on it
    (they never leave): a request after the reopen lands by the model's own time, not behind one that never
    left, which would have held it to that one's landing."""
    name = f"softib-{uuid.uuid4().hex[:6]}"
    soft.add_device(name, "ib", nic_bandwidth=1e9, nic_latency_s=20.0)  # a write lands 20 s after its post
    with _across(shaped, device=name) as pair:
        e = pair.v.enums
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, 64)))
        assert soft.device_stats(name)["link"]["messages"] == 1  # scheduled, and still queued at the close
    soft.configure(name, nic_latency_s=1e-3)
    with _across(shaped, device=name) as pair:
        assert _stream(pair, 1, 64) < 10.0  # held behind the dropped write's landing, it took 20 s


def test_a_request_to_the_device_itself_is_loopback_and_never_shaped(shaped) -> None:
    """A NIC loops a request to itself back inside (an EFA rail's flag writes into its own GPU): it does
    not wait behind what the link carries to peers, and the link never counts it."""
    soft.configure("softib0", nic_bandwidth=1e3, nic_latency_s=30.0)  # a shaped write would take 30 s
    with shaped.rc_pair() as pair:
        soft.device_stats("softib0", reset=True)
        assert _stream(pair, 4, 4096) < 30.0
        assert soft.device_stats("softib0")["link"]["messages"] == 0


def test_configure_takes_the_nic_model_and_device_options_say_so(shaped) -> None:
    soft.configure("softefa0", nic_bandwidth=25e9, nic_latency_s=15e-6, nic_message_rate=2e6)
    try:
        opts = soft.device_options("softefa0")
        assert (opts.nic_bandwidth, opts.nic_latency_s, opts.nic_message_rate) == (25e9, 15e-6, 2e6)
        assert opts.shaped()
    finally:
        soft.configure("softefa0", nic_bandwidth=None, nic_latency_s=0.0, nic_message_rate=None)
    assert not soft.device_options("softefa0").shaped()
    with pytest.raises(TypeError, match="nic_bandwith"):
        soft.configure("softefa0", nic_bandwith=1.0)


# --- both directions at once --------------------------------------------------------------------------------
class _SlowCopier:
    """The emulated device memory's copier, each ``copy_many`` taking ``seconds`` (the wait for a GPU's copies,
    one for a run of them): what holds a responder's I/O thread while it places a stream of direct writes."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner, self.seconds, self.copies = inner, seconds, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def copy(self, dst: int, src: int, length: int) -> None:
        self.copy_many([(dst, src, length)])

    def copy_many(self, copies: list[tuple[int, int | memoryview, int]]) -> None:
        time.sleep(self.seconds)
        self.inner.copy_many(copies)
        self.copies += len(copies)


def test_a_device_placing_a_stream_of_direct_writes_still_sends_its_own_requests_on_time(shaped) -> None:
    """Two shaped devices; A streams direct writes to B, whose I/O thread places each by a slow copy, and B
    posts one write back and one to itself (loopback, as an efa rail's flags) meanwhile. While B is still
    placing A's stream: B's write leaves when the model says it lands (the thread that places also sends),
    its acknowledgement is read off its own connection, and B's loopback write is placed (the thread takes
    its connections in turns, a slice each, instead of draining one before the next). Before this was
    mended the two directions of a fused kernel's exchange took turns, and efa's flags came in bursts."""
    from tests.support.device_memory import ShmDeviceMemory

    name = f"softib-{uuid.uuid4().hex[:6]}"
    soft.add_device(name, "ib")
    for dev in ("softib0", name):
        soft.configure(dev, nic_bandwidth=1e9, nic_latency_s=1e-4)
    # runs of at most WRITE_RUN_MAX writes share a wait: at least 0.6 s of placing, room for a loaded machine
    size, stream, copy_s = 16 << 10, 6 * WRITE_RUN_MAX, 0.1
    memory = ShmDeviceMemory()
    slow = _SlowCopier(memory.copier, copy_s)
    try:
        with memory, RCPair(shaped, "softib0", connect=False, client_memory=memory, server_memory=memory,
                            max_send_wr=2 * stream) as a, \
                RCPair(shaped, name, connect=False, client_memory=memory, server_memory=memory) as b, \
                RCPair(shaped, name) as loop:  # B to itself
            soft.set_direct_copier(slow)  # B opens A's allocation with it
            e = a.v.enums
            a.connect(a.client, b.server)
            b.connect(b.server, a.client)
            b.connect(b.client, a.server)
            a.connect(a.server, b.client)

            def write(pair: RCPair, src: Any, dst: Any, wr_id: int, off: int = 0) -> None:
                src.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, src.sge(off, size), wr_id=wr_id,
                                              rkey=dst.mr.rkey, raddr=dst.mr.buf + off))

            def placed_when_it_lands(pair: RCPair, src: Any, dst: Any, marker: bytes) -> int:
                """Write ``marker`` from src to dst; how many of A's writes B had placed when it landed."""
                src.write_buf(0, marker)
                write(pair, src, dst, 100)
                wait_until(lambda: dst.read_buf(0, len(marker)) == marker, f"{marker[:6]!r} landed", interval=0.002)
                return slow.copies

            write(a, a.client, b.server, 0)  # the first crosses the wire while B opens A's allocation
            assert poll(a.client.cq)[0].status == e.IBV_WC_SUCCESS
            # B's loopback connection is made by its first write, which B's I/O thread accepts and then reads
            # in turns of its own: made now, so that what is measured below is only the turn-taking
            write(loop, loop.client, loop.server, 0)
            assert poll(loop.client.cq)[0].status == e.IBV_WC_SUCCESS
            for i in range(1, stream + 1):
                write(a, a.client, b.server, i, (i * size) % a.client.mr.length)
            wait_until(lambda: slow.copies, "B placing A's stream")
            landed = placed_when_it_lands(b, b.client, a.server, b"B to A" * 1000)
            assert [wc.status for wc in poll(b.client.cq, timeout=30)] == [e.IBV_WC_SUCCESS]
            completed = slow.copies
            looped = placed_when_it_lands(loop, loop.client, loop.server, b"B to B" * 1000)
            assert [wc.status for wc in poll(loop.client.cq, timeout=30)] == [e.IBV_WC_SUCCESS]
            assert [wc.status for wc in poll(a.client.cq, stream, timeout=30)] == [e.IBV_WC_SUCCESS] * stream
            # each went through between two runs of the stream's placements, not after the last of them
            assert max(landed, completed, looped) < stream, \
                f"of A's {stream} writes, B had placed {landed} when its write landed, {completed} when it " \
                f"completed, {looped} when its loopback write landed"
    finally:
        soft.set_direct_copier(None)
        for dev in ("softib0", name):
            soft.configure(dev, nic_bandwidth=None, nic_latency_s=0.0, nic_message_rate=None)


def test_the_io_thread_waits_awake_for_a_queued_departure_and_takes_input_meanwhile(shaped) -> None:
    """A (softib0) queues a write that lands 0.4 s after its post, and waits the last 0.3 s of it awake
    (``nic_spin_s``). A write from B posted inside that wait completes before A's lands: the waiting thread took
    B's request, placed it and acknowledged it in between. A's write lands no earlier than the model says, and
    A counts one departure waited for awake; with ``nic_spin_s`` 0 it counts none."""
    name = f"softib-{uuid.uuid4().hex[:6]}"
    soft.add_device(name, "ib")
    latency = 0.4
    with RCPair(shaped, "softib0", connect=False) as a, RCPair(shaped, name, connect=False) as b:
        e = a.v.enums
        a.connect(a.client, b.server)
        b.connect(b.server, a.client)
        b.connect(b.client, a.server)
        a.connect(a.server, b.client)

        def write(src: Any, dst: Any, pair: RCPair) -> None:
            src.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, src.sge(0, 64), rkey=dst.mr.rkey, raddr=dst.mr.buf))

        for spin, awaited in ((0.3, 1), (0.0, 0)):
            soft.configure("softib0", nic_latency_s=latency, nic_spin_s=spin)
            soft.device_stats("softib0", reset=True)
            t0 = time.monotonic()
            write(a.client, b.server, a)  # lands at t0 + 0.4: queued (beyond the spin), A awake from t0 + 0.1
            if spin:
                time.sleep(0.2)  # B's write goes in the middle of A's wait, not a condition waited for
                write(b.client, a.server, b)
                assert poll(b.client.cq)[0].status == e.IBV_WC_SUCCESS
                b_done = time.monotonic()
            assert poll(a.client.cq)[0].status == e.IBV_WC_SUCCESS
            assert time.monotonic() - t0 >= latency
            if spin:
                assert b_done - t0 < latency, "B's write waited for A's departure"
            stats = soft.device_stats("softib0")
            assert (stats["departed"], stats["sent_at_post"], stats["departures_awaited"]) == (1, 0, awaited)
