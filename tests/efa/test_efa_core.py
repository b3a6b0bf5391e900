"""The compiled efa path (efa/csrc/efa_post.c) at the libibverbs ABI, against its Python models.

Sending: an ``EfaPoster`` drives an ``SrdShimQP``; every record reaching ``wr_rdma_write_imm`` /
``wr_set_sge`` / ``wr_set_ud_addr`` is compared, call by call, with ``transportd_models/efa_lowering.py`` (the
Python lowering EfaBackend ran before): immediates, lengths, splits, the control records' bytes, flags.
Receiving: scripted completion streams (split writes, records, reordered, never duplicated) reach the
poster through a ``ShimCQ``'s ``read_*`` function pointers; the flags it publishes must be exactly those
:class:`transportd_models.arrivals.ArrivalTracker` releases for the same stream, poll by poll.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field

import numpy as np
import pytest

from efa.backend import PUB_DTYPE
from efa.srd_shim import SET_SGE, SET_UD, SRD_WR_DTYPE
from efa.wire import CTRL_DTYPE, CTRL_SIZE, KIND_CTRL, decode_imm
from transportd import _core
from transportd.backends.interface import COMPLETION_DTYPE, PLAN_DTYPE, PlanOp, SignalOp
from transportd.backends.verbs_common import WC_DTYPE
from transportd.errors import BackendError, VerbsError
from transportd_models.arrivals import ArrivalTracker, SenderGroups
from transportd_models.efa_lowering import OracleWr, lower

SIGNALED = 2
RECV_RDMA_WITH_IMM = 129
SEQ_BITS = 48


@dataclass
class Harness:
    """An EfaPoster on shim structs: WRs collected (with the record bytes they point at), completions scripted."""

    max_rdma_size: int = 4096
    sq_depth: int = 1 << 14
    cumulative: bool = False
    wrs: list[np.ndarray] = field(default_factory=list)
    records: list[bytes] = field(default_factory=list)  # what each WR's SGE pointed at, at wr_complete
    wcs: list[np.ndarray] = field(default_factory=list)  # completion chunks the CQ will hand out
    pubs: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.qp = _core.SrdShimQP(self._post, 77)
        self.cq = _core.ShimCQ(self._poll, 4096)
        self.poster = _core.EfaPoster(self.qp, self.cq, max_rdma_size=self.max_rdma_size, sq_depth=self.sq_depth,
                                      rq_depth=0, cumulative=self.cumulative, unsolicited=True,
                                      visibility_flush=True, on_pass=self._on_pass, backend_error=BackendError,
                                      verbs_error=VerbsError)
        self.keep: list[np.ndarray] = []

    def _post(self, buf: bytes) -> int:
        rows = np.frombuffer(buf, dtype=SRD_WR_DTYPE).copy()
        self.wrs.append(rows)
        for r in rows:
            n = int(r["sge_length"])
            self.records.append(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(
                int(r["sge_addr"]))).tobytes() if n == CTRL_SIZE else b"")
        return 0

    def _poll(self, n: int) -> bytes:
        if not self.wcs:
            return b""
        chunk = self.wcs.pop(0)
        assert len(chunk) <= n
        return chunk.tobytes()

    def _on_pass(self, pubs: bytes, failures: list[tuple[int, str]], replenish: int, flush: bool) -> None:
        self.pubs += [tuple(r) for r in np.frombuffer(pubs, dtype=PUB_DTYPE)[["conn", "rank", "slot", "op",
                                                                               "value"]].tolist()]
        self.failures += failures

    def add(self, conn: int, index: int, key: int, *, peer_index: int, staging_entries: int = 4096,
            base: int = 1 << 30, ah: int = 5, qpn: int = 900, qkey: int = 0x1111) -> dict:
        recv = np.zeros(staging_entries, dtype=CTRL_DTYPE)
        send = np.zeros(staging_entries, dtype=CTRL_DTYPE)
        self.keep += [recv, send]
        self.poster.add_connection(conn, index, key, 0, base, recv.ctypes.data, staging_entries)
        peer_staging = 0x7000_0000
        self.poster.connect(conn, peer_index, ah, qpn, qkey, peer_staging, 0xABC, staging_entries, send.ctypes.data,
                            0xDEF)
        return {"recv": recv, "send": send, "peer_staging": peer_staging, "ah": ah, "qpn": qpn, "qkey": qkey,
                "entries": staging_entries, "peer_index": peer_index, "key": key, "base": base}

    def posted(self) -> np.ndarray:
        return np.concatenate(self.wrs) if self.wrs else np.zeros(0, dtype=SRD_WR_DTYPE)


def random_plan(rng: random.Random, n: int, max_rdma_size: int, token0: int) -> np.ndarray:
    rows = []
    token = token0
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            length = rng.choice((0, 1, 8, max_rdma_size - 1, max_rdma_size, max_rdma_size + 1,
                                 rng.randint(1, 5 * max_rdma_size)))
            rows.append((PlanOp.WRITE, 0, 0, length, 0x1000_0000 + rng.randrange(1 << 20),
                         0x2000_0000 + rng.randrange(1 << 20), 11, 22, 0, 0, 0, token))
        elif r < 0.85:
            rows.append((PlanOp.SIGNAL, rng.choice((SignalOp.ADD, SignalOp.SET)), rng.randrange(3), 8, 0, 0, 0, 0,
                         rng.randrange(1, 1 << 40), rng.randrange(4), 0, token))
        else:
            rows.append((PlanOp.FENCE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, token))
        if rng.random() < 0.3:
            token = 0 if rng.random() < 0.2 else token + 1
    return np.array(rows, dtype=PLAN_DTYPE)


def check_against_oracle(got: np.ndarray, records: list[bytes], want: list[OracleWr], conn: dict, seq0: int) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got.tolist(), want, strict=True)):
        wr_id, raddr, sge_addr, ah, length, lkey, rkey, flags, imm, qpn, qkey, opcode, setters, _ = g
        assert opcode == 1, "wr_rdma_write_imm"
        assert flags == SIGNALED, "every WR signaled, nothing else (no fence, no inline)"
        assert setters == SET_SGE | SET_UD
        assert (ah, qpn, qkey) == (conn["ah"], conn["qpn"], conn["qkey"])
        assert wr_id == (conn["key"] << SEQ_BITS) | (seq0 + k)
        assert (rkey, raddr, length, socket.ntohl(imm)) == (w.rkey, w.raddr, w.length, w.imm), k
        if w.record:
            assert lkey == 0xDEF
            assert records[k] == w.record
        else:
            assert (sge_addr, lkey) == (w.laddr, w.lkey)


@pytest.mark.parametrize("cumulative", (False, True))
def test_lowering_matches_the_python_oracle_call_by_call(cumulative: bool) -> None:
    rng = random.Random(7 if cumulative else 8)
    h = Harness(max_rdma_size=4096, cumulative=cumulative)
    c = h.add(3, index=9, key=4, peer_index=21)
    groups = SenderGroups(cumulative=cumulative)
    seq = c["base"]
    token = 1
    for _ in range(200):
        plan = random_plan(rng, rng.randint(1, 12), 4096, token)
        token = int(plan["token"].max()) + 1
        want, batches = lower(groups, plan, max_rdma_size=4096, peer_index=21, staging_addr=c["peer_staging"],
                              staging_rkey=0xABC, staging_entries=c["entries"])
        before = len(h.records)
        assert h.poster.post(3, plan) == len(want) == sum(batches)
        check_against_oracle(h.posted()[before:], h.records[before:], want, c, seq)
        seq += len(want)
    assert h.qp.calls == 200  # one Python call per post


def test_post_batches_counts_and_one_wr_list_per_pass() -> None:
    h = Harness(max_rdma_size=1000)
    ca = h.add(1, index=0, key=1, peer_index=5)
    cb = h.add(2, index=1, key=2, peer_index=6, base=1 << 20)
    rng = random.Random(3)
    pa, pb = (random_plan(rng, 8, 1000, t) for t in (1, 100))
    pa["token"], pb["token"] = 1, 2  # one token per slice, as the engine's batches
    plan = np.concatenate([pa, pb])
    ids = np.array([1, 2], dtype=np.int64)
    bounds = np.array([0, len(pa), len(plan)], dtype=np.int64)
    counts = np.frombuffer(h.poster.post_batches(ids.tobytes(), plan.tobytes(), bounds.tobytes()), dtype=np.int64)
    wa, _ = lower(SenderGroups(), pa, max_rdma_size=1000, peer_index=5, staging_addr=ca["peer_staging"],
                  staging_rkey=0xABC, staging_entries=4096)
    wb, _ = lower(SenderGroups(), pb, max_rdma_size=1000, peer_index=6, staging_addr=cb["peer_staging"],
                  staging_rkey=0xABC, staging_entries=4096)
    assert counts.tolist() == [len(wa), len(wb)]
    assert h.qp.calls == 1
    got = h.posted()
    check_against_oracle(got[:len(wa)], h.records[:len(wa)], wa, ca, ca["base"])
    check_against_oracle(got[len(wa):], h.records[len(wa):], wb, cb, cb["base"])


def send_wcs(wr_ids: list[int], statuses: dict[int, int] | None = None) -> np.ndarray:
    out = np.zeros(len(wr_ids), dtype=WC_DTYPE)
    out["wr_id"] = wr_ids
    out["opcode"] = 1  # IBV_WC_RDMA_WRITE
    if statuses:
        out["status"] = [statuses.get(w, 0) for w in wr_ids]
    return out


def test_tokens_complete_when_all_their_wrs_have_in_any_order_with_the_first_error() -> None:
    h = Harness(max_rdma_size=512)
    h.add(3, index=2, key=7, peer_index=1)
    rows = [(PlanOp.WRITE, 0, 0, 2000, 0x1000, 0x2000, 1, 2, 0, 0, 0, 10),
            (PlanOp.SIGNAL, 0, 1, 8, 0, 0, 0, 0, 5, 1, 0, 10),
            (PlanOp.WRITE, 0, 0, 100, 0x1000, 0x2000, 1, 2, 0, 0, 0, 11),
            (PlanOp.FENCE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12)]
    assert h.poster.post(3, np.array(rows, dtype=PLAN_DTYPE)) == 4 + 1 + 1 + 1
    ids = h.posted()["wr_id"].tolist()
    assert h.poster.inflight(3) == 7
    rng = random.Random(1)
    order = ids[:]
    rng.shuffle(order)
    failed = ids[2]  # a piece of token 10
    h.wcs = [send_wcs(order[:3], {failed: 10}), send_wcs(order[3:], {failed: 10})]
    got = []
    for _ in range(2):
        got += np.frombuffer(h.poster.poll(64), dtype=COMPLETION_DTYPE).tolist()
    assert sorted(got) == [(10, 10, 0), (11, 0, 0), (12, 0, 0)]
    assert h.poster.inflight(3) == 0
    assert h.poster.submitted == 0


def test_send_queue_and_staging_windows_hold_wrs_back() -> None:
    h = Harness(sq_depth=8)
    h.add(3, index=2, key=7, peer_index=1, staging_entries=64)
    plan = np.array([(PlanOp.SIGNAL, 0, 0, 8, 0, 0, 0, 0, 1, 0, 0, 1 + k // 8) for k in range(100)], dtype=PLAN_DTYPE)
    assert h.poster.post(3, plan) == 100
    assert len(h.posted()) == 8 and h.poster.backlog == 92  # the SQ holds 8
    done = 0
    tokens = []
    while done < 100:
        new = h.posted()["wr_id"].tolist()[done:]
        done += len(new)
        h.wcs = [send_wcs(new)]
        tokens += np.frombuffer(h.poster.poll(64), dtype=COMPLETION_DTYPE)["token"].tolist()
        assert len(h.posted()) - done <= 8  # never more on the SQ than it holds
    assert tokens == list(range(1, 14))
    seqs = np.frombuffer(b"".join(h.records), dtype=CTRL_DTYPE)["seq"].tolist()
    assert seqs == list(range(100))
    assert h.poster.stats()["backlogged"] > 0

    # the staging window alone: 32 (half of 64) records in flight at most, whatever the SQ room
    h2 = Harness()
    h2.add(3, index=2, key=7, peer_index=1, staging_entries=64)
    assert h2.poster.post(3, plan) == 100
    assert len(h2.posted()) == 32
    first = h2.posted()["wr_id"].tolist()
    h2.wcs = [send_wcs(first[1:])]  # record 0 still in flight: nothing more may go
    h2.poster.poll(64)
    assert len(h2.posted()) == 32
    h2.wcs = [send_wcs(first[:1])]
    h2.poster.poll(64)
    assert len(h2.posted()) == 64


def test_unknown_op_rolls_back_and_raises() -> None:
    h = Harness()
    c = h.add(3, index=2, key=7, peer_index=1)
    bad = np.array([(PlanOp.WRITE, 0, 0, 8, 0, 0, 1, 2, 0, 0, 0, 1), (9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1)],
                   dtype=PLAN_DTYPE)
    with pytest.raises(BackendError, match="unknown op 9"):
        h.poster.post(3, bad)
    with pytest.raises(BackendError, match="unknown connection 4"):
        h.poster.post(4, bad[:1])
    good = bad[:1]
    assert h.poster.post(3, good) == 1
    want, _ = lower(SenderGroups(), good, max_rdma_size=4096, peer_index=1, staging_addr=c["peer_staging"],
                    staging_rkey=0xABC, staging_entries=4096)
    check_against_oracle(h.posted(), h.records, want, c, c["base"])  # group 0 again: nothing half-applied


# --- receiving: the C arrival counting against transportd_models.arrivals ------------------------------------


def arrival_stream(rng: random.Random, groups: SenderGroups, n_rows: int, index: int, entries: int,
                   recv: np.ndarray) -> list[int]:
    """Immediates of a random sender's WRs to connection ``index``; records written into ``recv``."""
    plan = random_plan(rng, n_rows, 1024, 1)
    wrs, _ = lower(groups, plan, max_rdma_size=1024, peer_index=index, staging_addr=0, staging_rkey=0,
                   staging_entries=entries)
    imms = []
    for w in wrs:
        if w.record:
            rec = np.frombuffer(w.record, dtype=CTRL_DTYPE)[0]
            recv[int(rec["seq"]) % entries] = rec
        imms.append(w.imm)
    return imms


def arrival_wcs(imms: list[int]) -> np.ndarray:
    out = np.zeros(len(imms), dtype=WC_DTYPE)
    out["opcode"] = RECV_RDMA_WITH_IMM
    out["imm"] = imms
    out["byte_len"] = [32 if decode_imm(i)[0] == KIND_CTRL else 1024 for i in imms]
    out["unsolicited"] = 1
    return out


def reorder(rng: random.Random, items: list, window: int) -> list:
    """SRD-like: each item moves up to ``window`` places (a bounded shuffle); nothing lost or duplicated."""
    keyed = sorted((i + rng.uniform(0, window), x) for i, x in enumerate(items))
    return [x for _, x in keyed]


@pytest.mark.parametrize("seed", range(6))
def test_arrival_counting_matches_the_model_over_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    h = Harness()
    conns = {10 + k: (k, h.add(10 + k, index=k, key=k + 1, peer_index=0)) for k in range(3)}
    models = {cid: ArrivalTracker() for cid in conns}
    events: list[tuple[int, int]] = []
    for cid, (index, c) in conns.items():
        imms = arrival_stream(rng, SenderGroups(cumulative=rng.random() < 0.3), rng.randint(20, 120), index,
                              c["entries"], c["recv"])
        events += [(cid, i) for i in reorder(rng, imms, rng.choice((1, 4, 32, 1000)))]
    events = reorder(rng, events, 8)  # interleave the connections
    want: list[tuple[int, int, int, int, int]] = []
    pos = 0
    while pos < len(events):
        chunk = events[pos:pos + rng.randint(1, 40)]
        pos += len(chunk)
        touched: list[int] = []
        for cid, imm in chunk:
            kind, _conn, idx = decode_imm(imm)
            c = conns[cid][1]
            if kind == KIND_CTRL:
                models[cid].on_record(idx, c["recv"][idx % c["entries"]].copy())
            else:
                models[cid].on_piece(idx)
            if cid not in touched:
                touched.append(cid)
        for cid in touched:
            want += [(cid, p.rank, p.slot, int(p.op), p.value) for p in models[cid].ready()]
        h.wcs = [arrival_wcs([imm for _, imm in chunk])]
        assert len(h.poster.poll(256)) == 0  # arrivals complete no tokens
        assert h.pubs == want, f"after {pos} of {len(events)} arrivals"
    assert h.failures == []
    for cid in conns:
        assert h.poster.arrivals_idle(cid) == models[cid].idle()
    stats = h.poster.stats()
    assert stats["arrivals"] == len(events) and stats["published"] == len(want)
    assert stats["visibility_flushes"] >= 1


def test_host_flags_are_stored_in_c_and_a_broken_peer_is_reported_once() -> None:
    rng = random.Random(5)
    h = Harness()
    c = h.add(1, index=0, key=1, peer_index=0)
    words = np.zeros(4, dtype=np.uint64)
    h.poster.set_host_flags(0, 1, words.ctypes.data, 4)  # rank 1's flags: host words; ranks 0 and 2: Python
    model = ArrivalTracker()
    imms = reorder(rng, arrival_stream(rng, SenderGroups(), 200, 0, c["entries"], c["recv"]), 16)
    for imm in imms:
        kind, _conn, idx = decode_imm(imm)
        (model.on_record(idx, c["recv"][idx % c["entries"]].copy()) if kind == KIND_CTRL else model.on_piece(idx))
    expect = np.zeros(4, dtype=np.uint64)
    python_side = []
    ready = model.ready()
    for p in ready:
        if p.rank == 1:
            expect[p.slot] = p.value if p.op == SignalOp.SET else expect[p.slot] + np.uint64(p.value)
        else:
            python_side.append((1, p.rank, p.slot, int(p.op), p.value))
    h.wcs = [arrival_wcs(imms)]
    h.poster.poll(256)
    assert words.tolist() == expect.tolist()
    assert h.pubs == python_side
    assert h.poster.stats()["published_host"] == len(ready) - len(python_side) > 0
    # a record that arrives twice breaks the protocol: reported once, nothing more published
    dup = next(i for i in imms if decode_imm(i)[0] == KIND_CTRL)
    h.wcs = [arrival_wcs([dup, dup])]
    h.poster.poll(256)
    assert len(h.failures) == 1 and "arrived twice" in h.failures[0][1]
    assert h.poster.stats()["protocol_errors"] == 1 and h.poster.stats()["unknown_arrivals"] == 1
