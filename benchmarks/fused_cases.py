"""The fused kernels built on two ranks, ready to launch: what ``fused_bench.py``'s rows, ``--tune`` and
``launch_bench.py`` time.

Two daemons (``LocalCluster`` over softverbs) serve the ``WORLD`` ranks, which share this process and one GPU; a
call's options past the sizes (``RunOptions``) shape the daemons and the ops. Each kernel's builder (``CASES``)
makes every rank's op and inputs and returns a ``Case``: its launch, the library compute it is measured against,
and its error against a torch reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from benchmarks.fabric_bench import SHAPES, SoftOptions
from benchmarks.fused_timeline import trace_done
from gpuclient import exchange_all

#: the NIC model each backend is shaped like by default
BACKEND_SHAPE = {"ib": "cx7-400g", "efa": "efa-200g"}
WORLD = 2
#: programs per rank of the ops whose programs spin on a peer's data at one program an SM (GEMM+RS/AR, MoE
#: Dispatch+GEMM's expert GEMM, and ring attention at its 128x128, 8-warp tiles): 66 + 66 fill the H200's 132 SMs
#: and the launch hangs until its spin bound traps, because the soft fabric places a GPU write with a
#: device-to-device copy that runs on SMs (benchmarks/copy_needs_sms.py: a 64 MiB copy does not complete while
#: spinning blocks hold every SM). 60 + 60 leave 12 SMs for those copies; against 48 it ran ring attention's
#: compute 1.26x faster in one call (h200-2026-12-02-fused-ring-attention-{48,60}-programs.json). A ConnectX needs none.
SPINNING_PROGRAMS = 60
#: where each rank's flag words live (``--flags``): the ops' own device flags, or a host flag file made first
FLAG_PLACEMENTS = ("device", "host")
#: how an efa daemon publishes flags into GPU memory (``--publication``, ``flags.publication``): ``cuda-copy`` (word
#: copies posted on the worker's stream, under the MPS this bench starts) or ``auto`` (here, with no GDRCopy: a
#: loopback RDMA write, which over softverbs is a whole soft-fabric round trip in Python: docs/performance.md)
PUBLICATIONS = ("auto", "loopback", "cuda-copy")
HOST_FLAG_WORDS = 1 << 16  # enough for every op's slots at every size here


@dataclass(frozen=True)
class RunOptions:
    """How a call runs its daemons and ops, past the sizes: what the command line gave, passed to every row."""

    #: the daemons' soft devices (``--copy-via``, ``--io-spin-us``, ``--nic-spin-us``, ``--gil-switch-us``,
    #: ``--nic-streaming/--no-nic-streaming``)
    soft: SoftOptions = field(default_factory=SoftOptions)
    #: programs per rank for every fused op (``--programs``); None: the op's default, the SMs over the ranks sharing
    programs: int | None = None
    #: where each rank's flag words live (``--flags``, ``FLAG_PLACEMENTS``)
    flags: str = "device"
    #: how an efa daemon publishes flags into GPU memory (``--publication``, ``PUBLICATIONS``)
    publication: str = "cuda-copy"
    #: the daemons' ``proxy.poll_window_us`` (``--poll-window-us``); None: the config's default
    poll_window_us: int | None = None

    def daemon_config(self, backend: str, shape: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """The config the bench's daemons run with: the soft fabric shaped as ``shape``, these options, and
        ``config``'s sections on top."""
        overrides = self.soft.daemon_config(SHAPES.get(shape, {}))
        if self.poll_window_us is not None:
            overrides["proxy"] = {"poll_window_us": self.poll_window_us}
        if self.publication != "auto" and backend == "efa":
            overrides["flags"] = {"publication": self.publication}
        for section, values in (config or {}).items():
            overrides[section] = {**overrides.get(section, {}), **values}
        return overrides

    def record(self) -> dict[str, Any]:
        """The options as a call's JSON records them beside its rows (the command line's names and units)."""
        return {**self.soft.as_options(), "flags": self.flags, "publication": self.publication,
                "programs": self.programs, "poll_window_us": self.poll_window_us}


#: a call's options at the command line's defaults
DEFAULT_RUN = RunOptions()


@dataclass
class Case:
    """One kernel at one size, built on both ranks and ready to launch."""

    launch: Callable[..., None]  # launch(communicate=True, compute=True): every rank's kernel on its stream
    torch_compute: Callable[[], None]  # the library compute, every rank on its stream
    error: Callable[[], float]  # max |fused - torch reference| after one fused launch
    flops: float  # of one launch, all ranks
    moved: int  # bytes the ranks send one another in one launch, all ranks
    ops: list[Any]
    params: dict[str, Any] = field(default_factory=dict)
    # for the compute alone (``--tune``): put where a ``communicate=False`` launch reads what the peers would have
    # sent; then the max |output - torch reference| over what that launch defines
    stage: Callable[[], None] = lambda: None
    compute_error: Callable[[], float] | None = None
    # ``launch(timelines=[one per rank], ...)`` records each rank's timeline (``--timeline``): the ops that have one
    timelines: bool = False
    # ``retile(tile)`` (``--tune``): every rank's op retiled and its compute variant preloaded, the compiled kernel
    # returned; None: the ops' own ``retile(**tile)`` and ``preload(communicate=False, compute=True)``
    retile: Callable[[dict[str, Any]], Any] | None = None


@contextmanager
def rank_sessions(run: RunOptions, backend: str, shape: str, job: str, device: int,
                  config: dict[str, Any] | None = None) -> Iterator[tuple[list[Any], list[Any]]]:
    """``(clients, sessions)`` of WORLD ranks joined on ``backend`` daemons shaped as ``shape`` and run as ``run``
    says (``config``: sections on top of its daemon config)."""
    import gpuclient
    from transportd_cli.localcluster import LocalCluster

    with LocalCluster(WORLD, backend=backend, overrides=run.daemon_config(backend, shape, config)) as cluster:
        clients = [gpuclient.connect(cluster.socket(name), timeout=60) for name in cluster.names]
        sessions = [c.join(job, rank=r, world=WORLD, device=device) for r, c in enumerate(clients)]
        if run.flags == "host":  # the ops take the session's flag array when it has one
            for s in sessions:
                s.flags(HOST_FLAG_WORDS, where="host")
        try:
            yield clients, sessions
        finally:
            for c, s in zip(clients, sessions, strict=True):
                s.leave()
                c.close()


def _ready(ops: list[Any]) -> None:
    """Every variant of every rank's op loaded before any launch: the ranks share this process."""
    for op in ops:
        op.prepare()
        op.preload(communicate=True, compute=False)
        op.preload(communicate=False, compute=True)


def randn_bf16(gen: Any, *shape: int, device: int) -> Any:
    import torch

    return torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda(device)


def uniform_topk(gen: Any, tokens: int, experts: int, topk: int, device: int) -> Any:
    """``[tokens, topk]`` int64 expert indices on the GPU: each token's ``topk`` experts distinct and uniform."""
    import torch

    return torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).cuda(device)


def _on_streams(streams: list[Any], work: Callable[[int], None]) -> None:
    import torch

    for r, s in enumerate(streams):
        with torch.cuda.stream(s):
            work(r)


def allgather_gemm(sessions: list[Any], streams: list[Any], gen: Any, device: int, m_local: int, n: int, k: int,
                   chunk_rows: int, group_m: int | None = None, programs: int | None = None) -> Case:
    """``C = all_gather(A) @ B`` on every rank (``group_m``: the tile order; None: the op's; ``programs``: a rank's,
    None: the op's)."""
    import torch

    from gpuclient.kernels import AllGatherGemm

    order = {} if group_m is None else {"group_m": group_m}
    ops = [AllGatherGemm(s, m_local, n, k, chunk_rows=chunk_rows, share=WORLD, programs=programs, **order)
           for s in sessions]
    exchange_all(sessions, timeout=60)
    _ready(ops)
    shards = [randn_bf16(gen, m_local, k, device=device) for _ in ops]
    bs = [randn_bf16(gen, k, n, device=device) for _ in ops]
    outs = [torch.empty(WORLD * m_local, n, dtype=torch.float32, device=f"cuda:{device}") for _ in ops]
    for op, shard in zip(ops, shards, strict=True):
        op.local_rows().copy_(shard)
    gathered = torch.cat(shards)
    torch.cuda.synchronize()

    def launch(**kw: bool) -> None:
        for r, op in enumerate(ops):
            op(None, bs[r], outs[r], stream=streams[r], **kw)

    def error() -> float:
        return max(float((outs[r] - gathered.float() @ bs[r].float()).abs().max()) for r in range(WORLD))

    def stage() -> None:  # every shard in every rank's gathered A: the compute alone then makes all of C
        for op in ops:
            op.gathered.copy_(gathered)

    return Case(launch, lambda: _on_streams(streams, lambda r: torch.matmul(gathered, bs[r])), error,
                flops=2.0 * WORLD * (WORLD * m_local) * n * k, moved=WORLD * (WORLD - 1) * m_local * k * 2, ops=ops,
                params={"programs": ops[0].programs}, stage=stage, compute_error=error)


def _gemm_reduce(all_reduce: bool, sessions: list[Any], streams: list[Any], gen: Any, device: int, m: int, n: int,
                 k: int, chunk_rows: int, group_m: int | None = None, programs: int | None = None) -> Case:
    """``reduce_scatter(A_r @ B_r)`` or ``all_reduce(A_r @ B_r)`` (bf16 partials; bf16 output for all-reduce,
    whose result travels too, fp32 for reduce-scatter; ``group_m``: the tile order, None: the op's; ``programs``:
    a rank's, None: ``SPINNING_PROGRAMS``)."""
    import torch

    from gpuclient.kernels import GemmAllReduce, GemmReduceScatter

    cls = GemmAllReduce if all_reduce else GemmReduceScatter
    out_dtype = torch.bfloat16 if all_reduce else torch.float32
    order = {} if group_m is None else {"group_m": group_m}
    ops = [cls(s, m, n, k, chunk_rows=chunk_rows, share=WORLD, out_dtype=out_dtype,
               programs=programs or SPINNING_PROGRAMS, **order) for s in sessions]
    exchange_all(sessions, timeout=60)
    _ready(ops)
    a = [randn_bf16(gen, m, k, device=device) for _ in ops]
    b = [randn_bf16(gen, k, n, device=device) for _ in ops]
    m_seg = m // WORLD
    outs = [ops[r].result if all_reduce else torch.empty(m_seg, n, dtype=out_dtype, device=f"cuda:{device}")
            for r in range(WORLD)]
    torch.cuda.synchronize()

    def launch(timelines: list[Any] | None = None, **kw: bool) -> None:
        for r, op in enumerate(ops):
            op(a[r], b[r], None if all_reduce else outs[r], stream=streams[r],
               timeline=None if timelines is None else timelines[r], **kw)

    def error() -> float:
        total = sum(a[r].float() @ b[r].float() for r in range(WORLD))
        if all_reduce:
            return max(float((outs[r].float() - total).abs().max()) for r in range(WORLD))
        return max(float((outs[r].float() - total[r * m_seg:(r + 1) * m_seg]).abs().max()) for r in range(WORLD))

    def compute_error() -> float:
        """The compute alone leaves in the own segment's output rows the rank's own partial of them."""
        rows = [slice(r * m_seg, (r + 1) * m_seg) for r in range(WORLD)]
        own = [outs[r][rows[r]] if all_reduce else outs[r] for r in range(WORLD)]
        return max(float((own[r].float() - a[r][rows[r]].float() @ b[r].float()).abs().max()) for r in range(WORLD))

    seg_bytes = m_seg * n * 2
    moved = WORLD * (WORLD - 1) * seg_bytes * (2 if all_reduce else 1)
    return Case(launch, lambda: _on_streams(streams, lambda r: torch.matmul(a[r], b[r])), error,
                flops=2.0 * WORLD * m * n * k, moved=moved, ops=ops,
                params={"programs": ops[0].programs, "out_dtype": str(out_dtype).removeprefix("torch.")},
                compute_error=compute_error, timelines=True)


def gemm_reduce_scatter(*args: Any, **kw: Any) -> Case:
    return _gemm_reduce(False, *args, **kw)


def gemm_all_reduce(*args: Any, **kw: Any) -> Case:
    return _gemm_reduce(True, *args, **kw)


def ring_attention(sessions: list[Any], streams: list[Any], gen: Any, device: int, heads: int, seq_local: int,
                   head_dim: int, chunk_rows: int, tma: int = 1, programs: int | None = None) -> Case:
    """Forward attention of each rank's queries over the whole (non-causal) sequence (``tma``: 1, the op's
    default, loads the whole key blocks through tensor descriptors; 0, ``--ring-pointers``, through pointers;
    ``programs``: a rank's, None: ``SPINNING_PROGRAMS``)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    from gpuclient.kernels import RingAttention

    ops = [RingAttention(s, heads, seq_local, head_dim, chunk_rows=chunk_rows, comm_programs=4, share=WORLD,
                         programs=programs or SPINNING_PROGRAMS, tma=bool(tma)) for s in sessions]
    exchange_all(sessions, timeout=60)
    _ready(ops)
    q, k, v = ([randn_bf16(gen, heads, seq_local, head_dim, device=device) for _ in ops] for _ in range(3))
    outs = [torch.empty(heads, seq_local, head_dim, dtype=torch.float32, device=f"cuda:{device}") for _ in ops]
    k_all, v_all = torch.cat(k, dim=1), torch.cat(v, dim=1)
    torch.cuda.synchronize()

    def launch(**kw: bool) -> None:
        for r, op in enumerate(ops):
            op(q[r], k[r], v[r], outs[r], stream=streams[r], **kw)

    def error() -> float:  # float32 runs SDPA's math kernel, which holds every score: one head at a time
        return max(float((outs[r][h] - F.scaled_dot_product_attention(
            q[r][h:h + 1].float(), k_all[h:h + 1].float(), v_all[h:h + 1].float())[0]).abs().max())
            for r in range(WORLD) for h in range(heads))

    def sdpa(r: int) -> None:
        F.scaled_dot_product_attention(q[r][None], k_all[None], v_all[None])

    def stage() -> None:  # every origin's K and V in every rank's kv blocks ([heads, seq, 2, head_dim] each)
        blocks = torch.stack([torch.stack((k[o], v[o]), dim=2) for o in range(WORLD)])
        for op in ops:
            op.kv.copy_(blocks)

    block_bytes = heads * seq_local * 2 * head_dim * 2
    return Case(launch, lambda: _on_streams(streams, sdpa), error,
                flops=4.0 * WORLD * heads * seq_local * (WORLD * seq_local) * head_dim,
                moved=WORLD * (WORLD - 1) * block_bytes, ops=ops,
                params={"programs": ops[0].programs, "comm_programs": ops[0].comm_programs}, stage=stage,
                compute_error=error)


class MoeGemmRanks:
    """Every rank's ``MoE`` with ``dispatch_gemm`` (both timing variants loaded) and its inputs: uniform routing of
    ``tokens`` a rank, top-``topk`` of ``experts``, and each local expert's ``hidden`` x ``gemm_n`` weight."""

    def __init__(self, sessions: list[Any], device: int, gen: Any, tokens: int, hidden: int, topk: int,
                 experts: int, gemm_n: int, streams: list[Any] | None = None,
                 experts_per_put: int | None = None, split_experts: int | None = None,
                 programs: int | None = None) -> None:
        import torch

        from gpuclient.kernels import MoE

        self.ops = ops = [MoE(s, hidden, experts, tokens, topk, share=WORLD, gemm_n=gemm_n,
                              gemm_programs=programs or SPINNING_PROGRAMS, experts_per_put=experts_per_put,
                              split_experts=split_experts)
                          for s in sessions]
        exchange_all(sessions, timeout=60)
        for op in ops:
            op.prepare()
        self.preload()
        self.streams = streams or [torch.cuda.Stream(device) for _ in ops]
        self._counts: list[list[int]] = []  # the latest round's rows per local expert (``round``)
        local = ops[0].local_experts
        self.xs = [randn_bf16(gen, tokens, hidden, device=device) for _ in ops]
        self.idx = [uniform_topk(gen, tokens, experts, topk, device) for _ in ops]
        self.weights = [torch.rand(tokens, topk, generator=gen).cuda(device) for _ in ops]
        on_gpu = torch.Generator(device=f"cuda:{device}").manual_seed(9)  # weights of GiB: made on the GPU
        self.ws = [torch.randn(local, hidden, gemm_n, generator=on_gpu, device=f"cuda:{device}",
                               dtype=torch.bfloat16) * hidden ** -0.5 for _ in ops]
        torch.cuda.synchronize()

    def preload(self, communication: bool = True) -> Any:
        """Every rank's compute-alone variant loaded (and first, with ``communication``, its communication-alone
        one): the ranks share this process. The compute variant's compiled kernel returned."""
        if communication:
            for op in self.ops:
                op.preload_gemm(communicate=True, compute=False)
        return [op.preload_gemm(communicate=False, compute=True) for op in self.ops][0]

    def round(self, timelines: list[Any] | None = None, **kw: bool) -> float:
        """Seconds from the launches until every rank's stream is idle; then the round's combine, untimed.
        ``timelines``: one ``gemm_timeline()`` a rank, recorded by this round's launches."""
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handles = [op.dispatch_gemm(self.xs[r], self.idx[r], self.weights[r], self.ws[r], stream=self.streams[r],
                                    timeline=None if timelines is None else timelines[r], **kw)[2]
                   for r, op in enumerate(self.ops)]
        for s in self.streams:
            s.synchronize()
        seconds = time.perf_counter() - t0
        if timelines is not None:
            trace_done()  # the traced cycle (--trace) is the launch, not the combine after it
        if kw.get("communicate", True):  # close the round: the next dispatch needs it
            for r, op in enumerate(self.ops):
                op.combine(op.recv_x, handles[r], stream=self.streams[r])
            torch.cuda.synchronize()
            self._counts = [op.recv_count.cpu().tolist() for op in self.ops]
        return seconds

    def counts(self) -> list[list[int]]:
        """The latest round's rows per local expert, every rank (read once, after the round)."""
        return self._counts

    def error(self) -> float:
        """max |y - recv_x @ w| over the latest round's rows (y as the latest launch left it)."""
        error = 0.0
        for r, (op, counts) in enumerate(zip(self.ops, self.counts(), strict=True)):
            for e, c in enumerate(counts):
                if c:
                    ref = op.recv_x[e, :c].float() @ self.ws[r][e].float()
                    error = max(error, float((op.y[e, :c].float() - ref).abs().max()))
        return error

    def torch_compute(self) -> None:
        """Each local expert's rows times its weight (torch.matmul), every rank on its stream."""
        import torch

        for r, (op, counts) in enumerate(zip(self.ops, self.counts(), strict=True)):
            with torch.cuda.stream(self.streams[r]):
                for e, c in enumerate(counts):
                    if c:
                        torch.matmul(op.recv_x[e, :c], self.ws[r][e])


def moe_dispatch_gemm(sessions: list[Any], streams: list[Any], gen: Any, device: int, tokens: int, hidden: int,
                      topk: int, experts: int, gemm_n: int, experts_per_put: int | None = None,
                      split_experts: int | None = None, programs: int | None = None) -> Case:
    """The compute of MoE Dispatch+GEMM alone, for ``--tune`` (the fused row is ``moe_gemm_row``: its rounds
    close with an untimed combine): staged by one whole round, after which ``dispatch_gemm(communicate=False)``
    reruns the GEMM over that round's rows; its flops are counted then."""
    moe = MoeGemmRanks(sessions, device, gen, tokens, hidden, topk, experts, gemm_n, streams, experts_per_put,
                       split_experts, programs)

    def stage() -> None:
        moe.round()
        case.flops = 2.0 * sum(sum(c) for c in moe.counts()) * hidden * gemm_n

    def retile(tile: dict[str, Any]) -> Any:  # only the compute variant runs after it
        for op in moe.ops:
            op.retile_gemm(tile["block"], num_warps=tile["num_warps"], num_stages=tile["num_stages"])
        return moe.preload(communication=False)

    case = Case(moe.round, moe.torch_compute, moe.error, flops=0.0, moved=0, ops=moe.ops,
                params={"programs": moe.ops[0].gemm_programs}, stage=stage, compute_error=moe.error, retile=retile)
    return case


#: each kernel's Case builder (``fused_row`` and ``--tune``; MoE Dispatch+GEMM's for ``--tune`` only)
CASES: dict[str, Callable[..., Case]] = {"allgather_gemm": allgather_gemm, "gemm_reduce_scatter": gemm_reduce_scatter,
                                         "gemm_all_reduce": gemm_all_reduce, "ring_attention": ring_attention,
                                         "moe_dispatch_gemm": moe_dispatch_gemm}


#: the kernels whose tile order ``--group-m`` sets (``_tiles.tile_at``)
GEMMS = ("allgather_gemm", "gemm_reduce_scatter", "gemm_all_reduce")


def check_channels(ops: list[Any]) -> None:
    """Raise if any rank's channel reports an error (the row's numbers would be of a broken run)."""
    for op in ops:
        status = op.channel.status()
        if status[0] != 0:
            raise RuntimeError(f"channel error {status}")


def size_label(dims: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in dims.items() if k != "chunk_rows")
