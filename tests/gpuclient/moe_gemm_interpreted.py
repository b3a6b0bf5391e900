"""MoE ``dispatch_gemm`` in Triton's interpreter: one process per rank, running at the same time over shared
memory (run by tests/gpuclient/test_moe_layout.py; ``TRITON_INTERPRET=1`` is set before Triton is imported).

The fused kernel's compute programs wait for what the peers' communication programs push in the same
launch, so the ranks cannot run one after another as in ``moe_interpreted.py``: here each rank is a process
of its own, its registered buffers and flags live in a file every rank maps, and :class:`SharedFabric`
stands in for the channel calls with the weakest delivery the protocol allows (efa's): a put is only queued,
and it lands in the peer's memory when this rank next signals that peer — a signal covers the writes since
the previous one — and each signal first sleeps a little, so a tile that read a source's rows before
waiting for a flag that covers them reads the NaN they were poisoned with. A wait spins on the shared flag.
Within a rank the interpreter runs the programs in order (the communication programs first), so the ranks
progress as the GPU's resident grids do.

Rounds, with no reset: 1 ``dispatch_gemm`` (an expert nobody picks: its blocks are empty), 2 a plain
``dispatch`` with the expert GEMM in numpy (the two share flags round by round; the group flags stay), 3
``dispatch_gemm`` with every source picking that expert (flags rising with rows after rounds without), 4
``dispatch_gemm`` with one rank sending nothing, each followed by ``combine``
on the GEMM's output; then the compute-only variant (``COMMUNICATE=False``) reruns round 4's GEMM into a
fresh buffer. Routing is uneven: a hot expert, an expert nobody picks, the last rank receiving nothing.
Each rank checks its own results against the numpy model (``moe_layout``): counts, per-source layout,
handle words and received rows exactly, ``y`` against float64 ``x @ w`` per expert within the output
dtype's rounding (rows past the counts untouched), combine against the weighted sum, no queued put left
uncovered by a signal at the end of a round, every put the rank made exactly the model's (a fused round:
one per (peer, group of ``EXPERTS_PER_PUT`` experts) into the peer's ``land_x``, pieces of at most the
group's put rows; a plain one: one per (peer, expert) block, pieces of at most ``PUT_ROWS`` rows; and one of
the handle words of all the peer's experts; one per (expert, source) block back), the records and signals
per destination (``2 + groups`` signals a fused round, 2 a plain one), one program of the fused kernel
pushing each peer, every group flag at the number of fused rounds (the slots past the groups at 0), and
every program of the plain kernels (send, finish, reduce) having waited for each peer's flag whose data it
reads (the fused kernel's reads, in ``land_x`` and ``recv_x``, are checked load by load).

    python -m tests.gpuclient.moe_gemm_interpreted WORLD EXPERTS MAX_TOKENS TOPK HIDDEN N PROGRAMS COMM BM BN BK OUT
        [PUT_ROWS [EXPERTS_PER_PUT [SPLIT_EXPERTS]]]

``SPLIT_EXPERTS`` (default: the first group's experts) local experts have their row blocks taken
source by source, the others whole at their latest source's step.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from gpuclient.kernels.moe_layout import MoELayout, combine_model, dispatch_model
from tests.gpuclient.moe_interpreted import (
    REGIONS,
    Buffer,
    bf16,
    device_calls,
    f32,
    planned_combine,
    planned_dispatch,
    planned_puts,
)
from tests.gpuclient.test_moe_layout import uneven_routing

#: the op's regions, as ``MoE`` registers them (the landing rows last)
FUSED_REGIONS = REGIONS

NAN16 = 0x7FC0
ROUNDS = 4  # 1, 3, 4 dispatch_gemm; 2 a plain dispatch
DELIVERY_DELAY_S = 0.5  # a signal and the writes it covers land this long after it is pushed
WAIT_LIMIT_S = float(os.environ.get("MOE_GEMM_WAIT_LIMIT_S", "300"))


def buffers(lay: MoELayout, n_out: int, out: str) -> list[tuple[str, tuple, np.dtype]]:
    """Every rank's shared buffers: the registered ones (in ``REGIONS`` order), its ``recv_src``, its flags and its
    ``y``."""
    W, E, L, T, H = lay.world, lay.num_experts, lay.local_experts, lay.max_tokens, lay.hidden  # noqa: N806
    S = lay.stage_capacity  # noqa: N806
    return [("counts_all", (W, E), np.dtype(np.int32)), ("recv_x", (L, lay.capacity, H), np.dtype(np.uint16)),
            ("src_stage", (W, L, T), np.dtype(np.int32)), ("send_x", (S, H), np.dtype(np.uint16)),
            ("send_src", (E, T), np.dtype(np.int32)), ("combine_buf", (S, H), np.dtype(np.uint16)),
            ("send_y", (L, lay.capacity, H), np.dtype(np.uint16)),
            ("land_x", (W, lay.source_rows, H), np.dtype(np.uint16)),
            ("recv_src", (L, lay.capacity), np.dtype(np.int32)),
            ("flags", (lay.slot_base + lay.slots,), np.dtype(np.int64)),
            ("cover", (L, lay.capacity, 2), np.dtype(np.int64)),
            ("stage_cover", (W, lay.source_rows, 2), np.dtype(np.int64)),
            ("y", (L, lay.capacity, n_out), np.dtype(np.uint16 if out == "bf16" else np.float32)),
            ("round", (1,), np.dtype(np.int64))]  # the round the rank has started (before it sends anything of it)


def file_bytes(specs: list) -> int:
    return sum(-(-int(np.prod(shape)) * dt.itemsize // 64) * 64 for _, shape, dt in specs)


def attach(path: Path, specs: list) -> SimpleNamespace:
    raw = np.memmap(path, dtype=np.uint8, mode="r+", shape=(file_bytes(specs),))
    views, at = {}, 0
    for name, shape, dt in specs:
        n = int(np.prod(shape)) * dt.itemsize
        views[name] = raw[at:at + n].view(dt).reshape(shape)
        at += -(-n // 64) * 64
    return SimpleNamespace(raw=raw, **views)


class SharedFabric:
    """The channel calls of one rank: puts queue per peer; this rank's next signal to that peer takes them, and
    a delivery thread lands them and then the flag, in signal order, ``DELIVERY_DELAY_S`` after the signal."""

    def __init__(self, me: int, ranks: list[SimpleNamespace], max_put: int, lay: MoELayout) -> None:
        self.me, self.ranks, self.max_put, self.lay = me, ranks, max_put, lay
        self.sent: dict[tuple[int, int], int] = {}  # (peer, slot): what this rank has added to it, in all
        self.records = [0] * len(ranks)  # per peer, since the last counts()
        self.signals = [0] * len(ranks)
        self.writers: dict[int, set[int]] = {}  # per peer: the programs that pushed it (the fused kernel)
        self.fused = False
        self.log: list[tuple[int, int, int, int, int, int]] = []  # every put: (peer, dst region, off, src ...)
        self.queued: dict[int, list[tuple[int, int, int, int, int]]] = {p: [] for p in range(len(ranks))}
        self.deliveries: queue.Queue = queue.Queue()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._deliver, daemon=True)
        self.thread.start()

    def _deliver(self) -> None:
        while (item := self.deliveries.get()) is not None:
            due, peer, puts, slot, value = item
            try:
                time.sleep(max(0.0, due - time.monotonic()))
                for dr, do, sr, so, n in puts:  # the source is read now, as late as the protocol allows
                    self._bytes(peer, dr)[do:do + n] = self._bytes(self.me, sr)[so:so + n]
                self.ranks[peer].flags[slot] += value  # x86: the rows' stores are seen before the flag's
            except BaseException as exc:  # noqa: BLE001  (reported by drain)
                self.failure = exc

    def drain(self) -> None:
        """Every signal so far delivered (the thread stops after it)."""
        self.deliveries.put(None)
        self.thread.join()
        assert self.failure is None, self.failure

    @staticmethod
    def value(x: object) -> int:
        if hasattr(x, "handle"):
            return int(np.asarray(x.handle.data).reshape(-1)[0])
        return int(getattr(x, "value", x))

    def _bytes(self, rank: int, region: int) -> np.ndarray:
        return getattr(self.ranks[rank], FUSED_REGIONS[region]).reshape(-1).view(np.uint8)

    def _pushed(self, peer: int, slot: int | None) -> None:
        """Count a record, and note which program of the fused kernel pushed it (program 0's count put_signal
        aside: the count flag is waited for before anything it could cover is read)."""
        from triton.runtime import interpreter

        self.records[peer] += 1
        if self.fused and slot != self.lay.count_slot + self.me:
            self.writers.setdefault(peer, set()).add(int(interpreter.interpreter_builder.grid_idx[0]))

    def counts(self) -> tuple[list[int], list[int]]:
        """(records, signals) per peer since the last call."""
        got = (self.records, self.signals)
        self.records, self.signals = [0] * len(self.ranks), [0] * len(self.ranks)
        return got

    def put(self, ch, peer, dst_region, dst_off, src_region, src_off, nbytes, chunk_id=0, slot=None):  # noqa: ANN001, ANN201
        peer = self.value(peer)
        assert peer != self.me, "a rank never puts to itself: its rows are copied"
        self._pushed(peer, slot)
        n, so, do = self.value(nbytes), self.value(src_off), self.value(dst_off)
        sr, dr = self.value(src_region), self.value(dst_region)
        assert 0 < n <= self.max_put and so + n <= self._bytes(self.me, sr).size
        assert do + n <= self._bytes(peer, dr).size
        self.queued[peer].append((dr, do, sr, so, n))  # the source is read when the put lands, not now
        self.log.append((peer, dr, do, sr, so, n))

    def put_signal(self, ch, peer, dst_region, dst_off, src_region, src_off, nbytes, slot, value, op=0):  # noqa: ANN001, ANN201
        self.put(ch, peer, dst_region, dst_off, src_region, src_off, nbytes, slot=self.value(slot))
        self._signal(self.value(peer), self.value(slot), self.value(value))

    def signal(self, ch, peer, slot, value, op=0):  # noqa: ANN001, ANN201
        peer, slot = self.value(peer), self.value(slot)
        assert peer != self.me
        self._pushed(peer, slot)
        self._signal(peer, slot, self.value(value))

    def _signal(self, peer: int, slot: int, value: int) -> None:
        """Close the connection's group: the puts queued since the previous signal land with this one. The
        received rows among them are marked, in the peer's ``cover`` table, with the flag and the value that
        says they are placed (marked now, before the signal is due: the peer checks its reads against it)."""
        self.signals[peer] += 1
        self.sent[peer, slot] = self.sent.get((peer, slot), 0) + value
        row = self.lay.row_bytes
        covers = {FUSED_REGIONS.index("recv_x"): self.ranks[peer].cover.reshape(-1, 2),
                  FUSED_REGIONS.index("land_x"): self.ranks[peer].stage_cover.reshape(-1, 2)}
        for dr, do, _, _, n in self.queued[peer]:
            if dr in covers:
                covers[dr][do // row:(do + n) // row] = (slot, self.sent[peer, slot])
        self.deliveries.put((time.monotonic() + DELIVERY_DELAY_S, peer, self.queued[peer], slot, value))
        self.queued[peer] = []

    def wait(self, ch, slot, at_least):  # noqa: ANN001, ANN201
        slot, at_least = self.value(slot), self.value(at_least)
        flags = self.ranks[self.me].flags
        start = time.monotonic()
        while flags[slot] < at_least:
            assert time.monotonic() - start < WAIT_LIMIT_S, f"rank {self.me}: flag {slot} stuck below {at_least}"
            time.sleep(0.001)

    def uncovered(self) -> int:
        return sum(len(q) for q in self.queued.values())

    def take(self) -> list[tuple[int, int, int, int, int, int]]:
        """The puts since the last take, sorted."""
        log, self.log = sorted(self.log), []
        return log


class ReadCheck:
    """While the fused kernel runs: every load of a peer's received row or of a peer's count row must come
    after a wait, by the same program in the same launch, for the flag that covers it — whatever the timing.
    A row of source s for local expert l (in ``land_x``, or in ``recv_x``) needs its group flag
    ``expert_slot + s * L + l // experts_per_put`` at this round's fused epoch (the dispatch_gemm rounds so
    far), and the flag and value its sender's signal marked in the ``stage_cover`` (``cover``) table (the
    one whose group the row's put fell in); a count row of rank s, ``count_slot + s`` at the round. A wait
    for more than the round gives (it would never return) fails at once."""

    def __init__(self, rank: int, lay: MoELayout, me: SimpleNamespace) -> None:
        self.rank, self.lay, self.me = rank, lay, me
        self.active, self.epoch, self.gemm_epoch = False, 0, 0
        self.waited: dict[int, dict[int, int]] = {}  # program: {slot: the most it waited for}
        self.source = np.full((lay.local_experts, lay.capacity), -1, np.int64)
        self.staged = np.full((lay.world, lay.source_rows), -1, np.int64)  # the local expert of a land_x row
        self.loads = 0

    def start(self, epoch: int, gemm_epoch: int, counts_all: np.ndarray) -> None:
        self.active, self.epoch, self.gemm_epoch, self.waited = True, epoch, gemm_epoch, {}
        self.source[:] = -1
        self.staged[:] = -1
        _, recv_layout = self.lay.receive(counts_all)
        at = self.lay.land_offsets(counts_all)
        for local in range(self.lay.local_experts):
            for s, (off, count) in enumerate(recv_layout[local]):
                self.source[local, off:off + count] = s
                self.staged[s, at[s, local]:at[s, local] + count] = local

    def wait(self, pid: int, slot: int, at_least: int) -> None:
        if not self.active:
            return
        lay = self.lay
        expert = lay.expert_slot <= slot < lay.expert_slot + lay.world * lay.local_experts
        most = self.gemm_epoch if expert else self.epoch
        assert at_least <= most, (f"rank {self.rank} program {pid}: waits for flag {slot} to reach {at_least}, "
                                  f"which this round raises to {most} only")
        mine = self.waited.setdefault(pid, {})
        mine[slot] = max(mine.get(slot, 0), at_least)

    def load(self, pid: int, addrs: np.ndarray, mask: np.ndarray) -> None:
        if not self.active:
            return
        addrs = np.asarray(addrs, dtype=np.uint64)[np.asarray(mask, dtype=bool)]
        waited = self.waited.get(pid, {})
        lay, counts = self.lay, self.me.counts_all
        for row in self._rows_in(addrs, self.me.land_x):
            src, local = divmod(int(row), lay.source_rows)[0], int(self.staged.reshape(-1)[row])
            assert src != self.rank, f"rank {self.rank}: read its own land_x slice (its rows are in send_x)"
            assert local >= 0, f"rank {self.rank}: read land_x row {row}, past what rank {src} sent"
            self._covered(pid, waited, f"staged row {row}", src, local, self.me.stage_cover.reshape(-1, 2)[row])
        for row in self._rows_in(addrs, self.me.recv_x):
            src, local = int(self.source.reshape(-1)[row]), int(row) // lay.capacity
            assert src >= 0, f"rank {self.rank}: received row {row} read past its expert's count"
            if src != self.rank:
                self._covered(pid, waited, f"row {row}", src, local, self.me.cover.reshape(-1, 2)[row])
        base = counts.ctypes.data
        inside = addrs[(addrs >= base) & (addrs < base + counts.nbytes)]
        for s in np.unique((inside - base) // (lay.num_experts * 4)):
            assert s == self.rank or waited.get(lay.count_slot + int(s), 0) >= self.epoch, (
                f"rank {self.rank} program {pid}: read rank {s}'s counts before waiting for its count flag")


    def _rows_in(self, addrs: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The rows of ``rows`` (rows of ``hidden`` bf16) that the loaded addresses fall in."""
        base = rows.ctypes.data
        inside = addrs[(addrs >= base) & (addrs < base + rows.nbytes)]
        return np.unique((inside - base) // (self.lay.hidden * 2))

    def _covered(self, pid: int, waited: dict[int, int], what: str, src: int, local: int, cover: np.ndarray) -> None:
        """A peer's row read by program ``pid``: after its group flag at the fused round, and after the flag and
        value of the signal that covered its put (``cover``)."""
        flag = self.lay.group_slot(src, local)
        assert waited.get(flag, 0) >= self.gemm_epoch, (
            f"rank {self.rank} program {pid}: read {what} of rank {src} for expert {local} before waiting for its "
            f"group flag {flag} to reach {self.gemm_epoch} (waited: {waited})")
        slot, value = (int(v) for v in cover)
        assert slot >= 0 and waited.get(slot, 0) >= value, (
            f"rank {self.rank} program {pid}: read {what} (rank {src}, expert {local}), which lands with flag "
            f"{slot} at {value}, a flag it did not wait for (waited: {waited})")
        self.loads += 1


def poison_early_buffers(rank: SimpleNamespace) -> None:
    """What a peer's fused kernel fills before it waits for this rank's counts (its rows, in ``land_x``, and
    its handle words, in ``src_stage``), poisoned with nothing covered: before the ranks start, and after each
    round's dispatch kernels, before the combine that lets a peer start the next round."""
    rank.land_x[:] = NAN16
    rank.stage_cover[:] = -1
    rank.src_stage[:] = -1


def planned_dispatch_gemm(lay: MoELayout, counts_all: np.ndarray) -> list[tuple[int, int, int, int, int, int]]:
    """The model's puts of a fused round, as the fabric records them: ``planned_dispatch``'s, the rows by group
    piece (stage rows to the peer's ``land_x`` rows)."""
    return planned_puts(lay, FUSED_REGIONS, "land_x", lay.gemm_puts(counts_all))


def _b(arr: np.ndarray) -> Buffer:
    kind = {np.dtype(np.uint16): "bfloat16", np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
            np.dtype(np.float32): "float32", np.dtype(np.uint64): "uint64"}[arr.dtype]
    return Buffer(arr, kind)


def inputs(world: int, experts: int, max_tokens: int, topk: int, hidden: int, n_out: int) -> dict:
    """Every rank's inputs for every round (the same in each process: one seed)."""
    rng = np.random.default_rng(world * 100 + topk)
    local = experts // world
    w = [bf16(rng.standard_normal((local, hidden, n_out)) / hidden ** 0.5) for _ in range(world)]
    rounds = []
    for rnd in range(1, ROUNDS + 1):
        tokens = [max_tokens - (r + rnd) % 3 for r in range(world)]
        if rnd == ROUNDS and world > 1:
            tokens[-1] = 0  # a rank with nothing to send
        idx = uneven_routing(rng, world, experts, max_tokens, topk, tokens, dtype=np.int32 if rnd % 2 else np.int64)
        if local > 1 and rnd != 3:  # rank 0's last expert: nobody picks it (an empty expert beside full ones)
            for i in idx:
                i[i == local - 1] = -1
        if rnd == 3:  # every source picks it: its group flags rise with rows after rounds without
            for i in idx:
                if len(i):
                    i[0, 0] = local - 1
        rounds.append({"tokens": tokens, "idx": idx, "x": [bf16(rng.standard_normal((n, hidden))) for n in tokens],
                       "w": [rng.random((n, topk)).astype(np.float32) for n in tokens]})
    return {"w": w, "rounds": rounds}


def run_rank(rank: int, where: Path, world: int, experts: int, max_tokens: int, topk: int, hidden: int, n_out: int,
             programs: int, comm: int, block: tuple[int, int, int], out: str, put_rows: int,
             experts_per_put: int, split_experts: int | None) -> None:
    import triton.runtime.interpreter as interp

    import gpuclient.kernels.moe_kernels as m
    from gpuclient.kernels.moe import _pow2

    patch_tensor, create_dot = interp._patch_lang_tensor, interp.InterpreterBuilder.create_dot
    cast = interp.InterpreterBuilder.cast_impl

    def scalar_index(tensor: object, scope: object) -> None:  # numpy 2 refuses int() of the 1-element scalars
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    def widen(x: object) -> object:  # the interpreter's tl.dot would multiply bf16's raw uint16 storage
        if x.dtype == interp.tl.bfloat16:
            return interp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), interp.tl.float32)
        return x

    def cast_rne(self: object, src: object, dst_type: object) -> object:  # the interpreter truncates to bf16;
        if src.dtype.scalar == interp.tl.float32 and dst_type.scalar == interp.tl.bfloat16:  # the GPU rounds
            return interp.TensorHandle(bf16(src.data), interp.tl.bfloat16)
        return cast(self, src, dst_type)

    interp._patch_lang_tensor = scalar_index
    interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: create_dot(self, widen(a), widen(b), d, *rest)
    interp.InterpreterBuilder.cast_impl = cast_rne
    masked_load = interp.InterpreterBuilder.create_masked_load

    def checked_load(self: object, ptrs: object, mask: object, *rest: object) -> object:
        check.load(self.grid_idx[0], ptrs.data, mask.data)
        return masked_load(self, ptrs, mask, *rest)

    interp.InterpreterBuilder.create_masked_load = checked_load

    max_put = put_rows * hidden * 2
    lays = [MoELayout(r, world, experts, max_tokens, topk, hidden, slot_base=2, max_put_bytes=max_put,
                      experts_per_put=experts_per_put) for r in range(world)]
    lay = lays[rank]
    specs = buffers(lay, n_out, out)
    ranks = [attach(where / f"rank{r}.bin", specs) for r in range(world)]
    me = ranks[rank]
    fabric = SharedFabric(rank, ranks, max_put, lay)
    check = ReadCheck(rank, lay, me)

    waits: set[tuple[int, int, int]] = set()  # (program, slot, at least) of the latest plain kernels

    def wait(ch: object, slot: object, at_least: object) -> None:
        pid = int(interp.interpreter_builder.grid_idx[0])
        check.wait(pid, fabric.value(slot), fabric.value(at_least))
        waits.add((pid, fabric.value(slot), fabric.value(at_least)))
        fabric.wait(ch, slot, at_least)

    def waited(slot: int, epoch: int, pids: Iterable[int], clear: bool = True) -> None:
        """Each program ``pids`` of the plain kernel just run waited for ``slot + s`` to reach ``epoch``, every
        peer s (it reads what they push)."""
        for pid in pids:
            missing = [s for s in range(world) if s != rank and (pid, slot + s, epoch) not in waits]
            assert not missing, f"rank {rank} program {pid}: read what ranks {missing} push unwaited"
        if clear:
            waits.clear()

    m.tpd = device_calls(fabric.put, fabric.put_signal, fabric.signal, wait)
    W_, E_, L_, K_, T_, H_ = world, experts, lay.local_experts, topk, max_tokens, hidden  # noqa: N806
    me.recv_src[:] = -1
    me.send_src[:] = -1
    idx32, stage_row = np.full((T_, K_), -1, np.int32), np.full((T_, K_), -1, np.int32)
    rounds = np.zeros(3, np.int32)  # the op's round words (gpuclient.kernels._rounds): the kernels' epochs
    stage_off = np.zeros(E_, np.int32)
    copy_rows, put_rows_ = 2, lay.put_rows
    recv_count, recv_layout = np.zeros(L_, np.int32), np.zeros((L_, W_, 2), np.int32)
    result, ch = np.zeros((T_, H_), np.uint16), np.zeros(8, np.uint64)
    regions = {name: i for i, name in enumerate(FUSED_REGIONS)}
    data = inputs(world, experts, max_tokens, topk, hidden, n_out)
    w_mine = np.ascontiguousarray(data["w"][rank])
    bm, bn, bk = block
    poison_y = bf16(np.float32(np.nan)) if out == "bf16" else np.float32(np.nan)
    as_f64 = (lambda a: f32(a).astype(np.float64)) if out == "bf16" else (lambda a: a.astype(np.float64))
    rtol = 2.0 ** -8 if out == "bf16" else 1e-5

    def gemm(epoch: int, gemm_epoch: int, y: np.ndarray, communicate: bool, counts_model: np.ndarray) -> None:
        if communicate:
            check.start(epoch, gemm_epoch, counts_model)
        fabric.fused, fabric.writers = True, {}
        before = rounds.copy()
        m._moe_dispatch_gemm[(programs,)](
            _b(ch), _b(rounds), rank, _b(me.counts_all), _b(stage_off), _b(me.recv_x), _b(me.recv_src),
            _b(me.src_stage), _b(me.land_x), _b(w_mine), _b(y), _b(recv_count), _b(recv_layout),
            *[regions[n] for n in ("counts_all", "land_x", "src_stage", "send_x", "send_src")], lay.count_slot,
            lay.dispatch_slot, lay.expert_slot, _b(np.zeros(1, dtype=np.int64)), W=W_, E=E_, L=L_, T=T_, H=H_,
            N=n_out, LP=_pow2(L_), WP=_pow2(W_), COMM_PROGRAMS=comm, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            BLOCK_T=4, EXPERTS_PER_PUT=lay.experts_per_put, GROUPS=lay.put_groups,
            SOURCE_ROWS=lay.source_rows, GROUP_PUT_ROWS=lay.group_put_rows, HANDLE_WORDS=lay.handle_words,
            COMMUNICATE=communicate, COMPUTE=True,
            SPLIT_EXPERTS=min(lay.experts_per_put, L_) if split_experts is None else split_experts)
        fabric.fused = check.active = False
        # a round that communicates is run once all its programs finished; a rerun leaves the words alone
        assert list(rounds) == ([epoch, 0, gemm_epoch] if communicate else list(before)), (list(rounds), epoch)
        # one writer per connection (besides program 0's count put_signal): a block's puts and its put_signal
        # are in one program's order, with no other program's signal between them on the connection
        assert all(len(w) == 1 for w in fabric.writers.values()), f"rank {rank}: several programs push a peer: " \
            f"{fabric.writers}"

    gemm_rounds = 0

    for rnd, data_r in enumerate(data["rounds"], start=1):
        me.round[0] = rnd
        tokens, idx, x = data_r["tokens"], data_r["idx"], data_r["x"]
        # what the peers owe this round into recv_x, and our stage: poisoned (before our counts go out); land_x
        # and src_stage were poisoned at the end of the last round (a fused round's peers fill them before our
        # counts arrive)
        me.recv_x[:] = NAN16
        me.cover[:] = -1  # no received row covered yet (the peers mark it when they signal, after our counts)
        me.combine_buf[:] = NAN16
        me.send_x[:] = NAN16
        me.y[:] = poison_y
        n = tokens[rank]
        m._moe_route[(programs,)](_b(idx[rank]), _b(idx32), _b(stage_row), _b(me.counts_all), _b(stage_off),
                                  _b(me.send_src), rank, n, E=E_, K=K_, KP=_pow2(K_), T=T_, BLOCK_T=4)
        m._moe_stage[(programs + 1,)](_b(x[rank]), _b(idx32), _b(stage_row), _b(stage_off), _b(me.send_x),
                                      _b(me.recv_x), _b(me.recv_src), rank, n, W=W_, L=L_, K=K_, KP=_pow2(K_), T=T_,
                                      H=H_, ROW=H_, COPY_ROWS=copy_rows, BLOCK_H=16)
        if rnd == 2:  # the plain dispatch, on the same flags
            m._moe_dispatch[(programs,)](_b(ch), _b(rounds), rank, _b(me.counts_all), _b(stage_off),
                                         _b(me.recv_x), _b(me.recv_src), _b(me.src_stage), _b(me.land_x),
                                         _b(recv_count), _b(recv_layout),
                                         *[regions[k] for k in ("counts_all", "land_x", "src_stage", "send_x",
                                                                "send_src")],
                                         lay.count_slot, lay.dispatch_slot, W=W_, E=E_, L=L_, T=T_, ROW=H_,
                                         ROW_BYTES=2 * H_, SOURCE_ROWS=lay.source_rows,
                                         LAND_PUT_ROWS=lay.land_put_rows, HANDLE_WORDS=lay.handle_words,
                                         LP=_pow2(L_), WP=_pow2(W_), BLOCK_T=4, COPY_ROWS=copy_rows, BLOCK_H=16)
            # every program packs a share of the peers' landed rows: it waited for their counts and their
            # dispatch flags (the last, which scatters their handle words, among them)
            waited(lay.count_slot, rnd, range(programs), clear=False)
            waited(lay.dispatch_slot, rnd, range(programs))
            assert list(rounds) == [rnd, 0, gemm_rounds], list(rounds)
            y64 = np.einsum("lph,lhn->lpn", f32(me.recv_x).astype(np.float64), f32(w_mine).astype(np.float64))
            y = bf16(y64) if out == "bf16" else y64.astype(np.float32)
            me.y[:] = y
        else:
            gemm_rounds += 1
            gemm(rnd, gemm_rounds, me.y, True, dispatch_model(lays, idx)[rank]["counts_all"])
            waits.clear()  # the fused kernel's reads are checked load by load (ReadCheck)
        poison_early_buffers(me)  # read by now; no peer sends the next round before our combine below
        model = dispatch_model(lays, idx)[rank]
        what = f"round {rnd} rank {rank}"
        # records and signals per destination: the plain dispatch's 2 signals, the fused round's 2 + groups (a
        # group flag per (peer, group), by a put_signal or, for an empty group, a SIGNAL)
        records, signals = fabric.counts()
        fused = rnd != 2
        assert records == lay.writes(model["counts_all"])["dispatch_gemm" if fused else "dispatch"], (what, records)
        assert signals == lay.signals(gemm=fused), (what, signals)
        planned = (planned_dispatch_gemm if fused else planned_dispatch)(lay, model["counts_all"])
        assert fabric.take() == planned, f"{what}: the dispatch puts"
        valid = model["idx"] >= 0
        assert (stage_row[:n][valid] == model["stage_row"][valid]).all(), what
        assert (idx32[:n] == model["idx"]).all(), what
        assert (me.counts_all == model["counts_all"]).all(), what
        assert (recv_count == model["recv_count"]).all() and (recv_layout == model["recv_layout"]).all(), what
        for local in range(L_):
            c = int(recv_count[local])
            assert (me.recv_src[local, :c] == model["recv_src"][local, :c]).all(), (what, local)
            w64 = f32(w_mine[local]).astype(np.float64)
            want, scale = np.zeros((c, n_out)), np.zeros((c, n_out))
            for p in range(c):  # every received row is its token's row, bit for bit; y is its row @ w
                src, t, _ = lay.decode(me.recv_src[local, p])
                assert (me.recv_x[local, p] == x[src][t]).all(), (what, local, p)
                want[p] = f32(x[src][t]).astype(np.float64) @ w64
                scale[p] = np.abs(f32(x[src][t]).astype(np.float64)) @ np.abs(w64)
            got = as_f64(me.y[local, :c])
            assert np.isfinite(got).all(), f"{what} expert {local}: a row read before its flag (NaN)"
            # the output's rounding, plus fp32 accumulation (H terms) against the magnitude of the terms
            err = np.abs(got - want)
            bad = ~(err <= rtol * np.abs(want) + 1e-5 * scale + 1e-6)
            assert not bad.any(), (what, local, float(err.max()), np.argwhere(bad)[:5].tolist())
            if rnd != 2:  # the GEMM writes no row past the count
                assert np.isnan(as_f64(me.y[local, c:])).all(), (what, local)
        # combine: y itself where it is what combine takes (bf16, hidden wide), else the received rows (an
        # identity expert), as a caller with a second projection would send its own output
        if n_out == hidden:
            y_send = me.y if out == "bf16" else bf16(me.y)
        else:
            y_send = me.recv_x.copy()
        m._moe_combine_send[(programs,)](_b(ch), rank, _b(np.ascontiguousarray(y_send)), _b(me.counts_all),
                                         _b(me.send_y), _b(me.combine_buf), regions["combine_buf"], regions["send_y"],
                                         W=W_, E=E_, L=L_, T=T_, H=H_, EP=_pow2(E_), COPY_ROWS=copy_rows,
                                         BLOCK_H=16, PUT_ROWS=put_rows_)
        weights = np.ascontiguousarray(data_r["w"][rank])
        m._moe_combine_reduce[(programs,)](_b(ch), _b(rounds), rank, n, _b(idx32), _b(stage_row), _b(weights),
                                           _b(me.combine_buf), _b(result), lay.combine_slot, W=W_, K=K_, H=H_,
                                           BLOCK_H=16)
        waited(lay.combine_slot, rnd, range(programs))
        assert fabric.take() == planned_combine(lay, model["counts_all"]), f"{what}: the combine puts"
        records, signals = fabric.counts()
        assert records == lay.writes(model["counts_all"])["combine"], (what, records)
        assert signals == [int(s != rank) for s in range(world)], (what, signals)
        everyone = dispatch_model(lays, idx)
        expert_out = []
        for d, lay_d in enumerate(lays):  # every rank's combine input, from the model
            y_d = np.zeros((lay_d.local_experts, lay_d.capacity, hidden))
            for local in range(lay_d.local_experts):
                for p in range(int(everyone[d]["recv_count"][local])):
                    src, t, _ = lay_d.decode(everyone[d]["recv_src"][local, p])
                    row = f32(x[src][t]).astype(np.float64)
                    y_d[local, p] = f32(bf16(row @ f32(data["w"][d][local]))) if n_out == hidden else row
            expert_out.append(y_d)
        weights64 = [a.astype(np.float64) for a in data_r["w"]]
        want = combine_model(lays, everyone, expert_out, weights64)[rank]
        magnitude = combine_model(lays, everyone, [np.abs(y) for y in expert_out], [np.abs(a) for a in weights64])[rank]
        got = f32(result[:n]).astype(np.float64)
        assert np.isfinite(got).all(), f"{what}: a combine slot read before it arrived"
        # each y row may round to a neighbouring bf16 of the model's (fp32 sums in another order), then one
        # rounding of the fp32 weighted sum
        err = np.abs(got - want)
        assert (err <= 2.0 ** -7 * (magnitude + np.abs(want)) + 1e-6).all(), (what, float(err.max()))
        assert fabric.uncovered() == 0, f"{what}: a put no signal covered"
        # One rise per round from each peer. A peer already in the next round may have raised that round's
        # count and dispatch flags, and (a fused round) its group flags, since it sends them before it has our
        # counts; not its combine flag, which waits for our combine of that round. Its round word, read after the
        # flags, says whether it may have: a peer still in this round has raised each exactly once a round.
        flags_now = me.flags.copy()
        ahead = np.array([int(ranks[s].round[0]) > rnd for s in range(world)])
        peer = np.arange(world) != rank
        for base in (lay.count_slot, lay.dispatch_slot, lay.combine_slot):
            got = flags_now[base:base + world]
            early = ahead & peer if base != lay.combine_slot else np.zeros(world, bool)
            assert ((got == rnd * peer) | (early & (got == rnd + 1))).all(), (what, base, got, ahead)
        # the group flags: one rise per fused round from each peer, rows or none; the plain dispatch none; the
        # slots past the groups never
        got = flags_now[lay.expert_slot:lay.expert_slot + world * L_].reshape(world, L_)
        rise = peer[:, None] & (np.arange(L_) < lay.put_groups)[None, :]
        early = rise & ahead[:, None] & (rnd + 1 != 2)  # round 2 is the plain dispatch: no group flags
        assert ((got == gemm_rounds * rise) | (early & (got == gemm_rounds + 1))).all(), (what, got, ahead)
    # the compute-only variant: the last round's GEMM again, from the same rows and counts, into a fresh buffer
    # (it waits for nothing: no flag of a round that never ran)
    again = np.full_like(me.y, poison_y)
    flags = me.flags.copy()
    gemm(ROUNDS, gemm_rounds, again, False, me.counts_all)
    assert fabric.counts() == ([0] * world, [0] * world)
    assert fabric.take() == []
    assert (again.view(np.uint8) == me.y.view(np.uint8)).all(), f"rank {rank}: the compute-only rerun differs"
    assert (me.flags == flags).all() and fabric.uncovered() == 0
    fabric.drain()
    assert world == 1 or rank == world - 1 or check.loads > 0, "the read check saw no received row"


def main(argv: list[str]) -> None:
    if argv[0] == "--rank":
        rank, where, rest = int(argv[1]), Path(argv[2]), argv[3:]
    else:
        rank, where, rest = -1, None, argv
    world, experts, max_tokens, topk, hidden, n_out, programs, comm, bm, bn, bk = (int(a) for a in rest[:11])
    out = rest[11]
    put_rows = int(rest[12]) if len(rest) > 12 else max_tokens * topk
    experts_per_put = int(rest[13]) if len(rest) > 13 else 1
    split_experts = int(rest[14]) if len(rest) > 14 else None
    if rank >= 0:
        run_rank(rank, where, world, experts, max_tokens, topk, hidden, n_out, programs, comm, (bm, bn, bk), out,
                 put_rows, experts_per_put, split_experts)
        print(f"rank {rank} ok")
        return
    lay = MoELayout(0, world, experts, max_tokens, topk, hidden, slot_base=2)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(world):  # zeroed files: flags 0, the rest initialised by each rank before it sends, but
            with open(Path(tmp) / f"rank{r}.bin", "wb") as f:  # what a peer may fill first
                f.truncate(file_bytes(buffers(lay, n_out, out)))
            poison_early_buffers(attach(Path(tmp) / f"rank{r}.bin", buffers(lay, n_out, out)))
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(world)]  # noqa: SIM115
        procs = [subprocess.Popen([sys.executable, "-m", "tests.gpuclient.moe_gemm_interpreted", "--rank", str(r), tmp,
                                   *rest], stdout=logs[r], stderr=subprocess.STDOUT, env=os.environ)
                 for r in range(world)]
        while any([p.poll() is None for p in procs]):  # one rank failing leaves the others waiting: stop them
            if any(p.returncode not in (None, 0) for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
        failed = []
        for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
            log.seek(0)
            text = log.read()
            log.close()
            if p.returncode != 0:
                failed.append(f"--- rank {r} (exit {p.returncode}) ---\n{text[-6000:]}")
    print("\n".join(failed) if failed else "ok")


if __name__ == "__main__":
    main(sys.argv[1:])
