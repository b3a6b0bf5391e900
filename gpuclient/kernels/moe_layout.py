"""The routing and buffer layout of ``gpuclient.kernels.MoE``, in numpy: what the kernels compute, as a model.

The MoE op's GPU kernels (``gpuclient/kernels/moe.py``) implement exactly the functions here; the host side
uses :class:`MoELayout` for its checks, buffer shapes and flag slots, and the tests compare both the kernels
(on a GPU) and brute-force enumerations (on the CPU) against these functions. Nothing here needs torch.

Names: ``W`` ranks, ``E`` experts (``L = E / W`` local experts per rank: global expert ``e`` lives on rank
``e // L`` as its local expert ``e % L``), ``T`` the most tokens a rank dispatches per call, ``K`` top-k,
``H`` the hidden size.

Routing (per source rank). Entry ``(t, k)`` of ``topk_idx`` is *valid* when ``0 <= idx < E`` and no earlier
``k' < k`` of the same token names the same expert (a repeat is dropped, as if it were -1): so an expert
gets each token at most once and a source sends an expert at most ``T`` rows. Each valid entry travels once,
as one row, to its expert (per (token, expert), not per (token, rank): see docs/kernels.md). Its *position*
is its rank among the source's tokens routed to the same expert, in token order.

Receive layout (per rank, per local expert ``l``): ``W * T`` rows; the rows from source ``s`` start at
``offset[l, s] = sum over s' < s of count[s', e]`` (``e`` the global expert) and are packed, so the first
``recv_count[l]`` rows of expert ``l`` are its tokens, source by source in rank order, each source's in
token order. ``recv_src[l, p] = s * T * K + t * K + k`` names the row's origin (-1 past the count).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_INT32_MAX = (1 << 31) - 1


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class MoELayout:
    """Geometry, checks and flag slots of one rank's MoE dispatch/combine (torch-free)."""

    rank: int
    world: int
    num_experts: int
    max_tokens: int
    topk: int
    hidden: int
    slot_base: int = 0

    def __post_init__(self) -> None:
        for name in ("world", "num_experts", "max_tokens", "topk", "hidden"):
            _positive(name, getattr(self, name))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank!r}")
        if self.num_experts % self.world:
            raise ValueError(f"num_experts={self.num_experts} does not split evenly over {self.world} ranks")
        if isinstance(self.slot_base, bool) or not isinstance(self.slot_base, int) or self.slot_base < 0:
            raise ValueError(f"slot_base must be an integer >= 0, got {self.slot_base!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} is more than num_experts={self.num_experts}")
        # the handle's source word s*T*K + t*K + k and every row index are int32 in the kernels
        if self.world * self.max_tokens * self.topk > _INT32_MAX:
            raise ValueError(f"world * max_tokens * topk = {self.world * self.max_tokens * self.topk} passes "
                             "the int32 source word: lower max_tokens")
        if self.local_experts * self.capacity > _INT32_MAX:
            raise ValueError("local_experts * world * max_tokens receive rows pass int32: lower max_tokens")
        if self.row_bytes > 0xFFFF_FFFF or self.num_experts * 4 > 0xFFFF_FFFF:
            raise ValueError(f"a row of {self.row_bytes} bytes passes a put's 32-bit length")

    # --- geometry -------------------------------------------------------------------------------------------------
    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def capacity(self) -> int:
        """Receive rows per local expert: every source may send it each of its ``T`` tokens once."""
        return self.world * self.max_tokens

    @property
    def row_bytes(self) -> int:
        """One token row, bf16."""
        return self.hidden * 2

    def owner(self, expert: int) -> tuple[int, int]:
        """(rank, local expert) of global expert ``expert``."""
        return divmod(int(expert), self.local_experts)

    def encode(self, src: int, token: int, k: int) -> int:
        """The handle's word for a row that came from ``src``'s token ``token``, top-k entry ``k``."""
        return (src * self.max_tokens + token) * self.topk + k

    def decode(self, word: int) -> tuple[int, int, int]:
        """(source rank, token, k) of a handle word."""
        rest, k = divmod(int(word), self.topk)
        src, token = divmod(rest, self.max_tokens)
        return src, token, k

    # --- flag slots (this rank's flags; index + s is "from rank s") -------------------------------------------------
    @property
    def count_slot(self) -> int:
        """``+ s``: rank s's per-expert counts of a round have arrived (its put_signal; ADD 1 per round)."""
        return self.slot_base

    @property
    def dispatch_slot(self) -> int:
        """``+ s``: every row and handle word rank s sends us in a round is placed (a SIGNAL after them)."""
        return self.slot_base + self.world

    @property
    def combine_slot(self) -> int:
        """``+ s``: every expert output rank s sends back in a round is placed (a SIGNAL after them)."""
        return self.slot_base + 2 * self.world

    @property
    def slots(self) -> int:
        return 3 * self.world

    # --- the model -------------------------------------------------------------------------------------------------
    def check_topk(self, topk_idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(topk_idx)
        if idx.ndim != 2 or idx.shape[1] != self.topk or idx.shape[0] > self.max_tokens:
            raise ValueError(f"topk_idx must be [tokens <= {self.max_tokens}, {self.topk}], got {idx.shape}")
        return idx.astype(np.int64)

    def normalize(self, topk_idx: np.ndarray) -> np.ndarray:
        """``topk_idx`` as the kernels keep it (int32): invalid entries and repeats within a token are -1."""
        idx = self.check_topk(topk_idx)
        out = np.where((idx >= 0) & (idx < self.num_experts), idx, -1)
        for k in range(1, self.topk):
            repeat = (out[:, :k] == out[:, k:k + 1]).any(axis=1)
            out[:, k] = np.where(repeat, -1, out[:, k])
        return out.astype(np.int32)

    def route(self, topk_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's routing: ``counts`` [E] (rows to each expert), ``pos`` [tokens, K] (each valid entry's
        position among the expert's rows from this rank, -1 for invalid) and ``send_src`` [E, T] (the handle
        word of each expert's j-th row, -1 past the count)."""
        idx = self.normalize(topk_idx)
        tokens = idx.shape[0]
        counts = np.zeros(self.num_experts, dtype=np.int32)
        pos = np.full(idx.shape, -1, dtype=np.int32)
        send_src = np.full((self.num_experts, self.max_tokens), -1, dtype=np.int32)
        for e in range(self.num_experts):  # vectorised over tokens: a token holds e at most once after normalize
            t, k = np.nonzero(idx == e)
            order = np.argsort(t, kind="stable")
            t, k = t[order], k[order]
            pos[t, k] = np.arange(len(t))
            send_src[e, :len(t)] = (self.rank * self.max_tokens + t) * self.topk + k
            counts[e] = len(t)
        assert counts.sum() == (idx >= 0).sum() and (counts <= tokens).all()
        return counts, pos, send_src

    def source_offsets(self, counts_all: np.ndarray) -> np.ndarray:
        """[W, E]: where source s's rows start in expert e's receive rows (an exclusive sum over sources)."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        return (np.cumsum(c, axis=0) - c).astype(np.int32)

    def destination(self, counts_all: np.ndarray, expert: int, pos: int) -> tuple[int, int, int]:
        """(rank, local expert, row) where this rank's entry with ``pos`` for ``expert`` lands."""
        d, local = self.owner(expert)
        return d, local, int(self.source_offsets(counts_all)[self.rank, expert]) + int(pos)

    def receive(self, counts_all: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's receive side from every source's counts ([W, E]): ``recv_count`` [L] and ``recv_layout``
        [L, W, 2] (offset, count of the rows from each source)."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        mine = c[:, self.rank * self.local_experts:(self.rank + 1) * self.local_experts].T  # [L, W]
        layout = np.stack([np.cumsum(mine, axis=1) - mine, mine], axis=-1).astype(np.int32)
        recv_count = mine.sum(axis=1).astype(np.int32)
        assert (recv_count <= self.capacity).all()
        return recv_count, layout


def dispatch_model(layouts: list[MoELayout], topk_idx: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every rank's dispatch, from every rank's ``topk_idx``: per rank ``counts_all`` [W, E], ``recv_count`` [L],
    ``recv_layout`` [L, W, 2], ``recv_src`` [L, W*T] (-1 where no row lands) and its own ``idx``, ``pos``."""
    routes = [lay.route(idx) for lay, idx in zip(layouts, topk_idx, strict=True)]
    counts_all = np.stack([r[0] for r in routes])
    out = []
    for lay in layouts:
        recv_count, recv_layout = lay.receive(counts_all)
        out.append({"counts_all": counts_all, "recv_count": recv_count, "recv_layout": recv_layout,
                    "recv_src": np.full((lay.local_experts, lay.capacity), -1, dtype=np.int32),
                    "idx": lay.normalize(topk_idx[lay.rank]), "pos": routes[lay.rank][1]})
    for src, lay in enumerate(layouts):  # what each source's send kernel does, entry by entry
        idx, pos = out[src]["idx"], out[src]["pos"]
        for t, k in zip(*np.nonzero(idx >= 0), strict=True):
            d, local, row = lay.destination(counts_all, idx[t, k], pos[t, k])
            assert out[d]["recv_src"][local, row] == -1, "two rows landed on one slot"
            out[d]["recv_src"][local, row] = lay.encode(src, t, k)
    return out


def combine_model(layouts: list[MoELayout], received: list[dict[str, np.ndarray]], expert_out: list[np.ndarray],
                  weights: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank's combine: ``expert_out[r]`` is rank r's output in its receive layout [L, W*T, H]; returns per
    rank [tokens, H] float64, the weighted sum over each token's valid entries of its experts' rows."""
    outs = [np.zeros((w.shape[0], lay.hidden)) for lay, w in zip(layouts, weights, strict=True)]
    for r, lay in enumerate(layouts):
        for local in range(lay.local_experts):
            for p in range(int(received[r]["recv_count"][local])):
                src, t, k = lay.decode(received[r]["recv_src"][local, p])
                outs[src][t] += weights[src][t, k] * np.asarray(expert_out[r][local, p], dtype=np.float64)
    return outs
