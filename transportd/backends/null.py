"""The null backend: posts nothing anywhere, completes every batch on a later poll, counts what it saw.

It measures the proxy alone (``transportd bench proxy``: ring -> post with a null NIC) and lets tests
watch exactly what was posted. Knobs for tests: ``completion_delay_us`` (completions are due that long
after the post), ``paused`` (hold every completion, as a full NIC would), ``held`` (hold the completions
of these connections, so connections complete out of order), :meth:`fail_next` (the next
batch on a connection completes with a verbs error status), ``keep_plans`` (keep a copy of every posted
plan, in order, per connection) and ``log_posts`` (post time and chunk ids, for latency).

Posting is cheap on purpose: :meth:`post` and :meth:`post_batches` only queue references (the proxy never
modifies a plan after posting it); counting and token extraction happen, vectorized, on the next poll.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from transportd.backends.interface import COMPLETION_DTYPE, FlagPublisher, MemoryKey, PlanOp, SignalOp
from transportd.rows import concat_rows

__all__ = ["NullBackend", "apply_plans"]

_SET = int(SignalOp.SET)
_FOREVER = np.iinfo(np.int64).max


class NullBackend:
    """A Backend that does no I/O. Options other backends take (device, verbs, ...) are accepted and unused."""

    name = "null"

    def __init__(
        self,
        *,
        completion_delay_us: float = 0.0,
        keep_plans: bool = False,
        log_posts: bool = False,
        device: str = "",
        verbs: str = "auto",
        signal_mode: str = "write",
        inflight_cap: int = 0,
        batch_max: int = 8,
        visibility_flush: bool = False,
    ) -> None:
        self.delay_ns = int(completion_delay_us * 1000)
        self.keep_plans = keep_plans
        self.log_posts = log_posts
        self.paused = False
        self.held: set[int] = set()  # connections whose completions are held back
        self.counts = dict.fromkeys(("batches", "wrs", "writes", "signals", "fences", "bytes"), 0)
        self._kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (conn_ids, plan copy, bounds)
        self.post_log: list[tuple[np.ndarray, np.ndarray]] = []  # (monotonic ns at post, chunk id) per WRITE
        self._clock = self.delay_ns > 0 or log_posts
        self._new: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (t, conns, plan, bounds)
        self._new_single: list[tuple[int, int, np.ndarray]] = []  # (t, conn_id, plan) from post()
        # per batch, in post order: due time (ns), completion, connection, WRs
        self._due: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._fail: dict[int, int] = {}
        self._next_key = 1
        self._connections: set[int] = set()
        self._publisher: FlagPublisher | None = None

    # -- resources ---------------------------------------------------------------------------------------
    def local_address(self) -> dict[str, Any]:
        return {"kind": "null"}

    def register_memory(self, addr: int, length: int, *, remote_write: bool, remote_atomic: bool,
                        accessor: Any = None) -> MemoryKey:
        key = self._next_key
        self._next_key += 1
        return MemoryKey(addr=addr, length=length, lkey=key, rkey=key)

    def deregister_memory(self, key: MemoryKey) -> None:
        pass

    def create_endpoint(self, conn_id: int, job: str) -> dict[str, Any]:
        self._connections.add(conn_id)
        return {"conn_id": conn_id}

    def connect(self, conn_id: int, remote: dict[str, Any]) -> None:
        self._connections.add(conn_id)

    def close_connection(self, conn_id: int) -> None:
        self._connections.discard(conn_id)

    def set_flag_publisher(self, publisher: FlagPublisher) -> None:
        self._publisher = publisher

    def seed_signals(self, conn_id: int, base: int, rkey: int, seeds: bytes) -> None:
        """Nothing to seed: the null NIC keeps no flag shadow."""

    def close(self) -> None:
        self._new.clear()
        self._new_single.clear()
        self._due.clear()

    # -- data path ---------------------------------------------------------------------------------------
    def fail_next(self, conn_id: int, status: int) -> None:
        """The next batch posted on ``conn_id`` completes with work-completion ``status`` (10: remote access)."""
        self._fail[conn_id] = status

    def post(self, conn_id: int, plan: np.ndarray) -> int:
        n = len(plan)
        self._new_single.append((time.monotonic_ns() if self._clock else 0, conn_id, plan))
        return n

    def post_batches(self, conn_ids: np.ndarray, plan: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Post batch ``i`` = rows ``bounds[i]:bounds[i+1]`` on ``conn_ids[i]``; returns WRs per batch."""
        t = time.monotonic_ns() if self._clock else 0
        self._new.append((np.full(len(conn_ids), t, dtype=np.int64), np.asarray(conn_ids, np.int64), plan,
                          np.asarray(bounds, np.int64)))
        return bounds[1:] - bounds[:-1]

    def _settle(self) -> None:
        """Turn queued posts into due completions and counts, in one vectorized pass."""
        if self._new_single:
            times, conns, plans = zip(*self._new_single, strict=True)
            lengths = np.fromiter((len(p) for p in plans), dtype=np.int64, count=len(plans))
            bounds = np.zeros(len(plans) + 1, dtype=np.int64)
            np.cumsum(lengths, out=bounds[1:])
            self._new.append((np.array(times, np.int64), np.array(conns, np.int64), concat_rows(list(plans)), bounds))
            self._new_single.clear()
        if len(self._new) == 1:
            times, conn_ids, plan, bounds = self._new[0]
        else:
            times = np.concatenate([e[0] for e in self._new])
            conn_ids = np.concatenate([e[1] for e in self._new])
            plan = concat_rows([e[2] for e in self._new])
            offsets = np.cumsum([0] + [len(e[2]) for e in self._new[:-1]])
            bounds = np.concatenate([[0]] + [e[3][1:] + off for e, off in zip(self._new, offsets, strict=True)])
        self._new.clear()
        nb = len(conn_ids)
        comp = np.zeros(nb, dtype=COMPLETION_DTYPE)
        comp["token"] = plan["token"][bounds[1:] - 1]
        if self._fail:
            for i, conn in enumerate(conn_ids.tolist()):
                if conn in self._fail:
                    comp["status"][i] = self._fail.pop(conn)
        self._due.append((times + self.delay_ns, comp, conn_ids, np.diff(bounds)))
        op = plan["op"]
        ops = np.bincount(op, minlength=4)
        c = self.counts
        c["batches"] += nb
        c["wrs"] += len(plan)
        c["writes"] += int(ops[PlanOp.WRITE])
        c["signals"] += int(ops[PlanOp.SIGNAL])
        c["fences"] += int(ops[PlanOp.FENCE])
        c["bytes"] += int(plan["length"].sum()) - 8 * int(ops[PlanOp.SIGNAL])
        if self.keep_plans:
            self._kept.append((conn_ids, plan.view(np.uint64).copy().view(plan.dtype), bounds))  # copied as words
        if self.log_posts:
            writes = op == PlanOp.WRITE
            row_time = np.repeat(times, np.diff(bounds))
            self.post_log.append((row_time[writes], plan["chunk_id"][writes].copy()))

    def poll(self, max_completions: int = 256) -> np.ndarray:
        if self._new or self._new_single:
            self._settle()
        if self.paused or not self._due:
            return np.zeros(0, dtype=COMPLETION_DTYPE)
        now = time.monotonic_ns() if self.delay_ns else _FOREVER  # no delay: everything posted is due
        out: list[np.ndarray] = []
        room = max_completions
        kept: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for entry in self._due:
            due, comp, conns, nwr = entry
            if room <= 0:
                kept.append(entry)
                continue
            ready = due <= now
            if self.held:
                ready &= ~np.isin(conns, list(self.held))
            if len(comp) > room:
                ready &= np.cumsum(ready) <= room
            if ready.all():
                take = entry
            else:
                if not ready.any():
                    kept.append(entry)
                    continue
                kept.append((due[~ready], comp[~ready], conns[~ready], nwr[~ready]))
                take = (due[ready], comp[ready], conns[ready], nwr[ready])
            out.append(take[1])
            room -= len(take[1])
        self._due = kept
        if not out:
            return np.zeros(0, dtype=COMPLETION_DTYPE)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def inflight(self, conn_id: int) -> int:
        """WRs posted on ``conn_id`` whose completion has not been returned by :meth:`poll` (counted on demand)."""
        if self._new or self._new_single:
            self._settle()
        return sum(int(nwr[conns == conn_id].sum()) for _, _, conns, nwr in self._due)

    @property
    def plans(self) -> dict[int, list[np.ndarray]]:
        """With ``keep_plans``: every batch posted so far, in order, per connection (after a poll)."""
        out: dict[int, list[np.ndarray]] = {}
        for conn_ids, plan, bounds in self._kept:
            for conn, start, stop in zip(conn_ids.tolist(), bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
                out.setdefault(conn, []).append(plan[start:stop])
        return out

    def flag_values(self) -> dict[tuple[int, int], int]:
        """Flag words as the receivers would hold them after every kept plan (``keep_plans``)."""
        return apply_plans([p for plans in self.plans.values() for p in plans])


def apply_plans(plans: list[np.ndarray]) -> dict[tuple[int, int], int]:
    """Apply the SIGNAL rows of ``plans`` in order: ``{(dst_rank, raddr): value}`` starting from 0."""
    flags: dict[tuple[int, int], int] = {}
    for plan in plans:
        sig = plan[plan["op"] == PlanOp.SIGNAL]
        for dst, raddr, op, value in zip(sig["dst_rank"].tolist(), sig["raddr"].tolist(), sig["signal_op"].tolist(),
                                         sig["value"].tolist(), strict=True):
            key = (dst, raddr)
            flags[key] = value if op == _SET else (flags.get(key, 0) + value) % (1 << 64)
    return flags
