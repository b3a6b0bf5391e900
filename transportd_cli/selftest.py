"""``transportctl selftest``: check every link of this node (each peer daemon, each rail) with a job of the
daemons' own.

Near side (this module's :func:`run_selftest`, in the ``transportctl`` process; the far side and the
rules both follow are ``transportd.ops.selftest``): for each link it asks the
node's daemon to start a self-test on the peer (control op ``selftest``, forwarded as ``peer_selftest`` on
the authenticated peer plane), joins rank 0 of that job on the rail under test like any client, and
exchanges. The far daemon joins rank 1 itself (:class:`EchoResponder`: its own memory, flags and ring, no
user process there) and echoes every flag it sees back to rank 0 with the data that flag covers, having
checked that data the moment the flag appeared. So both directions of the link carry checked data, and
the round trip is timed on one clock:

    put -> flag (one way) = (round trip - the far side's turnaround) / 2

Rounds: PUT_SIGNAL with ADD, PUT_SIGNAL with SET, PUT then SIGNAL (ADD), 4 KiB each, under the signal
mode the nodes' config chose (``signal.mode`` is one per node: the table says which); a 1 MiB PUT_SIGNAL;
GB/s from eight 1 MiB PUTs until ``quiet``; and one record out of bounds, which must come back as
OUT_OF_BOUNDS in the channel's error word without being posted. Every wait is bounded by ``timeout``: a
stopped peer or one that never authenticated is a failed link, never a hang.
"""

from __future__ import annotations

import secrets
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import gpuclient
from gpuclient.session import ChannelError, Session
from transportd.control.client import ControlConnection
from transportd.control.protocol import Join, Selftest
from transportd.errors import ErrorCode, RequestError, TransportdError
from transportd.ops.selftest import (
    BIG,
    FAR_REGION,
    MIB,
    MODES,
    RECV_REGION,
    REGION_BYTES,
    SEND_REGION,
    SLOTS,
    check_data,
    pattern,
    segment,
)

__all__ = ["LinkResult", "format_table", "run_selftest"]


@dataclass
class LinkResult:
    node: str
    rail: int
    ok: bool = False
    reason: str = ""
    checks: dict[str, str] = field(default_factory=dict)  # what -> "ok" or why not
    put_flag_p50_us: float | None = None
    put_flag_p99_us: float | None = None
    put_flag_1mib_us: float | None = None
    gbps_1mib: float | None = None
    far: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "rail": self.rail, "ok": self.ok, "reason": self.reason, "checks": self.checks,
                "put_flag_p50_us": self.put_flag_p50_us, "put_flag_p99_us": self.put_flag_p99_us,
                "put_flag_1mib_us": self.put_flag_1mib_us, "gbps_1mib": self.gbps_1mib,
                "far": {k: v for k, v in self.far.items() if k != "turnaround_us"}}


NO_PEERS = ("no link to test: this node lists no peers.static and no peer has connected (set peers.static, or run "
            "it where the other nodes' daemons are)")

def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_selftest(endpoint: str, *, curve: Any = None, rounds: int = 20, timeout: float = 10.0,
                 bandwidth_puts: int = 8) -> dict[str, Any]:
    """Test every (peer, rail) link of the daemon at ``endpoint``; returns the JSON document ``--json`` prints."""
    with ControlConnection(endpoint, timeout_ms=int(timeout * 1000), name="transportctl", curve=curve) as conn:
        info = conn.request(Selftest(action="links"))
    results = []
    for link in info["links"]:
        rails = range(info["rails"]) if link["up"] else range(1)
        for rail in rails:
            results.append(_run_link(endpoint, curve, info, link, rail, rounds, timeout, bandwidth_puts))
    doc = {"node": info["node"], "backend": info["backend"], "signal_mode": info["signal_mode"],
           "decoupled": info["decoupled"], "rails": info["rails"], "ok": bool(results) and all(r.ok for r in results),
           "links": [r.to_json() for r in results]}
    if not results:  # nothing tested is no proof of anything: not ok
        doc["reason"] = NO_PEERS
    return doc


def _run_link(endpoint: str, curve: Any, info: dict[str, Any], link: dict[str, Any], rail: int, rounds: int,
              timeout: float, bandwidth_puts: int) -> LinkResult:
    result = LinkResult(link["node"], rail)
    if not link["up"]:
        result.reason = link.get("why") or "peer is down"
        return result
    if rail >= link["rails"]:
        result.reason = f"the peer has {link['rails']} rail(s): rail {rail} has no peer there"
        return result
    try:
        _exercise(endpoint, curve, link["node"], rail, rounds, timeout, bandwidth_puts, result)
    except (TransportdError, TimeoutError, OSError) as exc:
        result.reason = result.reason or f"{type(exc).__name__}: {exc}"
    result.ok = not result.reason and all(v == "ok" for v in result.checks.values())
    if not result.ok and not result.reason:
        result.reason = "; ".join(f"{k}: {v}" for k, v in result.checks.items() if v != "ok")
    return result


def _exercise(endpoint: str, curve: Any, node: str, rail: int, rounds: int, timeout: float, bandwidth_puts: int,
              result: LinkResult) -> None:
    job = f"selftest-{secrets.token_hex(8)}"
    seed = secrets.randbits(63)
    conn = ControlConnection(endpoint, timeout_ms=int(timeout * 1000), name="transportctl", curve=curve)
    session: Session | None = None
    started = False
    try:
        def far_error() -> str:
            return str(conn.request(Selftest(action="status", job=job)).get("error") or "")

        conn.request(Selftest(action="start", job=job, node=node, rail=rail, seed=seed))
        started = True
        reply = conn.request(Join(job=job, rank=0, world=2, device=-1, rail=rail))
        session = Session(conn, job, 0, 2, reply)
        send, recv = gpuclient.host_array(REGION_BYTES), gpuclient.host_array(REGION_BYTES)
        assert session.register(send).id == SEND_REGION and session.register(recv).id == RECV_REGION
        flags = session.flags(SLOTS)
        deadline = time.monotonic() + timeout
        while not session.exchange(wait=False).get("complete"):
            why = far_error()
            if why:
                raise RequestError("selftest", f"far side: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the far side did not join within {timeout:g}s")
            time.sleep(0.01)
        ch = session.channel(256)

        def wait_flag(slot: int, value: int) -> float:
            """Seconds until flag ``slot`` reads ``value`` (spinning with naps); bounded by ``timeout``."""
            end = time.monotonic() + timeout
            pause = 0.0
            while int(flags.values[slot]) != value:
                if flags.status:
                    raise ChannelError(flags.status)
                code = ch.status()[0]
                if code:
                    raise ChannelError(*ch.status())
                if time.monotonic() > end:
                    raise TimeoutError(f"flag {slot} did not come back as {value} within {timeout:g}s")
                time.sleep(pause)
                pause = min(pause * 2 or 5e-6, 200e-6)
            return time.monotonic()

        turn = {}  # filled from the far report: (slot, value) -> seconds
        samples: dict[tuple[int, int], float] = {}  # (slot, value) -> round trip seconds
        verdicts: dict[str, list[str]] = {name: [] for name, _, _ in MODES}
        verdicts["1 MiB put_signal"] = []

        def one_round(name: str, slot: int, op: str, value: int) -> None:
            off, length = segment(slot)
            expected = pattern(seed, slot, value, length)
            send[off:off + length] = expected
            t0 = time.monotonic()
            if name == "put + signal add":
                ch.put(peer=1, dst_region=FAR_REGION, dst_off=off, src_region=SEND_REGION, src_off=off, nbytes=length)
                ch.signal(peer=1, slot=slot, value=1, op="add")
            else:
                ch.put_signal(peer=1, dst_region=FAR_REGION, dst_off=off, src_region=SEND_REGION, src_off=off,
                              nbytes=length, slot=slot, value=1 if op == "add" else value, op=op)
            t3 = wait_flag(slot, value)
            samples[(slot, value)] = t3 - t0
            verdicts[name].append(check_data(recv[off:off + length], expected))

        for value in range(1, rounds + 1):
            for name, slot, op in MODES:
                one_round(name, slot, op, value)
        for value in (1, 2):
            one_round("1 MiB put_signal", BIG, "add", value)
        # bandwidth: 1 MiB puts back to back, timed until quiet says the last one completed
        t0 = time.monotonic()
        for _ in range(bandwidth_puts):
            ch.put(peer=1, dst_region=FAR_REGION, dst_off=0, src_region=SEND_REGION, src_off=0, nbytes=MIB)
        ch.quiet(timeout=timeout)
        result.gbps_1mib = bandwidth_puts * MIB / (time.monotonic() - t0) / 1e9
        # a bad record: past the end of the far region; refused with its code, never posted
        position = ch.put(peer=1, dst_region=FAR_REGION, dst_off=REGION_BYTES, src_region=SEND_REGION, src_off=0,
                          nbytes=8)
        try:
            ch.quiet(timeout=timeout)
            result.checks["bad record"] = "an out-of-bounds record was accepted"
        except ChannelError as exc:
            want = (int(ErrorCode.OUT_OF_BOUNDS), 1, position)
            got = (exc.code, exc.count, exc.position)
            result.checks["bad record"] = "ok" if got == want else f"error word {got}, expected {want}"

        conn.request(Selftest(action="finish", job=job))
        end = time.monotonic() + timeout
        while True:
            status = conn.request(Selftest(action="status", job=job))
            if status.get("report") is not None or status.get("error"):
                break
            if time.monotonic() > end:
                raise TimeoutError(f"the far side's report did not come within {timeout:g}s")
            time.sleep(0.01)
        if status.get("error"):
            raise RequestError("selftest", f"far side: {status['error']}")
        far = dict(status["report"])
        result.far = far
        for slot, value, us in far.get("turnaround_us", []):
            turn[(int(slot), int(value))] = float(us) / 1e6
        for name, found in verdicts.items():
            bad = [v for v in found if v != "ok"]
            result.checks[name] = ("ok" if not bad else
                                   f"{len(bad)} of {len(found)} echoes {', '.join(sorted(set(bad)))}")
        result.checks["far side data"] = ("ok" if far.get("early", 0) == 0 and far.get("corrupt", 0) == 0
                                          else f"{far.get('early', 0)} flag(s) seen before their data, "
                                               f"{far.get('corrupt', 0)} with wrong data")
        if any(far.get("ring_error", [0])[:1]):
            code, count, position = far["ring_error"]
            result.checks["far side echoes"] = (f"{count} echo record(s) refused, the first with "
                                                f"{ErrorCode(code).name} at ring position {position}")
        expected_echoes = rounds * len(MODES) + 2
        if far.get("echoes") != expected_echoes:
            result.checks["far side echoes"] = f"{far.get('echoes')} echoes, expected {expected_echoes}"
        one_way = [(rtt - turn.get(key, 0.0)) / 2 for key, rtt in samples.items() if key[0] != BIG]
        big = [(rtt - turn.get(key, 0.0)) / 2 for key, rtt in samples.items() if key[0] == BIG]
        if one_way:
            result.put_flag_p50_us = statistics.median(one_way) * 1e6
            result.put_flag_p99_us = _percentile(one_way, 0.99) * 1e6
        if big:
            result.put_flag_1mib_us = statistics.median(big) * 1e6
    finally:
        try:
            if session is not None:
                session.leave()
            elif started:
                conn.request(Selftest(action="finish", job=job))
        except (TransportdError, TimeoutError, OSError):
            pass
        conn.close()


def format_table(doc: dict[str, Any]) -> str:
    """The human table: one line per link, a verdict each."""
    header = ["peer", "rail", "verdict", "put->flag p50 us", "p99 us", "1 MiB us", "GB/s 1 MiB", "detail"]

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    rows = [[link["node"], str(link["rail"]), "PASS" if link["ok"] else "FAIL", num(link["put_flag_p50_us"], ".1f"),
             num(link["put_flag_p99_us"], ".1f"), num(link["put_flag_1mib_us"], ".1f"), num(link["gbps_1mib"], ".3f"),
             "checked: " + ", ".join(link["checks"]) if link["ok"] else link["reason"]] for link in doc["links"]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [f"selftest of node {doc['node']}: backend {doc['backend']}, signal.mode {doc['signal_mode']}"
             f"{' (decoupled)' if doc['decoupled'] else ''}, {doc['rails']} rail(s)"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if not rows:
        lines.append(f"FAILED: {NO_PEERS}")
        return "\n".join(lines)
    failed = sum(1 for link in doc["links"] if not link["ok"])
    lines.append(f"{len(rows) - failed} of {len(rows)} link(s) passed" + (f", {failed} FAILED" if failed else ""))
    return "\n".join(lines)
