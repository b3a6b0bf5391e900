"""The MoE kernels in Triton's interpreter, several ranks in turn over numpy buffers (run by
tests/gpuclient/test_moe_layout.py in a process of its own: ``TRITON_INTERPRET=1`` must be set before Triton
is imported, so Triton's own library functions are interpreted too).

The channel calls are replaced by :class:`Fabric`, a model that moves a put's bytes into the peer's buffer at
once, adds a signal to the peer's flag, and records each wait, checked once every rank has run the kernel
(each satisfied by the signals sent, and every program of a kernel that reads what peers push waiting for
every peer's flag: ranks take turns here, so a missing wait would still find its data), and each put,
checked against the model's plan: per peer one put of this rank's rows for all of its experts into its
``land_x`` slice (pieces of at most ``land_put_rows`` rows) and one of the handle words of all the peer's
experts, exactly the model's offsets and lengths, and the records per destination the model counts.

    python -m tests.gpuclient.moe_interpreted WORLD EXPERTS MAX_TOKENS TOPK HIDDEN PROGRAMS [PUT_ROWS]
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from gpuclient.kernels.moe_layout import MoELayout, combine_model, dispatch_model
from tests.gpuclient.test_moe_layout import uneven_routing


def bf16(a: np.ndarray) -> np.ndarray:
    """float -> bf16 bits (uint16), round to nearest even."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class _Dtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


# one object per dtype, alive for the run: Triton's specialization caches by the dtype object (a fresh one per
# buffer could reuse a freed one's id and be taken for another type)
_DTYPES: dict[str, _Dtype] = {}


class _Storage:
    def __init__(self, tensor: Buffer) -> None:
        self.tensor = tensor

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def cpu(self) -> _Storage:
        return self

    def copy_(self, other: object) -> None:
        pass


class Buffer:
    """Enough of a torch tensor for Triton's interpreter, over a numpy array it reads and writes in place
    (bf16 held as uint16 bits)."""

    def __init__(self, arr: np.ndarray, dtype: str) -> None:
        self.arr, self.dtype = arr, _DTYPES.setdefault(dtype, _Dtype(dtype))

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def untyped_storage(self) -> _Storage:
        return _Storage(self)

    def new_empty(self, *args: object, **kwargs: object) -> Buffer:
        return Buffer(self.arr, self.dtype.name)

    def set_(self, *args: object) -> Buffer:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple:
        return self.arr.shape

    def stride(self) -> tuple:
        return self.arr.strides

    def copy_(self, other: object) -> None:
        pass


REGIONS = ("counts_all", "recv_x", "src_stage", "send_x", "send_src", "combine_buf", "send_y", "land_x")


class Fabric:
    """The channel calls for interpreted kernels: a put moves the bytes at once, a signal adds to the peer's
    flag, a wait is recorded and checked once every rank has run the kernel (ranks run one after another)."""

    def __init__(self, ranks: list[SimpleNamespace]) -> None:
        self.ranks = ranks
        self.waits: list[tuple[int, int, int, int]] = []  # (rank, slot, at least, program)
        self.records: Counter = Counter()  # (rank, peer): records pushed
        self.puts: list[tuple[int, int, int, int, int, int, int]] = []  # (rank, peer, dst region, off, src ...)

    @staticmethod
    def value(x: object) -> int:
        if hasattr(x, "handle"):
            return int(np.asarray(x.handle.data).reshape(-1)[0])
        return int(getattr(x, "value", x))

    def rank_of(self, ch: object) -> int:
        ptr = self.value(ch)
        return next(r for r, st in enumerate(self.ranks) if st.ch.ctypes.data == ptr)

    def _bytes(self, rank: int, region: int) -> np.ndarray:
        return getattr(self.ranks[rank], REGIONS[region]).reshape(-1).view(np.uint8)

    def put(self, ch, peer, dst_region, dst_off, src_region, src_off, nbytes, chunk_id=0):  # noqa: ANN001, ANN201
        me, peer = self.rank_of(ch), self.value(peer)
        assert peer != me, "a rank never puts to itself: its rows are copied"
        n, so, do = self.value(nbytes), self.value(src_off), self.value(dst_off)
        src, dst = self._bytes(me, self.value(src_region)), self._bytes(peer, self.value(dst_region))
        assert 0 < n <= self.max_put and so + n <= src.size and do + n <= dst.size, (me, peer, so, do, n)
        dst[do:do + n] = src[so:so + n]
        self.records[me, peer] += 1
        self.puts.append((me, peer, self.value(dst_region), do, self.value(src_region), so, n))

    def put_signal(self, ch, peer, dst_region, dst_off, src_region, src_off, nbytes, slot, value, op=0):  # noqa: ANN001, ANN201
        self.put(ch, peer, dst_region, dst_off, src_region, src_off, nbytes)
        self.ranks[self.value(peer)].flags[self.value(slot)] += self.value(value)

    def signal(self, ch, peer, slot, value, op=0):  # noqa: ANN001, ANN201
        me = self.rank_of(ch)
        assert self.value(peer) != me
        self.ranks[self.value(peer)].flags[self.value(slot)] += self.value(value)
        self.records[me, self.value(peer)] += 1

    def wait(self, ch, slot, at_least):  # noqa: ANN001, ANN201
        from triton.runtime import interpreter

        pid = int(interpreter.interpreter_builder.grid_idx[0])
        self.waits.append((self.rank_of(ch), self.value(slot), self.value(at_least), pid))

    def check_waits(self, *slots: int, epoch: int = 0, programs: int = 0) -> None:
        """Every wait satisfied; for each of ``slots``, every program of every rank waited for ``slot + s`` to
        reach ``epoch`` for every peer s."""
        for rank, at, at_least, _ in self.waits:
            assert self.ranks[rank].flags[at] >= at_least, (rank, at, at_least, self.ranks[rank].flags)
        world = len(self.ranks)
        done = {(rank, at, pid) for rank, at, at_least, pid in self.waits if at_least >= epoch}
        for slot in slots:
            for rank in range(world):
                for pid in range(programs):
                    missing = [s for s in range(world) if s != rank and (rank, slot + s, pid) not in done]
                    assert not missing, f"rank {rank} program {pid} read what ranks {missing} push unwaited"
        self.waits.clear()

    def take(self, rank: int) -> list[tuple[int, int, int, int, int, int]]:
        """The puts ``rank`` made since the last take: (peer, dst region, dst off, src region, src off, bytes)."""
        mine = sorted(p[1:] for p in self.puts if p[0] == rank)
        self.puts = [p for p in self.puts if p[0] != rank]
        return mine


def device_calls(put: Callable, put_signal: Callable, signal: Callable, wait: Callable) -> SimpleNamespace:
    """The ``gpuclient.triton`` calls the MoE kernels make, for the interpreter: the fabric's own four, and the
    every-peer calls built on its signal and wait, as the device's are."""
    value = Fabric.value

    def signal_peers(ch, rank, world, slot, v, op=0):  # noqa: ANN001, ANN202
        for peer in range(value(world)):
            if peer != value(rank):
                signal(ch, peer, value(slot) + value(rank), v, op)

    def wait_peers(ch, rank, world, slot, at_least):  # noqa: ANN001, ANN202
        for peer in range(value(world)):
            if peer != value(rank):
                wait(ch, value(slot) + peer, at_least)

    return SimpleNamespace(put=put, put_signal=put_signal, signal=signal, wait=wait, signal_peers=signal_peers,
                           wait_peers=wait_peers)


def planned_dispatch(lay: MoELayout, counts_all: np.ndarray) -> list[tuple[int, int, int, int, int, int]]:
    """The model's dispatch puts of ``lay.rank``, as the fabric records them: the count row to every peer, per
    peer its rows for all of the peer's experts (stage rows to its land_x slice for this rank, in pieces of
    ``land_put_rows``), and per peer the handle words of its experts (send_src to the peer's src_stage slice for
    this rank)."""
    return planned_puts(lay, REGIONS, "land_x", lay.dispatch_puts(counts_all))


def planned_puts(lay: MoELayout, regions: tuple[str, ...], rows_to: str,
                 row_puts: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int, int]]:
    """A dispatch's puts as the fabric records them (peer, dst region, dst byte, src region, src byte, bytes),
    sorted: the count row to every peer, ``row_puts`` ((peer, _, stage row, row there, rows) from ``send_x`` into
    the peer's ``rows_to``), and the handle-word puts; region ids as ``regions`` numbers them."""
    r, row = {name: i for i, name in enumerate(regions)}, lay.row_bytes
    puts = [(peer, r["counts_all"], lay.rank * lay.num_experts * 4, r["counts_all"], lay.rank * lay.num_experts * 4,
             lay.num_experts * 4) for peer in range(lay.world) if peer != lay.rank]
    for d, _, first, dst, n in row_puts:
        puts.append((d, r[rows_to], dst * row, r["send_x"], first * row, n * row))
    for d, at, to, n in lay.handle_puts():
        puts.append((d, r["src_stage"], to * 4, r["send_src"], at * 4, n * 4))
    return sorted(puts)


def planned_combine(lay: MoELayout, counts_all: np.ndarray) -> list[tuple[int, int, int, int, int, int]]:
    """The model's combine puts of ``lay.rank``: per (local expert, source) block piece, y's rows (from send_y,
    where they are copied first) to the source's combine rows at its stage rows."""
    r, row = {name: i for i, name in enumerate(REGIONS)}, lay.row_bytes
    return sorted((s, r["combine_buf"], home * row, r["send_y"], y_row * row, n * row)
                  for s, _, y_row, home, n in lay.combine_puts(counts_all))


def _rank_state(lay: MoELayout) -> SimpleNamespace:
    W, E, L, T, K, H = lay.world, lay.num_experts, lay.local_experts, lay.max_tokens, lay.topk, lay.hidden  # noqa: N806
    nan = bf16(np.float32(np.nan))
    return SimpleNamespace(
        ch=np.zeros(8, dtype=np.uint64), flags=np.zeros(lay.slot_base + lay.slots, dtype=np.int64),
        counts_all=np.zeros((W, E), np.int32), recv_x=np.full((L, lay.capacity, H), nan, np.uint16),
        recv_src=np.full((L, lay.capacity), -1, np.int32), src_stage=np.full((W, L, T), -1, np.int32),
        send_x=np.full((lay.stage_capacity, H), nan, np.uint16),
        send_src=np.full((E, T), -1, np.int32), combine_buf=np.full((lay.stage_capacity, H), nan, np.uint16),
        send_y=np.zeros((L, lay.capacity, H), np.uint16), land_x=np.full((W, lay.source_rows, H), nan, np.uint16),
        idx32=np.full((T, K), -1, np.int32),
        stage_row=np.full((T, K), -1, np.int32), stage_off=np.zeros(E, np.int32), recv_count=np.zeros(L, np.int32),
        recv_layout=np.zeros((L, W, 2), np.int32), out=np.zeros((T, H), np.uint16),
        rounds=np.zeros(3, np.int32))  # the op's round words (gpuclient.kernels._rounds)


def _b(arr: np.ndarray) -> Buffer:
    kind = {np.dtype(np.uint16): "bfloat16", np.dtype(np.int32): "int32", np.dtype(np.int64): "int64",
            np.dtype(np.float32): "float32", np.dtype(np.uint64): "uint64", np.dtype(np.uint8): "uint8"}[arr.dtype]
    return Buffer(arr, kind)


def index_scalars() -> None:
    """Let the interpreter's scalars bound a ``range`` (a kernel's ``range(pid, tokens, progs)``): numpy 2 refuses
    ``int()`` of its 1-element arrays. Once per process."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "indexes_scalars", False):
        return

    def scalar_index(tensor: object, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    scalar_index.indexes_scalars = True
    interpreter._patch_lang_tensor = scalar_index


def simulate(world: int, experts: int, max_tokens: int, topk: int, hidden: int, programs: int,
             put_rows: int | None = None) -> None:
    """Three rounds of dispatch, an expert function and combine, checked against the model; ``put_rows`` below
    ``max_tokens`` splits the blocks (as a block past the largest put is)."""
    import gpuclient.kernels.moe_kernels as m
    from gpuclient.kernels.moe import _pow2

    index_scalars()
    rng = np.random.default_rng(world * 10 + topk)
    max_put = (put_rows or max_tokens) * hidden * 2
    lays = [MoELayout(r, world, experts, max_tokens, topk, hidden, slot_base=2, max_put_bytes=max_put)
            for r in range(world)]
    ranks = [_rank_state(lay) for lay in lays]
    fabric = Fabric(ranks)
    fabric.max_put = max_put
    m.tpd = device_calls(fabric.put, fabric.put_signal, fabric.signal, fabric.wait)
    lay0 = lays[0]
    W_, E_, L_, K_, T_, H_ = world, experts, lay0.local_experts, topk, max_tokens, hidden  # noqa: N806
    block_h, copy_rows, put_rows_ = 16, 2, lay0.put_rows
    regions = {name: i for i, name in enumerate(REGIONS)}
    scale = rng.choice([0.5, 1.0, 2.0, -1.0, 4.0], size=experts)  # exact in bf16: only the sum rounds
    # _moe_dispatch in its two phases, each rank's in turn: every rank's sends, then every rank's finish
    dispatch_meta = {"W": W_, "E": E_, "L": L_, "T": T_, "ROW": H_, "ROW_BYTES": 2 * H_,
                     "SOURCE_ROWS": lay0.source_rows, "LAND_PUT_ROWS": lay0.land_put_rows,
                     "HANDLE_WORDS": lay0.handle_words, "LP": _pow2(L_), "WP": _pow2(W_), "BLOCK_T": 4,
                     "COPY_ROWS": copy_rows, "BLOCK_H": block_h}

    def dispatch_args(r: int, st: SimpleNamespace) -> tuple:
        return (_b(st.ch), _b(st.rounds), r, _b(st.counts_all), _b(st.stage_off), _b(st.recv_x), _b(st.recv_src),
                _b(st.src_stage), _b(st.land_x), _b(st.recv_count), _b(st.recv_layout),
                *[regions[n] for n in ("counts_all", "land_x", "src_stage", "send_x", "send_src")],
                lays[r].count_slot, lays[r].dispatch_slot)

    for rnd in range(1, 4):
        tokens = [max_tokens - (r + rnd) % 3 for r in range(world)]
        if rnd == 3 and world > 1:
            tokens[-1] = 0  # a rank with nothing to send
        idx = uneven_routing(rng, world, experts, max_tokens, topk, tokens,
                             dtype=np.int32 if rnd % 2 else np.int64)
        x = [bf16(rng.standard_normal((n, hidden))) for n in tokens]
        w = [rng.random((n, topk)).astype(np.float32) for n in tokens]
        for st in ranks:  # what the peers owe, where it lands, and the stage: poisoned
            st.recv_x[:] = bf16(np.float32(np.nan))
            st.land_x[:] = bf16(np.float32(np.nan))
            st.src_stage[:] = -1
            st.combine_buf[:] = bf16(np.float32(np.nan))
            st.send_x[:] = bf16(np.float32(np.nan))
        for r, st in enumerate(ranks):
            m._moe_route[(programs,)](_b(idx[r]), _b(st.idx32), _b(st.stage_row), _b(st.counts_all),
                                      _b(st.stage_off), _b(st.send_src), r, tokens[r], E=E_, K=K_, KP=_pow2(K_),
                                      T=T_, BLOCK_T=4)
            m._moe_stage[(programs + 1,)](_b(x[r]), _b(st.idx32), _b(st.stage_row), _b(st.stage_off), _b(st.send_x),
                                          _b(st.recv_x), _b(st.recv_src), r, tokens[r], W=W_, L=L_, K=K_,
                                          KP=_pow2(K_), T=T_, H=H_, ROW=H_, COPY_ROWS=copy_rows, BLOCK_H=block_h)
        fabric.check_waits()
        model = dispatch_model(lays, idx)
        for r, st in enumerate(ranks):  # the stage: expert-major, each peer expert's row its entry's token row, bit
            valid = model[r]["idx"] >= 0  # for bit; the rank's own experts' rows went to recv_x, not there
            assert (st.stage_row[:tokens[r]][valid] == model[r]["stage_row"][valid]).all(), (rnd, r)
            assert (st.stage_off == lays[r].stage_offsets(model[r]["counts_all"][r])).all(), (rnd, r)
            own = model[r]["counts_all"][r]
            own_lo = int(own[:r * L_].sum())
            own_hi = own_lo + int(own[r * L_:(r + 1) * L_].sum())
            for i, word in enumerate(model[r]["stage_src"]):
                if word >= 0 and not own_lo <= i < own_hi:
                    assert (st.send_x[i] == x[r][lays[r].decode(word)[1]]).all(), (rnd, r, i)
            assert np.isnan(f32(st.send_x[own_lo:own_hi])).all(), (rnd, r, "own rows staged in send_x")
        for r, st in enumerate(ranks):  # ranks run in turn: deliver the count rows _moe_dispatch's program 0 puts
            for peer in ranks:
                if peer is not st:
                    peer.counts_all[r] = st.counts_all[r]
        flags_before = [st.flags.copy() for st in ranks]
        fabric.records.clear()
        for r, st in enumerate(ranks):
            m._moe_dispatch[(programs,)](*dispatch_args(r, st), **dispatch_meta, SEND=True, FINISH=False)
        assert not fabric.waits, "the send phase waits for nothing"
        # the send phase alone leaves the round where it was: only the finish, last, runs it
        assert all(list(st.rounds) == [rnd - 1, 0, 0] for st in ranks), [list(st.rounds) for st in ranks]
        for r, lay in enumerate(lays):  # the puts are the model's, offset for offset and byte for byte
            assert fabric.take(r) == planned_dispatch(lay, model[r]["counts_all"]), (rnd, r)
        for r, st in enumerate(ranks):  # one count signal and one dispatch signal from each peer per round
            got = st.flags - flags_before[r]
            for base in (lays[r].count_slot, lays[r].dispatch_slot):
                assert [int(got[base + s]) for s in range(world)] == [int(s != r) for s in range(world)]
        for r, st in enumerate(ranks):
            m._moe_dispatch[(1,)](*dispatch_args(r, st), **dispatch_meta, SEND=False, FINISH=True)
        # the finish packs the peers' rows: it waited for their counts and their dispatch flags
        fabric.check_waits(lay0.count_slot, lay0.dispatch_slot, epoch=rnd, programs=1)
        assert all(list(st.rounds) == [rnd, 0, 0] for st in ranks), [list(st.rounds) for st in ranks]
        for r, lay in enumerate(lays):  # records per destination: the count, a put per block, the handle words
            want_records = lay.writes(model[r]["counts_all"])["dispatch"]
            assert [fabric.records[r, d] for d in range(world)] == want_records, (rnd, r)
        for r, st in enumerate(ranks):
            assert (st.idx32[:tokens[r]] == model[r]["idx"]).all()
            assert (st.counts_all == model[r]["counts_all"]).all()
            assert (st.recv_count == model[r]["recv_count"]).all() and (st.recv_layout == model[r]["recv_layout"]).all()
            for local in range(L_):
                n = int(st.recv_count[local])
                assert (st.recv_src[local, :n] == model[r]["recv_src"][local, :n]).all(), (rnd, r, local)
                for p in range(n):  # every received row is its token's row, bit for bit
                    src, t, _ = lays[r].decode(st.recv_src[local, p])
                    assert (st.recv_x[local, p] == x[src][t]).all(), (rnd, r, local, p)
        # the experts: expert e scales its rows (the rows past the counts stay NaN and are never read)
        ys = []
        for r, st in enumerate(ranks):
            y = f32(st.recv_x) * scale[r * L_:(r + 1) * L_, None, None].astype(np.float32)
            ys.append(bf16(y))
        fabric.records.clear()
        for r, st in enumerate(ranks):
            m._moe_combine_send[(programs,)](_b(st.ch), r, _b(ys[r]), _b(st.counts_all), _b(st.send_y),
                                             _b(st.combine_buf), regions["combine_buf"], regions["send_y"], W=W_,
                                             E=E_, L=L_, T=T_, H=H_, EP=_pow2(E_), COPY_ROWS=copy_rows,
                                             BLOCK_H=block_h, PUT_ROWS=put_rows_)
        fabric.check_waits()
        for r, lay in enumerate(lays):
            assert fabric.take(r) == planned_combine(lay, model[r]["counts_all"]), (rnd, r)
        weights = [np.ascontiguousarray(a) for a in w]
        for r, st in enumerate(ranks):
            m._moe_combine_reduce[(programs,)](_b(st.ch), _b(st.rounds), r, tokens[r], _b(st.idx32), _b(st.stage_row),
                                               _b(weights[r]), _b(st.combine_buf), _b(st.out), lays[r].combine_slot,
                                               W=W_, K=K_, H=H_, BLOCK_H=block_h)
        fabric.check_waits(lay0.combine_slot, epoch=rnd, programs=programs)  # every program reads the outputs
        for r, lay in enumerate(lays):
            assert [fabric.records[r, d] for d in range(world)] == lay.writes(model[r]["counts_all"])["combine"]
        want = combine_model(lays, model, [f32(y).astype(np.float64) for y in ys], [a.astype(np.float64) for a in w])
        for r, st in enumerate(ranks):
            got = f32(st.out[:tokens[r]]).astype(np.float64)
            assert np.isfinite(got).all(), f"round {rnd} rank {r}: a slot read before it was written"
            np.testing.assert_allclose(got, want[r], rtol=2 ** -7, atol=1e-6, err_msg=f"round {rnd} rank {r}")
        for r, st in enumerate(ranks):  # each round adds exactly one to every peer's slots: no reset needed
            lay = lays[r]
            for base in (lay.count_slot, lay.dispatch_slot, lay.combine_slot):
                assert [int(st.flags[base + s]) for s in range(world)] == [rnd * (s != r) for s in range(world)]


if __name__ == "__main__":
    simulate(*(int(a) for a in sys.argv[1:]))
    print("ok")
