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
clock onto the trace's (``gpu_clock``: gpu_common's ping-pong through mapped host memory, its error bound in the
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

This script holds the sizes, the rows and the command line; the parts it runs are modules of their own:
``fused_cases.py`` (the kernels built on both ranks, the daemons and ``RunOptions``), ``fused_timing.py`` (the
launches timed and the daemons' counters), ``fused_timeline.py`` (``--timeline``, ``--trace``), ``fused_tune.py``
(``--tune``) and ``moe_latency.py`` (MoE dispatch and combine latency).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fabric_bench import SHAPES, SoftOptions  # noqa: E402
from benchmarks.fused_cases import (  # noqa: E402
    BACKEND_SHAPE,
    CASES,
    DEFAULT_RUN,
    FLAG_PLACEMENTS,
    GEMMS,
    PUBLICATIONS,
    WORLD,
    MoeGemmRanks,
    RunOptions,
    check_channels,
    rank_sessions,
    size_label,
)
from benchmarks.fused_standing import judge  # noqa: E402
from benchmarks.fused_timeline import gemm_span_ratio, moe_timeline_runs, timeline_runs  # noqa: E402
from benchmarks.fused_timing import interleaved, per_launch, time_once  # noqa: E402
from benchmarks.fused_tune import TUNABLE, TUNE_SECONDS, run_tune  # noqa: E402
from benchmarks.moe_latency import graph_cell, moe_row, twin_cell  # noqa: E402
from transportd.dataplane.gpu_memory import COPY_VIA as DIRECT_COPY_PLACEMENTS  # noqa: E402
from transportd_cli.cli_options import (  # noqa: E402
    FiniteFloat,
    gil_switch_us_option,
    io_spin_us_option,
    nic_spin_us_option,
    nic_streaming_option,
)

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
#: three runs each, the fused launch no slower: docs/performance-log.md). With the rows staged by a kernel of their
#: own (2026-12-07) the second size met both targets in 3 of 4 calls on each backend on the H200; N 4096 there left
#: ib's overlap at 0.74-0.78, and on the H100 2048 tokens held ib's speedup to 1.22x, 512 tokens its overlap to 0.42,
#: and 24 split experts efa's overlap to 0.69, so the size stays
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


def fused_row(kernel: str, backend: str, shape: str, dims: dict[str, int], reps: int, device: int = 0,
              echo: Callable[[str], None] = print, timeline: bool = False,
              run: RunOptions = DEFAULT_RUN) -> dict[str, Any]:
    """One row: compute, comm, fused and torch times of ``kernel`` at ``dims`` on ``backend`` shaped as ``shape``,
    run as ``run`` says."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(5)
    with rank_sessions(run, backend, shape, f"fused-bench-{kernel}", device) as (clients, sessions):
        streams = [torch.cuda.Stream(device) for _ in sessions]
        case = CASES[kernel](sessions, streams, gen, device, programs=run.programs, **dims)
        case.launch()  # the first fused launch, checked
        torch.cuda.synchronize()
        row: dict[str, Any] = {"kernel": kernel, "backend": backend, "shape": shape, "nic": SHAPES.get(shape, {}),
                               "world": WORLD, **dims, **case.params, "max_abs_error": case.error()}
        seconds, counted_by = interleaved({
            "compute": lambda: time_once(lambda: case.launch(communicate=False), streams),
            "comm": lambda: time_once(lambda: case.launch(compute=False), streams),
            "fused": lambda: time_once(case.launch, streams),
            "torch": lambda: time_once(case.torch_compute, streams)}, reps, clients)
        row.update({f"{mode}_s": t for mode, t in seconds.items()})
        per_launch(row, counted_by, reps)
        if timeline and case.timelines:
            runs = timeline_runs(case, streams, f"{kernel}:{backend}:{size_label(dims)}")
            row["timeline"] = {mode: run["ranks"] for mode, run in runs.items()}
            row["timeline_raw"] = {mode: run["raw"] for mode, run in runs.items()}  # main moves it to its own file
        check_channels(case.ops)
    derive(row, case.flops, case.moved)
    echo(_summary(row, dims))
    return row


def _summary(row: dict[str, Any], dims: dict[str, int]) -> str:
    """One printed line of a timed row (``derive`` done)."""
    return (f"  {row['kernel']:20s} {row['backend']} {row['shape']:9s} {size_label(dims):28s} "
            f"compute {row['compute_s'] * 1e3:7.3f}  comm {row['comm_s'] * 1e3:7.3f}  fused {row['fused_s'] * 1e3:7.3f}"
            f"  torch {row['torch_s'] * 1e3:7.3f} ms  overlap {row['overlap_efficiency']:.2f}"
            f"  vs sequential {row['speedup_vs_sequential']:.2f}x"
            f"  {_VERDICT[row['meets_targets']]}")


_VERDICT = {True: "meets both", False: "misses", None: "outside the band"}


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
                 run: RunOptions = DEFAULT_RUN) -> dict[str, Any]:
    """MoE Dispatch+GEMM (``MoE.dispatch_gemm``): compute, comm, fused and torch times like ``fused_row``.
    Every round with communication is followed by a ``combine`` (untimed): a round must close before the next.
    ``timeline``: then one round of each mode with every rank's timeline (``moe_timeline_runs``)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(9)
    with rank_sessions(run, backend, shape, "fused-bench-moe-gemm", device) as (clients, sessions):
        moe = MoeGemmRanks(sessions, device, gen, programs=run.programs, **dims)
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
            "torch": lambda: time_once(moe.torch_compute, streams)}, reps, clients)
        row.update({f"{mode}_s": t for mode, t in seconds.items()})
        per_launch(row, counted_by, reps)
        if timeline:
            runs = moe_timeline_runs(moe, f"moe_dispatch_gemm:{backend}:{size_label(dims)}")
            row["timeline"] = {mode: run["ranks"] for mode, run in runs.items()}
            row["gemm_span_fused_over_alone"] = gemm_span_ratio(row["timeline"])
            row["timeline_raw"] = {mode: run["raw"] for mode, run in runs.items()}  # main moves it to its own file
            if any("on_trace" in run for run in runs.values()):
                row["timeline_on_trace"] = {mode: run.get("on_trace") for mode, run in runs.items()}
        check_channels(ops)
    derive(row, 2.0 * rows * hidden * gemm_n, remote_rows * hidden * 2)
    echo(_summary(row, dims))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| kernel | backend | NIC model | size | compute ms | comm ms | fused ms | torch ms | "
             "overlap efficiency | vs unfused | vs sequential (comm + torch) | ideal | comm/compute |",
             "|" + "---|" * 13]
    for r in rows:
        if r.get("kernel") == "moe":
            continue
        keys = MOE_SIZE_KEYS if r.get("kernel") == "moe_dispatch_gemm" else SIZES.get(r.get("kernel", ""), [{}])[0]
        size = size_label({k: r[k] for k in keys if k in r})
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
                  "dispatch / combine us | fp8's bf16 twin, same daemons: dispatch / combine us | "
                  "signals / dest / dispatch (requested) | fences / dest / dispatch | writes / dest / dispatch | "
                  "writes / dest / combine |", "|" + "---|" * 13]
        for r in moe:
            if "error" in r:
                lines.append(f"| moe | {r['backend']} | {r['shape']} | {r.get('decoupled')} | failed: {r['error']} |")
                continue
            lines.append(f"| {r['tokens']} tok, H {r['hidden']}, top-{r['topk']} of {r['experts']} | {r['backend']} | "
                         f"{r['shape']} | {'on' if r['decoupled'] else 'off'} | {'fp8' if r.get('fp8') else 'bf16'} | "
                         f"{r['dispatch_s'] * 1e6:.1f} | "
                         f"{r['combine_s'] * 1e6:.1f} | {graph_cell(r)} | {twin_cell(r)} | "
                         f"{r['dispatch_signals_per_dest']:.2f} "
                         f"({r['dispatch_signals_requested_per_dest']:.2f}) | {r['dispatch_fences_per_dest']:.2f} | "
                         f"{r['dispatch_writes_per_dest']:.1f} | {r['combine_writes_per_dest']:.1f} |")
    return "\n".join(lines)


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
