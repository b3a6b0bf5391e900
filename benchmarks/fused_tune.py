"""``fused_bench.py --tune``: each kernel's compute alone (``communicate=False``) timed over a grid of
candidate tiles, on the first size, in sessions whose results are written after each."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.fused_cases import (
    CASES,
    DEFAULT_RUN,
    GEMMS,
    WORLD,
    RunOptions,
    check_channels,
    rank_sessions,
    size_label,
)
from benchmarks.fused_timing import time_median

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
                 echo: Callable[[str], None] = print, run: RunOptions = DEFAULT_RUN) -> dict[str, Any]:
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
        with rank_sessions(run, backend, shape, f"fused-tune-{kernel}", device) as (_, sessions):
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
                    entry["median_s"] = time_median(compute, streams, reps)
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
                out["torch_s"] = time_median(case.torch_compute, streams, reps)
                echo(f"  tune {kernel:20s} {'torch':22s} {out['torch_s'] * 1e3:8.3f} ms "
                     f"{case.flops / out['torch_s'] / 1e12:7.1f} TFLOP/s")
            check_channels(case.ops)
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
        size = size_label(row["dims"])
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
             run: RunOptions = DEFAULT_RUN) -> dict[str, Any]:
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
