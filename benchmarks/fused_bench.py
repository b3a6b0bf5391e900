"""Overlap of the fused kernels: how much of the communication a fused launch hides behind its compute.

    python benchmarks/fused_bench.py --json benchmarks/results/fused.json [--kernels ...] [--quick]

(``--json`` is rewritten after every row, so a run cut short keeps what it measured.)

Two daemons (``LocalCluster`` over softverbs, ib RC and efa SRD), two ranks in this process sharing one GPU
(each rank's kernel gets half the SMs: ``share=2``), the soft fabric's direct GPU copies on and the NIC
model shaping each daemon's link like the NIC its backend stands for (ib: ConnectX-7 400 Gb/s, efa: EFA
200 Gb/s; ``--shapes`` adds ``unshaped``). The network is softverbs under that model, so every absolute
number here is "on the soft fabric shaped as that NIC", not a cluster's.

Kernels (``gpuclient.kernels``; two sizes each and backend, the first picked so that communication and compute
are within about 2x of each other under that backend's shape: ``SIZES``, ``EFA_SIZES``): AllGather+GEMM,
GEMM+ReduceScatter, GEMM+AllReduce (bf16 in, fp32 accumulate) and Ring Attention (forward, bf16). Each row
times, as the median of ``--reps`` launches of both ranks at once (host clock around launch and synchronize;
the modes in turn within each of ``--reps`` rounds, so a drift over the row weighs on all of them: ``interleaved``):

- ``compute``: the fused kernel with ``communicate=False`` (its compute on local data, waits satisfied);
- ``comm``: ``compute=False`` (the same kernel ships and waits on the same schedule, no math);
- ``fused``: both;
- ``torch``: the library compute on each rank's stream (cuBLAS ``matmul``; ``scaled_dot_product_attention``
  over the gathered sequence for ring attention);

and reports the overlap efficiency ``(comm + compute - fused) / min(comm, compute)`` (1: the shorter of the
two is hidden entirely, 0: nothing overlaps), the speedup over ``comm + compute`` (the same kernel run
unfused) and over ``comm + torch`` (the library compute, then the same transfers: the sequential baseline),
beside what a launch that hid the shorter part entirely would gain over it, ``(comm + torch) / max(comm,
compute)`` (``ideal``: where the communication dominates, no overlap buys more than that; a launch can still
come in under it when the communication ran slower alone than inside the fused launch), and whether the row is
inside the band where the targets apply and met both (``in_band``, ``meets_targets``: ``fused_standing.judge``;
``benchmarks/fused_standing.py`` counts them over calls). Each row also has
``comm_direct_copy_ms`` and ``fused_direct_copy_ms``: per launch and daemon, the time its soft devices spent
placing direct copies and the wire writes into GPU memory that joined their runs (softverbs' ``direct_ns``);
``comm_loopback_wait_ms`` and ``fused_loopback_wait_ms``: the time its efa workers spent posting and reaping their
flags' loopback writes (each rail's ``flag_loopback``);
``comm_link_busy_ms`` and ``fused_link_busy_ms``: the time its NIC model's link was busy (against the launch's
time, how much of it the modeled wire bounds); ``comm_flag_copies`` and ``fused_flag_copies``: the flag words its
efa workers copied into GPU memory (``flags.publication = "cuda-copy"``). MoE Dispatch+GEMM rows have the same
columns, each round's untimed combine included, and what the expert GEMM's deal costs at the round's counts
(``moe_gemm_work``): ``weight_passes`` (how many times each local expert's weights are streamed, 1.0 once) and
``row_block_fill`` (the received rows over the rows its row blocks span).

``--flags host``: each rank's flag words in a host flag file (pinned, mapped into the GPU) made before the
ops, which take the session's flags when it has them, instead of the GPU memory they allocate by default: on
efa the receiving daemon then stores each flag from the compiled data path instead of writing it into GPU
memory with a loopback RDMA write (no GDRCopy here); the kernels poll host memory over PCIe.

``--publication``: how the efa daemons publish flags into GPU memory (``flags.publication``). The default,
``cuda-copy``, posts each poll's flag words as host-to-device copies on the worker's stream, which under the MPS
started here run beside the kernels; ``auto`` is what a node with no GDRCopy picks, a loopback RDMA write, which
over softverbs costs a whole soft-fabric round trip in Python per batch (a NIC's takes a few µs), and made efa's
communication up to 1.8x slower (docs/performance.md).

``--chunk-rows KERNEL=ROWS,...``: the chunk rows of a kernel's sizes (every size of it, both backends), to weigh
the messages' size against the soft fabric's cost per message (``SIZES`` says what the defaults were chosen by).

``--ring-pointers``: ring attention loads its key blocks through pointers, not tensor descriptors (its default
since 2026-12-04, when ``--ring-tma`` turned them on); the row's dims say ``tma=0``.

``--group-m KERNEL=N,...``: a GEMM's tile order, N row blocks at a time (``_tiles.tile_at``; 1 is row-major),
to compare orders in one call; the row's dims then name it.

``--timeline RAW``: each GEMM+RS / GEMM+AR row also runs one launch of each of compute, comm and fused with
the op's timeline (``timeline=``, docs/kernels.md) and summarizes it per rank in the row (``timeline``: when
the peers' tiles and the own tiles ran, the own tiles' waits, when this rank's chunks shipped, its programs'
ends, in ms from the first tile's start over both ranks); each MoE Dispatch+GEMM row does the same with
``dispatch_gemm``'s (``moe_timeline_summary``: when each rank pushed its blocks, when the peer's blocks were
seen and how long after their push, how the expert tiles kept up with the arrivals; and
``gemm_span_fused_over_alone``, each rank's expert GEMM span fused over alone); ``RAW`` gets every
recorded event. ``--trace DIR`` (with ``--timeline``) also has every process stamp each message's steps through
the soft fabric during those launches (``SOFTVERBS_TRACE``; about a microsecond a step) and writes them per
launch to ``DIR/steps.json`` (``softverbs.soft.trace.steps``); a MoE Dispatch+GEMM row then also maps the GPU's
clock onto the trace's (``gpu_clock``: gpu_bench's ping-pong through mapped host memory, its error bound in the
JSON) and gives each rank's pushes and group landings in the same µs from the launch's start
(``timeline_on_trace``), so a group's way from the GPU's push through each daemon's steps reads in one line.
The transfers of
``comm`` are the kernel's own, driven from the GPU: a host-driven sequence through the daemon would add a
launch and a host round trip per step, so the baseline here is the kinder one. The first fused launch of
each row is checked against torch (``max_abs_error``).

MoE (``gpuclient.kernels.MoE``, DeepEP's low-latency shape: 128 tokens a rank, hidden 7168, top-8 of 64
experts, uniform routing): dispatch and combine latency (both ranks at once, median; each phase starts from
settled daemons: ``_settle``), each phase from calls and (bf16) from CUDA graph replays, one graph a rank and
phase (``dispatch_graph_s``, ``combine_graph_s``: a replay's few microseconds of host time in place of a call's,
as a framework that captures its MoE layer sees it; each round replays after its calls), and per dispatch
and destination the signals and fences the sending daemon posted (its counters), with decoupled signaling on and
off.

CUDA MPS is started here (as ``benchmarks/fabric_bench.py`` does) so the rail workers' copies share the
GPU with the kernels instead of waiting for time slices.

Tuning the tiles (``--tune``; ``--json`` gets the results, rewritten after every session)::

    python benchmarks/fused_bench.py --tune --json benchmarks/results/tune.json [--kernels ...] [--no-tma] [--quick]

times instead the compute alone (``communicate=False``) of each kernel at its first size, with the bench's
program counts, for each tile of ``TUNE_TILES`` (block, warps, stages and, for the GEMMs, operands through
tensor descriptors: ``tma``; MoE Dispatch+GEMM's expert GEMM over the rows of one staged round): one
session a kernel on the first backend and shape (the shape does not matter to the compute alone), the
peers' data staged where the compute reads it (so every launch is checked against torch), every rank's op
retiled and its variant preloaded before any launch (the ranks share this process), one checked warm-up
launch, then the median of ``--reps``. The GEMMs' TMA tiles run in sessions of
their own after every other (a fault there would take the CUDA context with it). Reported per config: median
ms, TFLOP/s, speedup over the op's default tile, torch's time over it, the error, the registers, spills and
shared memory of the compiled kernel, or why it did not run (refused by the op, out of resources, failed,
or skipped past ``--tune-seconds``); per kernel the best config and torch's time in the same run.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fabric_bench import SHAPES, SoftOptions  # noqa: E402
from benchmarks.fused_standing import judge  # noqa: E402
from gpuclient import exchange_all  # noqa: E402
from tests.support.cuda_graphs import capture_per_rank, replay_per_rank  # noqa: E402
from transportd.dataplane.gpu_memory import COPY_VIA as DIRECT_COPY_PLACEMENTS  # noqa: E402
from transportd_cli.cli_options import (  # noqa: E402
    FiniteFloat,
    gil_switch_us_option,
    io_spin_us_option,
    nic_spin_us_option,
    nic_streaming_option,
)

#: the NIC model each backend is shaped like by default
BACKEND_SHAPE = {"ib": "cx7-400g", "efa": "efa-200g"}
WORLD = 2

#: two sizes per kernel (H200, half the SMs a rank; the GEMMs' reductions move M x N whatever K is, so K sets the
#: balance). The GEMMs ship chunks of 512 rows (8 MiB at N 8192): the soft fabric pays a fixed cost per message, so
#: 2 MiB chunks made the reductions' communication 2.2-2.3x that of 8 MiB ones on ib and 1.5-1.6x on efa, and
#: AllGather+GEMM's 2.2x on ib (h200-2026-12-03-chunk-rows-{128,256,512}.json,
#: h200-2026-12-03-allgather-chunk-rows-512.json). At 8 MiB: AllGather+GEMM's comm / compute on ib is 0.8-1.3 at
#: both sizes; the reductions' comm was 2.7-3.1 ms (GEMM+RS) and 4.3-6.0 ms (GEMM+AR) on ib, so K 6144 and 12288
#: balance them (h200-2026-12-03-fused-bench-8mib-{1,2}.json: 0.5-0.75 at K 8192 and 16384, the second sizes);
#: ring attention's first is balanced, its second nearer the comm-bound side (below). The reductions run at M 32768
#: on ib: at 8192 the soft fabric's cost after the last tile (a chunk's trip, 0.5-0.6 ms) and its copies' drag on
#: the compute let GEMM+AR meet both targets in 1 of 3 rows and GEMM+RS in 0 of 3 in three calls; at 32768, where a
#: problem of the same balance outweighs them, in 2 of 3 and 3 of 3 (h200-2026-12-06-reductions-m-*.json,
#: fused_standing.py). The second Ks there keep comm / compute off the band's edge (0.5): GEMM+AR's is 8192, as
#: 16384 put it near 0.5, and GEMM+RS's 7168, as 8192 put it at 0.49 (h100-2026-12-06-reductions-ib-both-sizes-a.json)
SIZES: dict[str, list[dict[str, int]]] = {
    "allgather_gemm": [{"m_local": 4096, "n": 8192, "k": 8192, "chunk_rows": 512},
                       {"m_local": 2048, "n": 8192, "k": 4096, "chunk_rows": 512}],
    "gemm_reduce_scatter": [{"m": 32768, "n": 8192, "k": 6144, "chunk_rows": 512},
                            {"m": 32768, "n": 8192, "k": 7168, "chunk_rows": 512}],
    "gemm_all_reduce": [{"m": 32768, "n": 8192, "k": 12288, "chunk_rows": 512},
                        {"m": 32768, "n": 8192, "k": 8192, "chunk_rows": 512}],
    # chunks of 4 MiB (8192 K+V rows of 512 bytes, spanning heads): the soft fabric pays ~150 us a put, so
    # 128 KiB chunks made the communication 17-46x the compute. The second size was 4096 a rank, comm-bound (comm /
    # compute 1.8-1.9, even perfect overlap under 1.35x the sequential baseline); 6144 (compute x 0.56 of 8192's,
    # comm x 0.75) sits between
    "ring_attention": [{"heads": 32, "seq_local": 8192, "head_dim": 128, "chunk_rows": 8192},
                       {"heads": 32, "seq_local": 6144, "head_dim": 128, "chunk_rows": 8192}],
}
#: programs per rank of the ops whose programs spin on a peer's data at one program an SM (GEMM+RS/AR, MoE
#: Dispatch+GEMM's expert GEMM, and ring attention at its 128x128, 8-warp tiles): 66 + 66 fill the H200's 132 SMs
#: and the launch hangs until its spin bound traps, because the soft fabric places a GPU write with a
#: device-to-device copy that runs on SMs (benchmarks/copy_needs_sms.py: a 64 MiB copy does not complete while
#: spinning blocks hold every SM). 60 + 60 leave 12 SMs for those copies; against 48 it ran ring attention's
#: compute 1.26x faster in one call (h200-2026-12-02-fused-ring-attention-{48,60}-programs.json). A ConnectX needs none.
SPINNING_PROGRAMS = 60
QUICK_SIZES: dict[str, list[dict[str, int]]] = {
    "allgather_gemm": [{"m_local": 512, "n": 1024, "k": 1024, "chunk_rows": 64}],
    "gemm_reduce_scatter": [{"m": 1024, "n": 1024, "k": 1024, "chunk_rows": 64}],
    "gemm_all_reduce": [{"m": 1024, "n": 1024, "k": 1024, "chunk_rows": 64}],
    "ring_attention": [{"heads": 4, "seq_local": 512, "head_dim": 128, "chunk_rows": 128}],
}
#: MoE Dispatch+GEMM (``MoE.dispatch_gemm``): top-8 of 64 experts; an expert's weight H x gemm_n. The communication is
#: the dispatch's whatever gemm_n is, so gemm_n sets the balance (``--moe-gemm-n``). On an H100 with the soft fabric
#: of 2026-12-05 the dispatch of 128 tokens a rank took 1.8-2.0 ms on ib and 2.6-3.2 on efa, and the compute 5.6 ms
#: at 16384 (comm / compute 0.32-0.56: outside the 2x band) and 1.6 ms at 4096, so the first size is 4096. The
#: second is 1024 tokens a rank at 6144 (comm / compute 0.8-1.1), where an expert's own rows fill whole row blocks
#: that can run before the peer's rows land; every expert split by source (``split_experts``) fills the soft
#: fabric's ~1.3 ms to its first landing with them (overlap 0.77-0.86 on ib against 0.56-0.57 with the default 8,
#: three runs each, the fused launch no slower: docs/performance-log.md)
MOE_GEMM_SIZES = [{"tokens": 128, "hidden": 7168, "topk": 8, "experts": 64, "gemm_n": 4096},
                  {"tokens": 1024, "hidden": 7168, "topk": 8, "experts": 64, "gemm_n": 6144, "split_experts": 32}]
QUICK_MOE_GEMM_SIZES = [{"tokens": 32, "hidden": 512, "topk": 4, "experts": 8, "gemm_n": 512}]
MOE_SIZE_KEYS = tuple(dict.fromkeys(key for dims in MOE_GEMM_SIZES for key in dims))  # a row's size column
#: efa's sizes. Its model is half ib's rate and the receiving daemon, not the NIC, publishes each flag, so at ib's
#: second sizes its communication is 2-5x the compute. Both efa sizes keep the communication of ib's first (the
#: same shards, chunks, tokens) and grow only what the compute grows with (AllGather+GEMM's N, the reductions'
#: K; ring attention's sequence, whose compute grows with its square and its communication
#: linearly), so that the two stay within 2x of each other with the flags published by cuda-copy (``--publication``;
#: h200-2026-12-03-efa-publication-cuda-copy-both-sizes.json: comm / compute 1.16-1.74 at ib's first sizes, 0.49-0.84
#: at the grown ones). With 8 MiB chunks: AllGather+GEMM's N is ib's 8192 and 16384 (comm 6.4 ms against 8.9 of
#: compute at 16384; at 32768 the comm was 0.31x the compute); GEMM+RS's K is 12288 and 16384, GEMM+AR's 24576
#: and 32768 (at M 8192 comm 6.3 and 12.4 ms, against compute of 7.6 ms at RS's K 16384 and 15.6 ms at AR's K 32768;
#: at M 32768 on an H100, 13.6 and 32.4 ms against 25.4 and 50.9).
EFA_SIZES: dict[str, list[dict[str, int]]] = {
    "allgather_gemm": [SIZES["allgather_gemm"][0], {**SIZES["allgather_gemm"][0], "n": 16384}],
    # the reductions at ib's M 32768 too: at the first sizes both met in 4 of 4 calls there on an H100, against 6 of 9
    # and 4 of 8 at M 8192 on the H200 (h100-2026-12-06-reductions-efa-*.json)
    "gemm_reduce_scatter": [{**SIZES["gemm_reduce_scatter"][0], "k": 12288},
                            {**SIZES["gemm_reduce_scatter"][0], "k": 16384}],
    "gemm_all_reduce": [{**SIZES["gemm_all_reduce"][0], "k": 24576},
                        {**SIZES["gemm_all_reduce"][0], "k": 32768}],
    "ring_attention": [SIZES["ring_attention"][0], {**SIZES["ring_attention"][0], "seq_local": 16384}],
}
#: MoE Dispatch+GEMM's dispatch on efa now takes 1.4-1.7x ib's, within 2x of the compute at ib's sizes
EFA_MOE_GEMM_SIZES = MOE_GEMM_SIZES
KERNELS = tuple(SIZES)
SIZES_KEYS = tuple(dict.fromkeys(key for sizes in (*SIZES.values(), MOE_GEMM_SIZES) for dims in sizes
                                  for key in dims))


def backend_sizes(backend: str, quick: bool = False,
                  moe: dict[str, int] | None = None) -> dict[str, list[dict[str, int]]]:
    """The sizes a run measures on ``backend``, MoE Dispatch+GEMM's under ``moe_dispatch_gemm`` (``--quick``: the
    same small ones on every backend); ``moe`` sets keys of every MoE Dispatch+GEMM size (``--moe-tokens``:
    ``tokens``, ``--moe-experts``: ``experts``, ``--moe-gemm-n``: ``gemm_n``, ``--moe-experts-per-put``:
    ``experts_per_put``, ``--moe-split-experts``: ``split_experts``). A size that splits every local expert
    keeps splitting every one under another ``experts``."""
    if quick:
        sizes = {**QUICK_SIZES, "moe_dispatch_gemm": QUICK_MOE_GEMM_SIZES}
    elif backend == "efa":
        sizes = {**EFA_SIZES, "moe_dispatch_gemm": EFA_MOE_GEMM_SIZES}
    else:
        sizes = {**SIZES, "moe_dispatch_gemm": MOE_GEMM_SIZES}
    if moe:
        sizes["moe_dispatch_gemm"] = [_moe_size(dims, moe) for dims in sizes["moe_dispatch_gemm"]]
    return sizes


def _moe_size(dims: dict[str, int], moe: dict[str, int]) -> dict[str, int]:
    """``dims`` with ``moe``'s keys; a split of every local expert (``split_experts`` = experts / WORLD) follows a
    new expert count unless ``moe`` names the split itself."""
    out = {**dims, **moe}
    if "split_experts" in dims and "split_experts" not in moe and dims["split_experts"] == dims["experts"] // WORLD:
        out["split_experts"] = out["experts"] // WORLD
    return out


MOE = {"tokens": 128, "hidden": 7168, "topk": 8, "experts": 64}
QUICK_MOE = {"tokens": 32, "hidden": 1024, "topk": 4, "experts": 8}
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


def _time_once(launch: Callable[[], None], streams: list[Any]) -> float:
    """Seconds of one ``launch()`` (every rank's kernel, each on its stream) until the GPU is idle."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    launch()
    for s in streams:
        s.synchronize()
    return time.perf_counter() - t0


def _time(launch: Callable[[], None], streams: list[Any], reps: int) -> float:
    """Median seconds of ``reps`` launches (``_time_once``)."""
    return statistics.median(_time_once(launch, streams) for _ in range(reps))


def interleaved(launches: dict[str, Callable[[], float]], reps: int, clients: list[Any],
                counted: tuple[str, ...] = ("comm", "fused")
                ) -> tuple[dict[str, float], dict[str, list[Counter[str]]]]:
    """Each mode's median seconds over ``reps`` rounds, a round running every mode's launch once in turn (so a
    drift of the soft fabric or the GPU over the row weighs on every mode alike, where timing each mode's launches
    in a block left it to whichever mode ran then); and, for the ``counted`` modes, what each daemon counted
    (``_counters``) over their launches, read just before and after each one, outside its time (``per_launch``
    takes it). One untimed round first: a mode's first launch may compile its variant or initialize a library
    (cuBLAS), which a median of two would still carry."""
    for launch in launches.values():
        launch()
    samples: dict[str, list[float]] = {mode: [] for mode in launches}
    counted_by: dict[str, list[Counter[str]]] = {mode: [Counter() for _ in clients] for mode in counted}
    for _ in range(reps):
        for mode, launch in launches.items():
            if mode not in counted:
                samples[mode].append(launch())
                continue
            before = [_counters(c) for c in clients]
            samples[mode].append(launch())
            for total, b, a in zip(counted_by[mode], before, [_counters(c) for c in clients], strict=True):
                total.update({key: a[key] - b[key] for key in a})
    return {mode: statistics.median(v) for mode, v in samples.items()}, counted_by


@contextmanager
def _sessions(run: RunOptions, backend: str, shape: str, job: str, device: int,
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


def _randn(gen: Any, *shape: int, device: int) -> Any:
    import torch

    return torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda(device)


def _on_streams(streams: list[Any], work: Callable[[int], None]) -> None:
    import torch

    for r, s in enumerate(streams):
        with torch.cuda.stream(s):
            work(r)


# --- the cases ---------------------------------------------------------------------------------------------------
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
    shards = [_randn(gen, m_local, k, device=device) for _ in ops]
    bs = [_randn(gen, k, n, device=device) for _ in ops]
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
    a = [_randn(gen, m, k, device=device) for _ in ops]
    b = [_randn(gen, k, n, device=device) for _ in ops]
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
    q, k, v = ([_randn(gen, heads, seq_local, head_dim, device=device) for _ in ops] for _ in range(3))
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


def derive(row: dict[str, Any], flops: float, moved: int) -> dict[str, Any]:
    """Add to a row with ``comm_s``, ``compute_s``, ``fused_s`` and ``torch_s`` what is derived from them."""
    comm, compute, fused = row["comm_s"], row["compute_s"], row["fused_s"]
    row["unfused_s"] = comm + compute
    row["sequential_s"] = comm + row["torch_s"]
    row["overlap_efficiency"] = (comm + compute - fused) / min(comm, compute)
    row["speedup_vs_unfused"] = row["unfused_s"] / fused
    row["speedup_vs_sequential"] = row["sequential_s"] / fused
    # what a launch that hid the shorter of its parts entirely would gain over the sequential baseline
    row["sequential_ideal"] = row["sequential_s"] / max(comm, compute)
    row["comm_over_compute"] = comm / compute
    row["fused_tflops"] = flops / fused / 1e12
    row["comm_gbps"] = moved / comm / 1e9
    row.update(judge(row))  # in the band, and both targets met (fused_standing.py counts them over calls)
    return row


# --- timelines (``--timeline``) ------------------------------------------------------------------------------------
TIMELINE_MODES = {"compute": {"communicate": False}, "comm": {"compute": False}, "fused": {}}


def rs_timeline_events(layout: Any, programs: int, words: Any) -> dict[str, Any]:
    """One rank's GemmReduceScatter / GemmAllReduce timeline (``ReduceScatterLayout.timeline_words``), split:
    ``tiles`` (tiles x 4: start, computed, waited (own tiles; else 0), end) with each tile's ``step`` (0 ..
    world-1; world-1 is the own segment) and segment row ``band``; ``chunks`` (counters x 2: completed,
    shipped; 0: not shipped by this rank); ``program_ends``."""
    import numpy as np

    tiles, chunks, ends = layout.split_timeline(words, programs)
    order = np.array(layout.tile_order(), dtype=np.int64).reshape(-1, 3)
    return {"tiles": tiles, "step": order[:, 0], "band": order[:, 1],
            "chunks": chunks.reshape(-1, 2), "program_ends": ends}


def rs_timeline_summary(layout: Any, events: dict[str, Any], t0: int) -> dict[str, Any]:
    """Milliseconds from ``t0`` (the earliest start over the ranks) of what a launch's timeline says: when the
    peers' tiles and the own tiles started and were computed, how long the own tiles waited for the peers'
    chunks (summed over tiles, and the share of tiles that waited at all), when this rank's chunks completed and
    shipped, and when its programs ended (the last, and the median: a last program far past the median is the
    launch's tail, its final waits and quiet)."""
    import numpy as np

    def ms(x: Any) -> float:
        return round(float(x - t0) / 1e6, 4)

    tiles, own = events["tiles"], events["step"] == layout.world - 1
    out: dict[str, Any] = {"end_ms": ms(events["program_ends"].max()),
                           "median_end_ms": ms(np.median(events["program_ends"]))}
    for name, which in (("peer_tiles", ~own), ("own_tiles", own)):
        part = tiles[which]
        if len(part):
            out[name] = {"first_start_ms": ms(part[:, 0].min()), "last_computed_ms": ms(part[:, 1].max()),
                         "last_end_ms": ms(part[:, 3].max()),
                         "compute_us_median": round(float(np.median(part[:, 1] - part[:, 0])) / 1e3, 2)}
    waited = tiles[own & (tiles[:, 2] > 0)]
    if len(waited):
        stall = waited[:, 2] - waited[:, 1]
        out["own_waits"] = {"sum_ms": round(float(stall.sum()) / 1e6, 3), "max_ms": round(float(stall.max()) / 1e6, 3),
                            "share_over_10us": round(float((stall > 10_000).mean()), 3),
                            "last_satisfied_ms": ms(waited[:, 2].max())}
    shipped = events["chunks"][events["chunks"][:, 1] > 0]
    if len(shipped):
        out["chunks"] = {"count": len(shipped), "first_shipped_ms": ms(shipped[:, 1].min()),
                         "last_shipped_ms": ms(shipped[:, 1].max()),
                         "gate_wait_ms_max": round(float((shipped[:, 1] - shipped[:, 0]).max()) / 1e6, 3),
                         "shipped_ms": [ms(x) for x in np.sort(shipped[:, 1])]}
    return out


def _trace_start(label: str) -> int | None:
    """``--trace``: every process's softverbs stamps from here to ``_trace_done`` are the cycle ``label``; returns
    the cycle's start on the trace's clock (``time.monotonic_ns``), None when not tracing."""
    from softverbs import _trace

    if not _trace.DIR:
        return None
    start = time.monotonic_ns()
    _trace.stamp(f"start {label}")
    return start


def gpu_clock(device: int) -> dict[str, float]:
    """How the GPU's ``%globaltimer`` (the timelines' clock) maps onto the soft fabric trace's
    (``time.monotonic_ns``): gpu_bench's ping-pong through mapped host memory (``offset_ns``: GPU minus host;
    ``error_bound_ns``: half the tightest round trip)."""
    from benchmarks.gpu_bench import Gpu, calibrate

    return calibrate(Gpu(device))


def on_trace_us(gpu_ns: Any, clock: dict[str, float], start_ns: int) -> list:
    """GPU timeline words (%globaltimer ns, 0: no event) as µs from a traced cycle's start on the trace's clock,
    the shape kept, None where no event."""
    import numpy as np

    words = np.asarray(gpu_ns, dtype=np.int64)
    us = np.round((words - int(clock["offset_ns"]) - start_ns) / 1e3, 1).astype(object)
    us[words <= 0] = None
    return us.tolist()


def _trace_done() -> None:
    from softverbs import _trace

    if _trace.DIR:
        _trace.stamp("done")


def timeline_runs(case: Case, streams: list[Any], label: str = "") -> dict[str, Any]:
    """One launch of each of compute, comm and fused with every rank's timeline (after a plain launch of each, so
    the variants' first runs are not the ones read): per mode, each rank's summary and the raw words. With
    ``--trace``, each launch is a traced cycle ``label:mode``."""
    import torch

    ops = case.ops
    for op in ops:
        for kw in TIMELINE_MODES.values():
            op.preload(timeline=True, **kw)
    out: dict[str, Any] = {}
    for mode, kw in TIMELINE_MODES.items():
        timelines = [op.timeline() for op in ops]
        torch.cuda.synchronize()
        _trace_start(f"{label}:{mode}")
        case.launch(timelines=timelines, **kw)
        torch.cuda.synchronize()
        _trace_done()
        words = [tl.cpu().numpy() for tl in timelines]
        events = [rs_timeline_events(op.layout, op.programs, w) for op, w in zip(ops, words, strict=True)]
        t0 = min(int(e["tiles"][:, 0][e["tiles"][:, 0] > 0].min()) for e in events)
        out[mode] = {"ranks": [rs_timeline_summary(op.layout, e, t0) for op, e in zip(ops, events, strict=True)],
                     "raw": [w.tolist() for w in words]}
    return out


def moe_timeline_summary(lay: Any, events: list[dict[str, Any]], rank: int, t0: int) -> dict[str, Any]:
    """Milliseconds from ``t0`` (the earliest event over the ranks) of what rank ``rank``'s ``dispatch_gemm``
    timeline says, beside its peers' (``events``: every rank's ``MoELayout.split_timeline``, one GPU clock for
    all): when it pushed its blocks; when its compute programs saw each peer's block arrive, and how long after
    the peer pushed it (``latency_us``: the transfer through the daemons, flag included); when its tiles ran,
    how long an expert's tiles took once its rows were in (``expert_us_median``), and how much of the compute
    came after the last arrival (``after_last_ready_ms``, and the (source, expert) groups still computing
    then: a backlog, where the compute could not keep up with the arrivals), and ``span_ms`` from its first tile's
    start to its last tile's end (the waits for rows inside it, in a fused launch); when the peers' groups landed
    (``landed``: seen by a communication program, apart from when the compute programs got to them); its
    programs' ends."""
    import numpy as np

    def ms(x: Any) -> float:
        return round(float(x - t0) / 1e6, 4)

    me = events[rank]
    peers = np.arange(lay.world) != rank
    out: dict[str, Any] = {"end_ms": ms(me["program_ends"].max()),
                           "median_end_ms": ms(np.median(me["program_ends"]))}
    sent = me["sent"][peers]
    if (sent > 0).any():
        out["sent"] = {"first_ms": ms(sent[sent > 0].min()), "last_ms": ms(sent.max()), "count": int((sent > 0).sum())}
    ready = me["ready"]
    pushed = np.stack([events[s]["sent"][rank] for s in range(lay.world)])  # [source, local]: when s pushed it
    landed = (me["arrived"] > 0) & (pushed > 0)
    if landed.any():  # when the groups landed, whether or not a compute program was there yet
        out["landed"] = {"first_ms": ms(me["arrived"][landed].min()), "last_ms": ms(me["arrived"][landed].max()),
                         "latency_us_median": round(float(np.median(me["arrived"][landed] - pushed[landed])) / 1e3, 1)}
    seen = (ready > 0) & (pushed > 0)
    if seen.any():
        latency = (ready[seen] - pushed[seen]) / 1e3
        out["arrivals"] = {"count": int(seen.sum()), "first_ready_ms": ms(ready[seen].min()),
                           "last_ready_ms": ms(ready[seen].max()),
                           "latency_us": {"median": round(float(np.median(latency)), 1),
                                          "max": round(float(latency.max()), 1)}}
    done, start = me["done"], me["start"]
    if (done > 0).any():
        began = np.maximum(start, ready)  # an expert's tiles from when its rows were in
        ran = done > 0
        out["compute"] = {"first_start_ms": ms(start[ran].min()), "last_done_ms": ms(done.max()),
                          "span_ms": round(float(done.max() - start[ran].min()) / 1e6, 4),
                          "expert_us_median": round(float(np.median(done[ran] - began[ran])) / 1e3, 1)}
        if seen.any():
            last_ready = ready[seen].max()
            out["compute"]["after_last_ready_ms"] = round(float(done.max() - last_ready) / 1e6, 4)
            out["compute"]["groups_after_last_ready"] = int((done > last_ready).sum())
    return out


def gemm_span_ratio(timeline: dict[str, list[dict[str, Any]]]) -> list[float | None]:
    """Per rank, the expert GEMM's span in the fused launch over its span alone (``compute.span_ms`` of the
    ``fused`` and ``compute`` modes' summaries): 1.0 when the transfers cost the GEMM nothing but its waits for
    rows; None where a mode ran no tile."""
    def span(mode: str, rank: int) -> float | None:
        return timeline[mode][rank].get("compute", {}).get("span_ms")

    ratios: list[float | None] = []
    for rank in range(len(timeline["fused"])):
        fused, alone = span("fused", rank), span("compute", rank)
        ratios.append(round(fused / alone, 3) if fused and alone else None)
    return ratios


def moe_timeline_runs(moe: Any, label: str = "moe_dispatch_gemm") -> dict[str, Any]:
    """One round of each of compute, comm and fused with every rank's ``dispatch_gemm`` timeline (every timeline
    variant loaded first: the ranks share this process; the rounds timed before ran each mode already): per mode,
    each rank's summary (``moe_timeline_summary``) and the raw words. With ``--trace``, each round is a traced
    cycle ``label:mode``, and its ``on_trace`` gives each rank's pushes and landings (``sent``, ``arrived``:
    ``MoELayout.split_timeline``) as µs from the cycle's start on the trace's clock (``gpu_clock``), beside the
    soft fabric's steps of the same launch in ``steps.json``."""
    import torch

    from softverbs import _trace

    for kw in TIMELINE_MODES.values():
        for op in moe.ops:
            op.preload_gemm(timeline=True, **kw)
    clock = gpu_clock(moe.ops[0].device) if _trace.DIR else None
    out: dict[str, Any] = {}
    for mode, kw in TIMELINE_MODES.items():
        timelines = [op.gemm_timeline() for op in moe.ops]
        torch.cuda.synchronize()
        start = _trace_start(f"{label}:{mode}")
        moe.round(timelines=timelines, **kw)
        words = [t.cpu().numpy() for t in timelines]
        events = [op.layout.split_timeline(w, op.gemm_programs) for op, w in zip(moe.ops, words, strict=True)]
        firsts = [e[name][e[name] > 0].min() for e in events for name in ("sent", "start") if (e[name] > 0).any()]
        t0 = int(min(firsts))
        out[mode] = {"ranks": [moe_timeline_summary(op.layout, events, r, t0) for r, op in enumerate(moe.ops)],
                     "raw": [w.tolist() for w in words]}
        if clock is not None and start is not None:
            out[mode]["on_trace"] = {"clock": clock, "ranks": [
                {name: on_trace_us(e[name], clock, start) for name in ("sent", "arrived")} for e in events]}
    return out


#: per launch and daemon, from ``_counters``: (counter, row column, scale): the time its soft devices spent placing
#: direct copies (each blocks their thread), its workers spent in flag loopback writes (efa without GDRCopy), its
#: NIC model's link was busy, and the flag words its workers copied into GPU memory (efa, cuda-copy)
PER_LAUNCH = (("direct_ns", "direct_copy_ms", 1e-6), ("loopback_ns", "loopback_wait_ms", 1e-6),
              ("link_busy_ns", "link_busy_ms", 1e-6), ("flag_copies", "flag_copies", 1.0))


def per_launch(row: dict[str, Any], counted_by: dict[str, list[Counter[str]]], reps: int) -> None:
    """``row[f"{mode}_{column}"]``: what each daemon counted over a mode's ``reps`` launches (``interleaved``), per
    launch, for every ``PER_LAUNCH`` column."""
    for key, name, scale in PER_LAUNCH:
        for mode, daemons in counted_by.items():
            row[f"{mode}_{name}"] = [round(counted[key] / reps * scale, 3) for counted in daemons]


def fused_row(kernel: str, backend: str, shape: str, dims: dict[str, int], reps: int, device: int = 0,
              echo: Callable[[str], None] = print, timeline: bool = False,
              run: RunOptions = RunOptions()) -> dict[str, Any]:
    """One row: compute, comm, fused and torch times of ``kernel`` at ``dims`` on ``backend`` shaped as ``shape``,
    run as ``run`` says."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(5)
    with _sessions(run, backend, shape, f"fused-bench-{kernel}", device) as (clients, sessions):
        streams = [torch.cuda.Stream(device) for _ in sessions]
        case = CASES[kernel](sessions, streams, gen, device, programs=run.programs, **dims)
        case.launch()  # the first fused launch, checked
        torch.cuda.synchronize()
        row: dict[str, Any] = {"kernel": kernel, "backend": backend, "shape": shape, "nic": SHAPES.get(shape, {}),
                               "world": WORLD, **dims, **case.params, "max_abs_error": case.error()}
        seconds, counted_by = interleaved({
            "compute": lambda: _time_once(lambda: case.launch(communicate=False), streams),
            "comm": lambda: _time_once(lambda: case.launch(compute=False), streams),
            "fused": lambda: _time_once(case.launch, streams),
            "torch": lambda: _time_once(case.torch_compute, streams)}, reps, clients)
        row.update({f"{mode}_s": t for mode, t in seconds.items()})
        per_launch(row, counted_by, reps)
        if timeline and case.timelines:
            runs = timeline_runs(case, streams, f"{kernel}:{backend}:{_dims(dims)}")
            row["timeline"] = {mode: run["ranks"] for mode, run in runs.items()}
            row["timeline_raw"] = {mode: run["raw"] for mode, run in runs.items()}  # main moves it to its own file
        _check_channels(case.ops)
    derive(row, case.flops, case.moved)
    echo(_summary(row, dims))
    return row


def _dims(dims: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in dims.items() if k != "chunk_rows")


def _summary(row: dict[str, Any], dims: dict[str, int]) -> str:
    """One printed line of a timed row (``derive`` done)."""
    return (f"  {row['kernel']:20s} {row['backend']} {row['shape']:9s} {_dims(dims):28s} "
            f"compute {row['compute_s'] * 1e3:7.3f}  comm {row['comm_s'] * 1e3:7.3f}  fused {row['fused_s'] * 1e3:7.3f}"
            f"  torch {row['torch_s'] * 1e3:7.3f} ms  overlap {row['overlap_efficiency']:.2f}"
            f"  vs sequential {row['speedup_vs_sequential']:.2f}x"
            f"  {_VERDICT[row['meets_targets']]}")


_VERDICT = {True: "meets both", False: "misses", None: "outside the band"}


def _check_channels(ops: list[Any]) -> None:
    """Raise if any rank's channel reports an error (the row's numbers would be of a broken run)."""
    for op in ops:
        status = op.channel.status()
        if status[0] != 0:
            raise RuntimeError(f"channel error {status}")


# --- MoE ---------------------------------------------------------------------------------------------------------
_COUNTED = ("commands", "wrs", "writes", "signals", "signals_requested", "fences", "direct_placed")


def _counters(client: Any) -> dict[str, int]:
    """A daemon's rails' counters, the writes its soft devices placed by direct copy (``direct_placed``: the
    rest of what they received crossed TCP), the nanoseconds they spent placing them (``direct_ns``), those its
    workers spent in flag loopback writes (``loopback_ns``), those its NIC model's links were busy
    (``link_busy_ns``) and the flag words its workers copied into GPU memory (``flag_copies``)."""
    rails = [r for r in client.stats().get("rails", []) if "error" not in r]
    out = {key: sum(int(r.get(key, 0)) for r in rails) for key in _COUNTED}
    for key in ("direct_placed", "direct_ns"):
        out[key] = sum(int((r.get("softverbs") or {}).get(key, 0)) for r in rails)
    out["loopback_ns"] = sum(int((r.get("flag_loopback") or {}).get("wait_ns", 0)) for r in rails)
    out["flag_copies"] = sum(int(r.get("flag_copies", 0)) for r in rails)
    out["link_busy_ns"] = sum(int(1e9 * ((r.get("softverbs") or {}).get("link") or {}).get("busy_s", 0.0))
                              for r in rails)
    return out


def _settle(clients: list[Any], timeout: float = 30.0) -> None:
    """Wait until no rail of any daemon has a record in a ring, a record taken and not complete, a work request
    in flight or a record waiting for its batch, so that a timed phase does not pay for what the phase before it
    left the daemons to finish (and both row types start each phase from the same state: fp8's untimed
    dequantization is a pause bf16 has not)."""
    def rings(rail: dict[str, Any]) -> list[tuple[int, int]]:
        return [(ring["depth"], ring["outstanding"]) for ring in rail.get("queues", {}).get("rings", [])]

    def busy(rail: dict[str, Any]) -> bool:
        return bool(rail.get("inflight") or rail.get("pending_rows") or any(any(ring) for ring in rings(rail)))

    deadline = time.monotonic() + timeout
    while True:
        rails = [r for c in clients for r in c.stats().get("rails", []) if "error" not in r]
        if not any(busy(r) for r in rails):
            return
        if time.monotonic() >= deadline:
            left = [{"inflight": r.get("inflight"), "pending_rows": r.get("pending_rows"), "rings": rings(r)}
                    for r in rails if busy(r)]
            raise TimeoutError(f"the daemons did not settle in {timeout} s: {left}")


def moe_row(backend: str, shape: str, decoupled: bool, reps: int, tokens: int, hidden: int, topk: int, experts: int,
            device: int = 0, echo: Callable[[str], None] = print, fp8: bool = False,
            run: RunOptions = RunOptions()) -> dict[str, Any]:
    """Dispatch and combine latency (both ranks at once) and what the sending daemons posted per dispatch;
    ``fp8``: the rows go as e4m3 with a scale per 128 values, and combine takes them dequantized (untimed). Each
    phase starts once the daemons have settled (``_settle``) and the counters are read outside the timed
    windows."""
    import torch

    from gpuclient.kernels import MoE

    config = {"signal": {"decoupled": True}} if decoupled else None
    gen = torch.Generator(device="cpu").manual_seed(7)
    with _sessions(run, backend, shape, "fused-bench-moe", device, config) as (clients, sessions):
        ops = [MoE(s, hidden, experts, tokens, topk, share=WORLD, fp8=fp8) for s in sessions]
        exchange_all(sessions, timeout=60)
        for op in ops:
            op.prepare()
        streams = [torch.cuda.Stream(device) for _ in ops]
        xs = [_randn(gen, tokens, hidden, device=device) for _ in ops]
        idx = [torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).cuda(device)
               for _ in ops]
        weights = [torch.rand(tokens, topk, generator=gen).cuda(device) for _ in ops]
        torch.cuda.synchronize()
        dispatch_s, combine_s = [], []
        graph_s: tuple[list[float], list[float]] = ([], [])
        graphs: tuple[list[Any], list[Any]] | None = None
        posted = {"dispatch": dict.fromkeys(_COUNTED, 0), "combine": dict.fromkeys(_COUNTED, 0)}

        def combine_error() -> float:  # with y = x and weights summing per token, combine returns sum_k w_k * x
            expect = xs[0].float() * weights[0].sum(dim=1, keepdim=True)
            return float((ops[0].out[:tokens].float() - expect).abs().max())

        errors = []  # the last round's, from its calls and from its graphs
        for i in range(reps + 1):  # round 0 warms up; its counts and times are dropped
            _settle(clients)
            before = [_counters(c) for c in clients]
            t0 = time.perf_counter()
            handles = [op.dispatch(xs[r], idx[r], weights[r], stream=streams[r]) for r, op in enumerate(ops)]
            for s in streams:
                s.synchronize()
            t1 = time.perf_counter()
            ys = [_dequantized(h[0]) if fp8 else h[0] for h in handles]  # the identity expert: y = x
            torch.cuda.synchronize()
            _settle(clients)
            mid = [_counters(c) for c in clients]
            t2 = time.perf_counter()
            for r, op in enumerate(ops):
                op.combine(ys[r], handles[r][2], stream=streams[r])
            for s in streams:
                s.synchronize()
            t3 = time.perf_counter()
            if i == reps:
                errors.append(combine_error())
            _settle(clients)
            after = [_counters(c) for c in clients]
            if i > 0:
                dispatch_s.append(t1 - t0)
                combine_s.append(t3 - t2)
                for key in _COUNTED:
                    posted["dispatch"][key] += sum(m[key] - b[key] for b, m in zip(before, mid, strict=True))
                    posted["combine"][key] += sum(a[key] - m[key] for m, a in zip(mid, after, strict=True))
            # the same round replayed from CUDA graphs, captured after the warm-up's calls (bf16: fp8's
            # dequantization runs between the phases); in the same round, so a drift weighs on both alike
            if not fp8:
                graphs = graphs or _moe_graphs(ops, streams, xs, idx, weights)
                for phase, samples in zip(graphs, graph_s, strict=True):
                    seconds = _replayed(phase, streams, clients)
                    if i > 0:
                        samples.append(seconds)
        if graphs:
            errors.append(combine_error())
        error = max(errors)
        _check_channels(ops)
    rounds = len(dispatch_s)
    per = WORLD * (WORLD - 1) * rounds  # (sender, destination) pairs over the counted rounds
    row: dict[str, Any] = {"kernel": "moe", "backend": backend, "shape": shape, "nic": SHAPES.get(shape, {}),
                           "decoupled": decoupled, "fp8": fp8, "world": WORLD, "tokens": tokens, "hidden": hidden,
                           "topk": topk,
                           "experts": experts, "rounds": rounds, "max_abs_error": error,
                           "dispatch_s": statistics.median(dispatch_s), "combine_s": statistics.median(combine_s),
                           "dispatch_graph_s": statistics.median(graph_s[0]) if graph_s[0] else None,
                           "combine_graph_s": statistics.median(graph_s[1]) if graph_s[1] else None}
    for phase, counts in posted.items():
        for key in ("signals", "signals_requested", "fences", "writes", "direct_placed"):
            row[f"{phase}_{key}_per_dest"] = counts[key] / per
    echo(f"  moe {backend} {shape:9s} decoupled={'on ' if decoupled else 'off'}{' fp8' if fp8 else ''} "
         f"dispatch {row['dispatch_s'] * 1e6:8.1f} us  combine {row['combine_s'] * 1e6:8.1f} us  "
         f"{_graph_us(row)}"
         f"per dispatch and destination: signals "
         f"{row['dispatch_signals_per_dest']:.2f} (requested {row['dispatch_signals_requested_per_dest']:.2f}), "
         f"fences {row['dispatch_fences_per_dest']:.2f}, writes {row['dispatch_writes_per_dest']:.1f} "
         f"({row['dispatch_direct_placed_per_dest']:.1f} placed by direct copy)")
    return row


def _moe_graphs(ops: list[Any], streams: list[Any], xs: list[Any], idx: list[Any],
                weights: list[Any]) -> tuple[list[Any], list[Any]]:
    """``moe_row``'s round captured: a graph per rank of its dispatch, and one of its combine (the identity expert:
    the received rows combined as they are)."""
    dispatches, handles = capture_per_rank(streams, lambda r: ops[r].dispatch(xs[r], idx[r], weights[r]))
    combines, _ = capture_per_rank(streams, lambda r: ops[r].combine(handles[r][0], handles[r][2]))
    return dispatches, combines


def _replayed(graphs: list[Any], streams: list[Any], clients: list[Any]) -> float:
    """Seconds of one phase replayed, every rank's graph on its stream at once, from settled daemons (a replay's
    ~4 us of host time in place of a call's)."""
    _settle(clients)
    start = time.perf_counter()
    replay_per_rank(graphs, streams)
    for stream in streams:
        stream.synchronize()
    return time.perf_counter() - start


def _graph_us(row: dict[str, Any]) -> str:
    """A MoE row's graph-replayed latencies, for the echo ("" where it has none)."""
    if row.get("dispatch_graph_s") is None:
        return ""
    return f"graphs: dispatch {row['dispatch_graph_s'] * 1e6:8.1f} us  combine {row['combine_graph_s'] * 1e6:8.1f} us  "


def _graph_cell(row: dict[str, Any]) -> str:
    if row.get("dispatch_graph_s") is None:
        return "—"
    return f"{row['dispatch_graph_s'] * 1e6:.1f} / {row['combine_graph_s'] * 1e6:.1f}"


def _dequantized(received: tuple[Any, Any]) -> Any:
    """bf16 rows from fp8 dispatch's (values, scales per 128)."""
    import torch

    q, scales = received
    return (q.float().unflatten(-1, (-1, 128)) * scales[..., None]).flatten(-2).to(torch.bfloat16)


class _MoeGemm:
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
        self.xs = [_randn(gen, tokens, hidden, device=device) for _ in ops]
        self.idx = [torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).cuda(device)
                    for _ in ops]
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
            _trace_done()  # the traced cycle (--trace) is the launch, not the combine after it
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
    moe = _MoeGemm(sessions, device, gen, tokens, hidden, topk, experts, gemm_n, streams, experts_per_put,
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


def moe_gemm_work(layouts: list[Any], counts_all: list[Any], block_m: int, split_experts: int) -> dict[str, float]:
    """What the expert GEMM's deal costs at a round's counts (each rank's ``MoELayout`` and ``counts_all``;
    ``MoELayout.gemm_work``), over the ranks: ``weight_passes``, the times each local expert with rows has its
    weights streamed (1.0: once; a split expert's once per source step), and ``row_block_fill``, the received
    rows over the rows its row blocks span (the tensor cores' work that is not padding)."""
    passes = experts = rows = spanned = 0
    for lay, counts in zip(layouts, counts_all, strict=True):
        p, span = lay.gemm_work(counts, block_m, split_experts)
        recv, _ = lay.receive(counts)
        passes, spanned = passes + p, spanned + span
        experts, rows = experts + int((recv > 0).sum()), rows + int(recv.sum())
    return {"weight_passes": round(passes / max(experts, 1), 3), "row_block_fill": round(rows / max(spanned, 1), 3)}


def moe_gemm_row(backend: str, shape: str, dims: dict[str, int], reps: int, device: int = 0,
                 echo: Callable[[str], None] = print, timeline: bool = False,
                 run: RunOptions = RunOptions()) -> dict[str, Any]:
    """MoE Dispatch+GEMM (``MoE.dispatch_gemm``): compute, comm, fused and torch times like ``fused_row``.
    Every round with communication is followed by a ``combine`` (untimed): a round must close before the next.
    ``timeline``: then one round of each mode with every rank's timeline (``moe_timeline_runs``)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(9)
    with _sessions(run, backend, shape, "fused-bench-moe-gemm", device) as (clients, sessions):
        moe = _MoeGemm(sessions, device, gen, programs=run.programs, **dims)
        ops, streams = moe.ops, moe.streams
        hidden, gemm_n = dims["hidden"], dims["gemm_n"]
        launch = moe.round
        launch()  # the first fused round, checked below (its combine ran; y and recv_x stay until the next round)
        torch.cuda.synchronize()
        counts = moe.counts()
        error = moe.error()
        layouts = [op.recv_layout.cpu() for op in ops]
        remote_rows = sum(int(layouts[r][:, w, 1].sum()) for r in range(WORLD) for w in range(WORLD) if w != r)
        rows = sum(sum(c) for c in counts)

        row: dict[str, Any] = {"kernel": "moe_dispatch_gemm", "backend": backend, "shape": shape,
                               "nic": SHAPES.get(shape, {}), "world": WORLD, **dims, "rows": rows,
                               "programs": ops[0].gemm_programs, "comm_programs": ops[0].comm_programs,
                               "experts_per_put": ops[0].layout.experts_per_put,
                               "split_experts": ops[0].split_experts, "max_abs_error": error,
                               **moe_gemm_work([op.layout for op in ops], [op.counts_all.cpu().numpy() for op in ops],
                                               ops[0].gemm_block[0], ops[0].split_experts)}
        seconds, counted_by = interleaved({
            "compute": lambda: launch(communicate=False), "comm": lambda: launch(compute=False), "fused": launch,
            "torch": lambda: _time_once(moe.torch_compute, streams)}, reps, clients)
        row.update({f"{mode}_s": t for mode, t in seconds.items()})
        per_launch(row, counted_by, reps)
        if timeline:
            runs = moe_timeline_runs(moe, f"moe_dispatch_gemm:{backend}:{_dims(dims)}")
            row["timeline"] = {mode: run["ranks"] for mode, run in runs.items()}
            row["gemm_span_fused_over_alone"] = gemm_span_ratio(row["timeline"])
            row["timeline_raw"] = {mode: run["raw"] for mode, run in runs.items()}  # main moves it to its own file
            if any("on_trace" in run for run in runs.values()):
                row["timeline_on_trace"] = {mode: run.get("on_trace") for mode, run in runs.items()}
        _check_channels(ops)
    derive(row, 2.0 * rows * hidden * gemm_n, remote_rows * hidden * 2)
    echo(_summary(row, dims))
    return row


# --- report ------------------------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| kernel | backend | NIC model | size | compute ms | comm ms | fused ms | torch ms | "
             "overlap efficiency | vs unfused | vs sequential (comm + torch) | ideal | comm/compute |",
             "|" + "---|" * 13]
    for r in rows:
        if r.get("kernel") == "moe":
            continue
        keys = MOE_SIZE_KEYS if r.get("kernel") == "moe_dispatch_gemm" else SIZES.get(r.get("kernel", ""), [{}])[0]
        size = _dims({k: r[k] for k in keys if k in r})
        if "error" in r:
            lines.append(f"| {r.get('kernel')} | {r['backend']} | {r['shape']} | {size} | failed: {r['error']} |")
            continue
        lines.append(f"| {r['kernel']} | {r['backend']} | {r['shape']} | {size} | {r['compute_s'] * 1e3:.3f} | "
                     f"{r['comm_s'] * 1e3:.3f} | {r['fused_s'] * 1e3:.3f} | {r['torch_s'] * 1e3:.3f} | "
                     f"{r['overlap_efficiency']:.2f} | {r['speedup_vs_unfused']:.2f}x | "
                     f"{r['speedup_vs_sequential']:.2f}x | {r['sequential_ideal']:.2f}x | "
                     f"{r['comm_over_compute']:.2f} |")
    moe = [r for r in rows if r.get("kernel") == "moe"]
    if moe:
        lines += ["", "| MoE | backend | NIC model | decoupled | rows | dispatch us | combine us | from graphs: "
                  "dispatch / combine us | signals / dest / dispatch (requested) | fences / dest / dispatch | "
                  "writes / dest / dispatch |", "|" + "---|" * 11]
        for r in moe:
            if "error" in r:
                lines.append(f"| moe | {r['backend']} | {r['shape']} | {r.get('decoupled')} | failed: {r['error']} |")
                continue
            lines.append(f"| {r['tokens']} tok, H {r['hidden']}, top-{r['topk']} of {r['experts']} | {r['backend']} | "
                         f"{r['shape']} | {'on' if r['decoupled'] else 'off'} | {'fp8' if r.get('fp8') else 'bf16'} | "
                         f"{r['dispatch_s'] * 1e6:.1f} | "
                         f"{r['combine_s'] * 1e6:.1f} | {_graph_cell(r)} | {r['dispatch_signals_per_dest']:.2f} "
                         f"({r['dispatch_signals_requested_per_dest']:.2f}) | {r['dispatch_fences_per_dest']:.2f} | "
                         f"{r['dispatch_writes_per_dest']:.1f} |")
    return "\n".join(lines)


# --- tuning (--tune) ------------------------------------------------------------------------------------------
#: the tiles each kernel's compute is timed with in ``--tune``, the ops' untuned first choice first (the row
#: "default" and "vs default" name: the baseline the tuning is measured against; the ops now default to the
#: winners, ``_tiles.GEMM_BLOCK`` with TMA and ``ring_attention.ATTENTION_BLOCK``). The GEMMs' grid: the
#: 128x128x64 first choice beside the tile shapes and depths Hopper GEMMs usually settle on, and operands
#: through tensor descriptors (TMA) at three of them, and the last in grouped tile orders (``group_m``; a tile
#: without one is timed row-major); ring attention: block_m x block_n around 64x64, its 8-warp tiles at 3 stages
#: (4 do not fit 128 x 128 in shared memory), and the op's default tile through descriptors (``tma``; the others
#: are timed with pointer loads).
GEMM_TILES: list[dict[str, Any]] = [
    {"block": (128, 128, 64), "num_warps": 8, "num_stages": 3, "tma": False},
    {"block": (128, 128, 64), "num_warps": 4, "num_stages": 4, "tma": False},
    {"block": (128, 256, 64), "num_warps": 8, "num_stages": 3, "tma": False},
    {"block": (256, 128, 64), "num_warps": 8, "num_stages": 3, "tma": False},
    {"block": (128, 128, 128), "num_warps": 8, "num_stages": 2, "tma": False},
    {"block": (64, 256, 64), "num_warps": 4, "num_stages": 4, "tma": False},
    {"block": (128, 128, 64), "num_warps": 8, "num_stages": 3, "tma": True},
    {"block": (128, 128, 64), "num_warps": 8, "num_stages": 4, "tma": True},
    {"block": (128, 256, 64), "num_warps": 8, "num_stages": 3, "tma": True},
    {"block": (128, 256, 64), "num_warps": 8, "num_stages": 3, "tma": True, "group_m": 4},
    {"block": (128, 256, 64), "num_warps": 8, "num_stages": 3, "tma": True, "group_m": 8},
    {"block": (128, 256, 64), "num_warps": 8, "num_stages": 3, "tma": True, "group_m": 16},
]
RING_TILES: list[dict[str, Any]] = [
    {"block": (64, 64), "num_warps": 4, "num_stages": 2},
    {"block": (64, 64), "num_warps": 4, "num_stages": 3},
    {"block": (128, 64), "num_warps": 4, "num_stages": 2},
    {"block": (128, 64), "num_warps": 8, "num_stages": 2},
    {"block": (128, 128), "num_warps": 8, "num_stages": 2},
    {"block": (64, 128), "num_warps": 4, "num_stages": 2},
    {"block": (128, 64), "num_warps": 8, "num_stages": 3},
    {"block": (128, 128), "num_warps": 8, "num_stages": 3},
    {"block": (128, 128), "num_warps": 8, "num_stages": 3, "tma": True},
]
#: MoE Dispatch+GEMM's expert GEMM: a few rows an expert (128 tokens x top-8 over 64 experts: ~32 a rank's
#: expert) against a wide weight, so it streams the weights: narrower row blocks, wider column blocks, deeper
#: pipelines around the op's default, first (64x128x64, 4 warps, 6 stages: 5 won the first two runs, where 3
#: stages, the first choice, was 1.39x slower; 6 won on average once the tile deal rotated, 2026-12-04); the
#: 128-row tiles last, for more rows an expert (--moe-experts): the op's default from 128 rows on
MOE_GEMM_TILES: list[dict[str, Any]] = [
    {"block": (64, 128, 64), "num_warps": 4, "num_stages": 6},
    {"block": (64, 128, 64), "num_warps": 4, "num_stages": 5},
    {"block": (64, 128, 64), "num_warps": 4, "num_stages": 3},
    {"block": (64, 128, 64), "num_warps": 4, "num_stages": 4},
    {"block": (64, 128, 64), "num_warps": 8, "num_stages": 4},
    {"block": (64, 128, 128), "num_warps": 4, "num_stages": 4},
    {"block": (64, 64, 128), "num_warps": 4, "num_stages": 4},
    {"block": (64, 256, 64), "num_warps": 4, "num_stages": 3},
    {"block": (64, 256, 64), "num_warps": 8, "num_stages": 3},
    {"block": (32, 256, 64), "num_warps": 4, "num_stages": 4},
    {"block": (64, 128, 128), "num_warps": 4, "num_stages": 3},
    {"block": (32, 128, 128), "num_warps": 4, "num_stages": 4},
    {"block": (64, 256, 128), "num_warps": 8, "num_stages": 2},
    {"block": (32, 256, 128), "num_warps": 8, "num_stages": 3},
    # more rows an expert (fewer experts, --moe-experts): the wider row blocks a dense GEMM takes
    {"block": (128, 128, 64), "num_warps": 4, "num_stages": 4},
    {"block": (128, 128, 64), "num_warps": 8, "num_stages": 4},
    {"block": (128, 256, 64), "num_warps": 8, "num_stages": 3},
    {"block": (128, 128, 128), "num_warps": 8, "num_stages": 3},
    # deeper pipelines for the row-block-first deal, where a column block of the weights comes from L2 for all
    # but one of an expert's row blocks (--moe-tokens 1024: two to three 128-row blocks, four to five 64-row)
    {"block": (64, 256, 64), "num_warps": 8, "num_stages": 4},
    {"block": (128, 256, 64), "num_warps": 8, "num_stages": 4},
]
TUNE_TILES = {"allgather_gemm": GEMM_TILES, "gemm_reduce_scatter": GEMM_TILES, "gemm_all_reduce": GEMM_TILES,
              "ring_attention": RING_TILES, "moe_dispatch_gemm": MOE_GEMM_TILES}
#: the kernels ``--tune`` can time (each with a ``CASES`` entry)
TUNABLE = tuple(TUNE_TILES)
#: seconds of tuning after which the configs left are recorded as skipped (the device's call is 10 minutes)
TUNE_SECONDS = 300.0


def tile_label(tile: dict[str, Any]) -> str:
    """``128x256x64 w8 s3`` (``tma`` appended for descriptor loads, ``g4`` for a grouped tile order)."""
    return (f"{'x'.join(str(b) for b in tile['block'])} w{tile['num_warps']} s{tile['num_stages']}"
            + (" tma" if tile.get("tma") else "") + (f" g{tile['group_m']}" if tile.get("group_m", 1) > 1 else ""))


def tune_candidates(kernel: str, dims: dict[str, int],
                    tma: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(kept, refused)``: the kernel's candidate tiles at ``dims`` that its op's own checks accept, and a
    config entry (``refused``: the op's ValueError) for each they refuse; TMA tiles are left out without
    ``tma``. Pure (the checks the ops run before allocating)."""
    from gpuclient.kernels._tiles import check_group, check_launch, check_tiles
    from gpuclient.kernels.gemm_reduce_scatter import ReduceScatterLayout
    from gpuclient.kernels.moe import check_gemm_tiles
    from gpuclient.kernels.ring_attention import RingAttentionLayout

    kept, refused = [], []
    for tile in TUNE_TILES[kernel]:
        if tile.get("tma") and not tma:
            continue
        try:
            if kernel == "moe_dispatch_gemm":
                check_gemm_tiles(tile["block"], tile["num_warps"], tile["num_stages"])
            elif kernel == "ring_attention":
                check_launch(tile["num_warps"], tile["num_stages"])
                RingAttentionLayout(0, WORLD, dims["heads"], dims["seq_local"], dims["head_dim"],
                                    chunk_rows=dims["chunk_rows"], block=tuple(tile["block"]))
            else:
                check_tiles(tile["block"], tile["num_warps"], tile["num_stages"], tile["tma"], dims["n"], dims["k"])
                check_group(tile.get("group_m", 1))
                if kernel != "allgather_gemm":
                    ReduceScatterLayout(0, WORLD, dims["m"], dims["n"], dims["k"], chunk_rows=dims["chunk_rows"],
                                        block=tuple(tile["block"]), all_gather=kernel == "gemm_all_reduce",
                                        group_m=tile.get("group_m", 1))
        except ValueError as exc:
            refused.append({**_tile_fields(tile), "refused": str(exc)})
        else:
            kept.append(tile)
    return kept, refused


def _tile_fields(tile: dict[str, Any]) -> dict[str, Any]:
    return {"label": tile_label(tile), **tile, "block": list(tile["block"])}


def tune_plan(kernels: list[str], sizes: dict[str, list[dict[str, int]]],
              tma: bool = True) -> list[dict[str, Any]]:
    """The sessions of a tuning run, in order: one a kernel (the first size) with its pointer tiles, then one a
    GEMM with its TMA tiles (after every kernel's others: a fault in the descriptor path would take the CUDA
    context, and every later measurement, with it). Each: ``kernel``, ``dims``, ``tiles`` (to time),
    ``refused`` (entries, in the kernel's first session)."""
    plan, later = [], []
    for kernel in kernels:
        dims = sizes[kernel][0]
        kept, refused = tune_candidates(kernel, dims, tma)
        plan.append({"kernel": kernel, "dims": dims, "tiles": [t for t in kept if not t.get("tma")],
                     "refused": refused})
        if any(t.get("tma") for t in kept):
            later.append({"kernel": kernel, "dims": dims, "tiles": [t for t in kept if t.get("tma")], "refused": []})
    return [p for p in plan + later if p["tiles"] or p["refused"]]


def tune_session(kernel: str, backend: str, shape: str, dims: dict[str, int], tiles: list[dict[str, Any]], reps: int,
                 deadline: float, reference: bool, device: int = 0,
                 echo: Callable[[str], None] = print, run: RunOptions = RunOptions()) -> dict[str, Any]:
    """Time the compute alone (``communicate=False``) of ``kernel`` at ``dims`` with each of ``tiles``, in one
    session: the case is built as ``fused_row`` builds it (its programs), the peers' data staged where the
    compute reads it, and for each tile every rank's op retiled and its compute variant preloaded (compiled
    and loaded before any launch: the ranks share this process), then one launch checked against torch and
    the median of ``reps``. ``reference``: time torch's compute too. Configs the op refuses, that do not fit
    the GPU (Triton's OutOfResources) or fail are recorded as such; past ``deadline`` (``time.monotonic``)
    the rest are recorded as skipped."""
    import torch
    from triton.runtime.errors import OutOfResources

    gen = torch.Generator(device="cpu").manual_seed(5)
    configs: list[dict[str, Any]] = []
    out: dict[str, Any] = {"kernel": kernel, "dims": dims, "configs": configs}
    try:
        with _sessions(run, backend, shape, f"fused-tune-{kernel}", device) as (_, sessions):
            streams = [torch.cuda.Stream(device) for _ in sessions]
            case = CASES[kernel](sessions, streams, gen, device, programs=run.programs, **dims)
            case.stage()
            torch.cuda.synchronize()
            out.update(flops=case.flops, params=case.params)

            def compute() -> None:
                case.launch(communicate=False)

            for tile in tiles:
                entry = _tile_fields(tile)
                configs.append(entry)
                if time.monotonic() > deadline:
                    entry["skipped"] = "past the time budget"
                    continue
                try:
                    torch.cuda.synchronize()  # nothing runs while the variant loads
                    if case.retile is not None:
                        compiled = case.retile(tile)
                    else:
                        # a tile without an order (GEMMs) or a load path (ring attention) is timed row-major and
                        # through pointers, not as the tile before it or the op's default
                        order = {"group_m": 1} if kernel in GEMMS else {"tma": False} if kernel == "ring_attention" \
                            else {}
                        for op in case.ops:
                            op.retile(**{**order, **tile})
                        compiled = [op.preload(communicate=False, compute=True) for op in case.ops][0]
                    entry.update(shared_bytes=int(compiled.metadata.shared), registers=int(compiled.n_regs),
                                 spills=int(compiled.n_spills))
                    compute()  # the warm-up, checked
                    torch.cuda.synchronize()
                    entry["max_abs_error"] = case.compute_error() if case.compute_error else None
                    entry["median_s"] = _time(compute, streams, reps)
                    entry["tflops"] = case.flops / entry["median_s"] / 1e12
                except ValueError as exc:  # the op's checks
                    entry["refused"] = str(exc)
                except OutOfResources as exc:  # shared memory or threads past the GPU's, found at the load
                    entry["out_of_resources"] = str(exc)
                except Exception as exc:  # a compile or a launch that fails: recorded, the next tile goes on
                    entry["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                echo(f"  tune {kernel:20s} {entry['label']:22s} " + _tune_outcome(entry))
            if reference:
                case.torch_compute()  # its first call (library handles, module loads) is not timed
                out["torch_s"] = _time(case.torch_compute, streams, reps)
                echo(f"  tune {kernel:20s} {'torch':22s} {out['torch_s'] * 1e3:8.3f} ms "
                     f"{case.flops / out['torch_s'] / 1e12:7.1f} TFLOP/s")
            _check_channels(case.ops)
    except Exception as exc:  # the session's (start, build, torch, teardown): what it measured is kept
        out["error"] = f"{type(exc).__name__}: {exc}"
        echo(f"  tune {kernel}: failed: {out['error']}")
    return out


def _tune_outcome(entry: dict[str, Any]) -> str:
    for key in ("refused", "out_of_resources", "failed", "skipped"):
        if key in entry:
            return f"{key.replace('_', ' ')}: {entry[key]}"
    error = entry.get("max_abs_error")
    return (f"{entry['median_s'] * 1e3:8.3f} ms {entry['tflops']:7.1f} TFLOP/s"
            + ("" if error is None else f"  max abs error {error:.3g}"))


def tune_summary(sessions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kernel, from its sessions' results: ``dims``, ``params``, ``flops``, ``torch_s`` and
    ``torch_tflops`` (the first session that timed torch), ``configs`` (every session's, in order; each timed
    one with ``speedup_vs_default`` and ``vs_torch``: torch's time over its own), ``default`` (the label of
    the op's default tile) and ``best`` (the timed config with the lowest median, or None)."""
    out: dict[str, dict[str, Any]] = {}
    for session in sessions:
        kernel = session["kernel"]
        row = out.setdefault(kernel, {"dims": session["dims"], "configs": [], "torch_s": None,
                                      "default": tile_label(TUNE_TILES[kernel][0])})
        for key in ("params", "flops"):
            if key in session:
                row.setdefault(key, session[key])
        if row["torch_s"] is None and session.get("torch_s") is not None:
            row["torch_s"] = session["torch_s"]
        row["configs"].extend(session.get("configs", []))
        if "error" in session:
            row.setdefault("errors", []).append(session["error"])
    for row in out.values():
        timed = [c for c in row["configs"] if "median_s" in c]
        default = next((c for c in timed if c["label"] == row["default"]), None)
        for c in timed:
            c["speedup_vs_default"] = default["median_s"] / c["median_s"] if default else None
            c["vs_torch"] = row["torch_s"] / c["median_s"] if row["torch_s"] else None
        row["torch_tflops"] = row["flops"] / row["torch_s"] / 1e12 if row["torch_s"] and row.get("flops") else None
        row["best"] = min(timed, key=lambda c: c["median_s"]) if timed else None
    return out


def tune_table(summary: dict[str, dict[str, Any]]) -> str:
    """One line a config (the default and the best marked), one a kernel for torch's time, and one a failed
    session."""

    def line(*cells: str) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [line("kernel", "size", "tiles", "compute ms", "TFLOP/s", "vs default", "torch / this", "max abs error",
                  "note"), "|" + "---|" * 9]
    for kernel, row in summary.items():
        size = _dims(row["dims"])
        best = row["best"]["label"] if row["best"] else None
        for c in row["configs"]:
            if "median_s" not in c:
                note = next(f"{k.replace('_', ' ')}: {c[k]}" for k in ("refused", "out_of_resources", "failed",
                                                                       "skipped") if k in c)
                lines.append(line(kernel, size, c["label"], *[""] * 5, note))
                continue
            notes = [n for n in ("default" if c["label"] == row["default"] else "",
                                 "**best**" if c["label"] == best else "",
                                 f"{c['spills']} spills" if c.get("spills") else "") if n]
            lines.append(line(kernel, size, c["label"], f"{c['median_s'] * 1e3:.3f}", f"{c['tflops']:.1f}",
                              "" if c.get("speedup_vs_default") is None else f"{c['speedup_vs_default']:.2f}x",
                              "" if c.get("vs_torch") is None else f"{c['vs_torch']:.2f}",
                              "" if c.get("max_abs_error") is None else f"{c['max_abs_error']:.3g}", ", ".join(notes)))
        if row["torch_s"]:
            lines.append(line(kernel, size, "torch", f"{row['torch_s'] * 1e3:.3f}", f"{row['torch_tflops']:.1f}", "",
                              "1.00", "", "reference"))
        for error in row.get("errors", []):
            lines.append(line(kernel, size, *[""] * 6, f"session failed: {error}"))
    return "\n".join(lines)


def run_tune(kernels: list[str], backend: str, shape: str, sizes: dict[str, list[dict[str, int]]], reps: int, tma: bool,
             seconds: float, json_path: str | None, how: str, echo: Callable[[str], None] = print,
             run: RunOptions = RunOptions()) -> dict[str, Any]:
    """The tuning run: ``tune_plan``'s sessions in order, the JSON rewritten after each (a run cut short keeps
    what it measured), then the table."""
    deadline = time.monotonic() + seconds
    done: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    timed: set[str] = set()
    for step in tune_plan(kernels, sizes, tma):
        kernel, dims = step["kernel"], step["dims"]
        if time.monotonic() > deadline:  # not even a session started: its tiles are recorded as skipped
            session = {"kernel": kernel, "dims": dims,
                       "configs": [{**_tile_fields(t), "skipped": "past the time budget"} for t in step["tiles"]]}
        else:
            try:
                session = tune_session(kernel, backend, shape, dims, step["tiles"], reps, deadline,
                                       reference=kernel not in timed, echo=echo, run=run)
            except Exception as exc:  # keep what the other sessions measured
                session = {"kernel": kernel, "dims": dims, "error": f"{type(exc).__name__}: {exc}"}
                echo(f"  tune {kernel}: failed: {exc}")
        if session.get("torch_s") is not None:
            timed.add(kernel)
        session["configs"] = step["refused"] + session.get("configs", [])
        done.append(session)
        result = {"how": how, "backend": backend, "shape": shape, "reps": reps, "world": WORLD,
                  "kernels": tune_summary(done)}
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=2))
    echo(tune_table(result.get("kernels", {})))
    return result


#: the kernels whose tile order ``--group-m`` sets (``_tiles.tile_at``)
GEMMS = ("allgather_gemm", "gemm_reduce_scatter", "gemm_all_reduce")


def _assignments(text: str) -> Iterator[tuple[str, str, str]]:
    """Each comma-separated ``NAME=VALUE`` of an option's text, as (the item, NAME, VALUE); empty items skipped."""
    for item in (part.strip() for part in text.split(",")):
        if item:
            name, _, value = item.partition("=")
            yield item, name, value


def _positive_int(item: str, value: str, what: str, option: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(f"{item!r}: {what} must be an integer >= 1", param_hint=option)
    return int(value)


def parse_per_kernel(text: str, option: str = "--chunk-rows", kernels: tuple[str, ...] = KERNELS,
                     what: str = "rows") -> dict[str, int]:
    """``KERNEL=N`` pairs, comma-separated, each N an integer >= 1 (``--chunk-rows``: every kernel of
    ``KERNELS`` has chunk rows; ``--group-m``: the GEMMs)."""
    out: dict[str, int] = {}
    for item, kernel, value in _assignments(text):
        if kernel not in kernels:
            raise click.BadParameter(f"{kernel!r} is not one of {', '.join(kernels)}", param_hint=option)
        out[kernel] = _positive_int(item, value, what, option)
    return out


def parse_dims(text: str) -> dict[str, dict[str, int]]:
    """``KERNEL.KEY=N`` triples, comma-separated (``--dims``): N, an integer >= 1, in place of KEY in every size of
    KERNEL, one of ``KERNELS``; KEY must be one of that kernel's size keys (``SIZES``)."""
    out: dict[str, dict[str, int]] = {}
    for item, name, value in _assignments(text):
        kernel, _, key = name.partition(".")
        if kernel not in KERNELS:
            raise click.BadParameter(f"{kernel!r} is not one of {', '.join(KERNELS)}", param_hint="--dims")
        if key not in SIZES[kernel][0]:
            raise click.BadParameter(f"{item!r}: {kernel}'s sizes have {', '.join(SIZES[kernel][0])}",
                                     param_hint="--dims")
        out.setdefault(kernel, {})[key] = _positive_int(item, value, key, "--dims")
    return out


#: the sources a call's ``kernel_source`` digest covers: the ops, their Triton device calls and their plans
KERNEL_SOURCES = ("gpuclient/kernels/*.py", "gpuclient/triton.py", "gpuclient/plan.py")


def kernel_source(root: Path = ROOT) -> str:
    """The first 12 hex digits of a SHA-256 over ``KERNEL_SOURCES`` (each file's path and bytes, in path order),
    written beside a call's rows: calls with one digest ran the same kernels, and a variant under test has its own
    (``fused_standing.py --source`` counts by it)."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in KERNEL_SOURCES for p in root.glob(pattern)}):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def gpu_name() -> str | None:
    """The GPU a call runs on, recorded beside its rows (fused_standing counts each card apart) or a ``--tune`` call's
    tiles; None where torch or a GPU is absent, as in the CPU tests' stand-in runs."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--kernels", default=",".join((*KERNELS, "moe", "moe_dispatch_gemm")), show_default=True,
              help="comma-separated: " + ", ".join((*KERNELS, "moe", "moe_dispatch_gemm")))
@click.option("--backends", default="ib,efa", show_default=True)
@click.option("--shapes", default="nic", show_default=True,
              help="comma-separated: nic (each backend's own NIC model), unshaped, or a NIC model name")
@click.option("--sizes", default=None, type=click.IntRange(min=1),
              help="only the first N sizes of each kernel (default: all)")
@click.option("--reps", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--programs", default=None, type=click.IntRange(min=2),
              help="programs per rank for every fused op (default: the SMs over the two ranks)")
@click.option("--quick", is_flag=True, help="one small size per kernel, 2 reps (a smoke run)")
@click.option("--copy-via", type=click.Choice(DIRECT_COPY_PLACEMENTS), default="device", show_default=True,
              help="softverbs.direct_copy_via: the soft fabric places a GPU write with one device-to-device copy "
                   "(on SMs, beside the fused op's programs) or through pinned host memory (copy engines, no SM)")
@click.option("--flags", "flags_where", type=click.Choice(FLAG_PLACEMENTS), default="device", show_default=True,
              help="each rank's flag words: in GPU memory (the ops' default; on efa the receiving daemon writes them "
                   "with a loopback RDMA write where there is no GDRCopy) or in a host flag file the kernels read "
                   "mapped (the daemon stores them)")
@click.option("--publication", type=click.Choice(PUBLICATIONS), default=RunOptions.publication, show_default=True,
              help="efa's flags.publication: how the receiving daemon writes flags into GPU memory (cuda-copy: word "
                   "copies on its worker's stream, not waited for; auto: a loopback RDMA write here, with no GDRCopy)")
@click.option("--timeline", "timeline_path", type=click.Path(dir_okay=False), default=None,
              help="also run one launch of each mode with the kernels' timelines (GEMM+RS, GEMM+AR, MoE "
                   "Dispatch+GEMM): a summary in each row, every recorded event here")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False), default=None,
              help="with --timeline: every process stamps each message's steps through the soft fabric during the "
                   "timeline launches (SOFTVERBS_TRACE), and DIR/steps.json lists them per launch")
@click.option("--chunk-rows", "chunk_rows", default="", metavar="KERNEL=ROWS,...",
              help="override the chunk rows of a kernel's sizes (e.g. gemm_all_reduce=256): the messages' size, "
                   "against the soft fabric's cost per message")
@click.option("--dims", "dims_text", default="", metavar="KERNEL.KEY=N,...",
              help="set a size key in every size of a kernel (e.g. gemm_all_reduce.m=16384): a larger problem at "
                   "the same balance, over which the soft fabric's fixed cost per message weighs less")
@click.option("--group-m", "group_m", default="", metavar="KERNEL=N,...",
              help="the tile order of a GEMM (allgather_gemm, gemm_reduce_scatter, gemm_all_reduce): N row blocks "
                   "at a time, column by column (1: row-major; default: the op's)")
@click.option("--ring-pointers", is_flag=True,
              help="ring attention loads its key blocks through pointers (RingAttention(tma=False)), not descriptors")
@click.option("--tune", is_flag=True,
              help="time each kernel's compute alone with candidate tiles instead (the first size, the first "
                   "backend and shape; MoE Dispatch+GEMM's expert GEMM too, MoE dispatch/combine left out)")
@click.option("--tma/--no-tma", default=True, show_default=True, help="--tune: the GEMMs' TMA tiles too")
@click.option("--tune-seconds", default=TUNE_SECONDS, show_default=True, type=FiniteFloat(min=0),
              help="--tune: configs not started by then are recorded as skipped")
@click.option("--moe-experts", default=None, type=click.IntRange(min=1),
              help="MoE Dispatch+GEMM's experts in place of its sizes' 64: the same tokens and bytes in fewer, larger "
                   "blocks (a block per (peer, expert)), against the soft fabric's cost per message; with --tune, "
                   "the expert GEMM's tiles at that many")
@click.option("--moe-tokens", default=None, type=click.IntRange(min=1),
              help="MoE Dispatch+GEMM's tokens a rank in place of its sizes' 128: more rows an expert, so that a row "
                   "block of the expert GEMM can hold this rank's rows alone and start before the peers' land")
@click.option("--moe-gemm-n", default=None, type=click.IntRange(min=1),
              help="MoE Dispatch+GEMM's expert width (each local expert's weight is hidden x N) in place of its "
                   "sizes': the compute grows with it and the communication does not, so it sets their balance")
@click.option("--moe-experts-per-put", default=None, type=click.IntRange(min=1),
              help="MoE Dispatch+GEMM sends each peer the rows of this many of its experts in one put and one flag "
                   "(default: the op's, four puts a peer; 1: a put and a flag per expert)")
@click.option("--moe-split-experts", default=None, type=click.IntRange(min=0),
              help="MoE Dispatch+GEMM takes the first this many local experts' row blocks source by source (own rows "
                   "first, each source's step reading the expert's weights again) and the others' whole once all "
                   "their rows are in (default: the op's, the first put group's experts)")
@io_spin_us_option
@nic_spin_us_option
@nic_streaming_option
@gil_switch_us_option
@click.option("--poll-window-us", default=None, type=click.IntRange(min=0, max=1_000_000),
              help="proxy.poll_window_us (default: the config's): how long a worker waits to fill a batch before "
                   "posting a partial one")
def main(json_path: str | None, kernels: str, backends: str, shapes: str, sizes: int | None, reps: int,
         programs: int | None, quick: bool, copy_via: str, tune: bool, tma: bool, tune_seconds: float,
         timeline_path: str | None = None, flags_where: str = "device", publication: str = RunOptions.publication,
         chunk_rows: str = "", io_spin_us: float = 0.0, group_m: str = "", ring_pointers: bool = False,
         trace_dir: str | None = None, moe_experts: int | None = None, moe_tokens: int | None = None,
         moe_gemm_n: int | None = None, moe_experts_per_put: int | None = None, moe_split_experts: int | None = None,
         nic_spin_us: float | None = None, gil_switch_us: float = 0.0,
         poll_window_us: int | None = None, dims_text: str = "", nic_streaming: bool = True) -> None:
    """Overlap of the fused kernels on two daemons sharing this GPU (see the module doc)."""
    from transportd_cli.mps import Mps

    run = RunOptions(SoftOptions.from_options(copy_via, io_spin_us, nic_spin_us, gil_switch_us, nic_streaming),
                     programs, flags_where, publication, poll_window_us)

    wanted = [k for k in kernels.split(",") if k]
    unknown = sorted(set(wanted) - {*KERNELS, "moe", "moe_dispatch_gemm"})
    if unknown:
        raise click.BadParameter(f"unknown kernel(s) {', '.join(unknown)}", param_hint="--kernels")
    group_of = parse_per_kernel(group_m, "--group-m", GEMMS, "N")
    dims_of = {kernel: {"chunk_rows": rows} for kernel, rows in parse_per_kernel(chunk_rows).items()}
    for kernel, keys in parse_dims(dims_text).items():  # --dims' chunk_rows over --chunk-rows'
        dims_of[kernel] = {**dims_of.get(kernel, {}), **keys}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).touch()  # a bad path fails now, not after the run
    if timeline_path:
        Path(timeline_path).parent.mkdir(parents=True, exist_ok=True)
        Path(timeline_path).touch()
    if trace_dir and not timeline_path:
        raise click.BadParameter("--trace stamps the timeline launches: give --timeline too")
    if trace_dir:
        from softverbs import _trace

        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        os.environ["SOFTVERBS_TRACE"] = _trace.DIR = str(Path(trace_dir).resolve())  # the daemons inherit it
    moe_dims = QUICK_MOE if quick else MOE
    moe_sizes = {key: value for key, value in (("tokens", moe_tokens), ("experts", moe_experts),
                                                ("gemm_n", moe_gemm_n), ("experts_per_put", moe_experts_per_put),
                                                ("split_experts", moe_split_experts)) if value is not None}
    if quick:
        reps = 2
    rows: list[dict[str, Any]] = []
    raw_timelines: list[dict[str, Any]] = []
    source = kernel_source()  # read before the run: an edit during it is not what ran

    def save(mps_line: str) -> None:
        for row in rows:
            raw = row.pop("timeline_raw", None)
            if raw is not None:
                raw_timelines.append({key: row.get(key) for key in ("kernel", "backend", "shape", *SIZES_KEYS)}
                                     | {"modes": raw})
        if timeline_path:
            Path(timeline_path).write_text(json.dumps(raw_timelines))
        if json_path:
            Path(json_path).write_text(json.dumps({"rows": rows, "gpu": gpu_name(), "kernel_source": source,
                                                   "mps": mps_line, **run.record()}, indent=2))

    def attempt(what: dict[str, Any], fn: Callable[..., dict[str, Any]], *args: Any, **kw: Any) -> None:
        try:
            rows.append(fn(*args, echo=click.echo, run=run, **kw))
        except Exception as exc:  # keep what the other rows measured
            rows.append({**what, "error": f"{type(exc).__name__}: {exc}"})
            click.echo(f"  {what}: failed: {exc}")
        save(mps.describe())  # after every row: a run cut short keeps what it measured

    with Mps() as mps:  # started where wanted and present; describe() says which
        if not mps.running:
            click.echo(mps.describe())
        if tune:
            backend = backends.split(",")[0]
            spec = shapes.split(",")[0]
            shape = BACKEND_SHAPE[backend] if spec == "nic" else spec
            how = "python benchmarks/fused_bench.py " + " ".join(sys.argv[1:])
            tune_kernels = [k for k in wanted if k in TUNABLE]
            # the defaults' sizes: the compute alone, on either backend
            tune_sizes = backend_sizes("ib", quick, moe_sizes)
            result = run_tune(tune_kernels, backend, shape, tune_sizes, reps, tma, tune_seconds, json_path, how,
                              echo=click.echo, run=run)
            mps_line = mps.describe()
            if json_path:
                Path(json_path).write_text(json.dumps({**result, "gpu": gpu_name(), "kernel_source": source,
                                                       "mps": mps_line}, indent=2))
            click.echo(mps_line)
            return
        for backend in backends.split(","):
            for spec in shapes.split(","):
                shape = BACKEND_SHAPE[backend] if spec == "nic" else spec
                run_sizes = backend_sizes(backend, quick, moe_sizes)
                for kernel in (k for k in wanted if k in KERNELS):
                    for dims in run_sizes[kernel][:sizes]:
                        dims = {**dims, **dims_of.get(kernel, {})}
                        if kernel in group_of:
                            dims = {**dims, "group_m": group_of[kernel]}
                        if ring_pointers and kernel == "ring_attention":
                            dims = {**dims, "tma": 0}
                        attempt({"kernel": kernel, "backend": backend, "shape": shape, **dims},
                                fused_row, kernel, backend, shape, dims, reps, timeline=timeline_path is not None)
                if "moe_dispatch_gemm" in wanted:
                    for dims in run_sizes["moe_dispatch_gemm"][:sizes]:
                        attempt({"kernel": "moe_dispatch_gemm", "backend": backend, "shape": shape, **dims},
                                moe_gemm_row, backend, shape, dims, reps, timeline=timeline_path is not None)
                if "moe" in wanted:
                    for decoupled in (False, True):
                        attempt({"kernel": "moe", "backend": backend, "shape": shape, "decoupled": decoupled},
                                moe_row, backend, shape, decoupled, reps, **moe_dims)
                    attempt({"kernel": "moe", "backend": backend, "shape": shape, "decoupled": False, "fp8": True},
                            moe_row, backend, shape, False, reps, fp8=True, **moe_dims)
        mps_line = mps.describe()
    click.echo(mps_line)
    click.echo(table(rows))
    save(mps_line)
    if trace_dir:
        from softverbs.soft.trace import ready_waits, steps

        (Path(trace_dir) / "steps.json").write_text(json.dumps(steps(trace_dir)))
        (Path(trace_dir) / "ready_waits.json").write_text(json.dumps(ready_waits(trace_dir)))


if __name__ == "__main__":
    main()
