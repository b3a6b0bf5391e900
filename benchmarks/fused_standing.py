"""Which fused-kernel rows met the targets, counted over calls: the standing tables of docs/performance.md.

    python benchmarks/fused_standing.py benchmarks/results/h200-2026-12-06-reductions-m-*.json [--json PATH]

Reads the JSONs ``fused_bench.py`` wrote (each file one call) and counts, per GPU, kernel, backend, NIC shape and
size, the rows inside the band (communication and compute within ``BAND``x of each other: the targets apply there
alone) and those of them that met both targets (overlap efficiency >= ``TARGET_OVERLAP`` and the fused launch
>= ``TARGET_SPEEDUP``x the sequential baseline), with the overlap and the speedup's range over the rows in the
band. A call run with a setting off fused_bench's defaults (``--copy-via host``, ``--programs 48``...) is counted
apart, its size naming the departure. An older call, which does not record its GPU, counts under ``—``; its file
name says the card. Each entry lists the ``sources`` (``kernel_source`` digests) of the calls it counts, and
``--source PREFIX`` counts only the calls whose digest starts so (a variant's calls, or the tree's). Rows without
an overlap (MoE's dispatch and combine latency) are not counted; files with no rows are named, and a file that is
not a fused_bench JSON is refused by name before anything is written.
A row's verdict is ``judge``'s, which ``fused_bench.py`` also writes into every row it times.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fabric_bench import SoftOptions  # noqa: E402

#: the targets of issue 25 (docs/performance.md)
TARGET_OVERLAP = 0.8
TARGET_SPEEDUP = 1.3
#: the targets apply where communication and compute are within this factor of each other
BAND = 2.0
#: what names a row's size: every key a fused_bench size may set, and the tile order or loads it ran with
SIZE_KEYS = ("m", "m_local", "n", "k", "heads", "seq_local", "head_dim", "tokens", "hidden", "topk", "experts",
             "gemm_n", "experts_per_put", "split_experts", "chunk_rows", "group_m", "tma")


#: the settings fused_bench records beside its rows, at its defaults (its options' defaults): a call with any other
#: measured something else, so its rows are counted apart
CALL_DEFAULTS: dict[str, Any] = {**SoftOptions().as_options(), "flags": "device", "publication": "cuda-copy",
                                 "programs": None, "poll_window_us": None}
#: the GPU of a call that does not record one, and the kernel source of one that does not record its digest
UNRECORDED_GPU = "—"
UNRECORDED_SOURCE = "—"

#: what a timed row must have to be counted
ROW_KEYS = ("kernel", "backend", "comm_s", "compute_s", "overlap_efficiency", "speedup_vs_sequential")


def judge(row: dict[str, Any]) -> dict[str, Any]:
    """``in_band`` (comm / compute within ``BAND``x) and ``meets_targets`` (both targets met; None outside the
    band, where they do not apply) of a row with ``comm_s``, ``compute_s``, ``overlap_efficiency`` and
    ``speedup_vs_sequential``."""
    ratio = row["comm_s"] / row["compute_s"]
    in_band = 1.0 / BAND <= ratio <= BAND
    meets = row["overlap_efficiency"] >= TARGET_OVERLAP and row["speedup_vs_sequential"] >= TARGET_SPEEDUP
    return {"in_band": in_band, "meets_targets": meets if in_band else None}


def size_of(row: dict[str, Any], call: dict[str, Any]) -> str:
    """The row's size as ``key=value`` words, in ``SIZE_KEYS``' order, then its call's settings that are off
    ``CALL_DEFAULTS``."""
    words = [f"{key}={row[key]}" for key in SIZE_KEYS if key in row]
    words += [f"{key}={call[key]}" for key, default in CALL_DEFAULTS.items() if call.get(key, default) != default]
    return " ".join(words)


def standing(calls: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per GPU, kernel, backend, shape and size, in the order first seen: ``rows`` (timed), ``in_band``,
    ``met``, the overlap's and the speedup's ``[min, max]`` over the rows in the band (None if none was), and the
    ``calls`` (file names) the rows came from and their ``sources`` (kernel digests)."""
    groups: dict[tuple[str, str, str, str, str], dict[str, Any]] = {}
    for name, call in calls:
        gpu = call.get("gpu") or UNRECORDED_GPU
        source = call.get("kernel_source") or UNRECORDED_SOURCE
        for row in call.get("rows") or []:
            if "overlap_efficiency" not in row:
                continue
            missing = [key for key in ROW_KEYS if key not in row]
            if missing:
                raise ValueError(f"{name}: a row with an overlap has no {', '.join(missing)}")
            key = (gpu, row["kernel"], row["backend"], row.get("shape", ""), size_of(row, call))
            group = groups.setdefault(key, {"gpu": gpu, "kernel": key[1], "backend": key[2], "shape": key[3],
                                            "size": key[4], "rows": 0, "in_band": 0, "met": 0, "overlap": None,
                                            "speedup": None, "calls": [], "sources": []})
            verdict = judge(row)
            group["rows"] += 1
            if name not in group["calls"]:
                group["calls"].append(name)
            if source not in group["sources"]:
                group["sources"].append(source)
            if not verdict["in_band"]:
                continue
            group["in_band"] += 1
            group["met"] += bool(verdict["meets_targets"])
            for field, value in (("overlap", row["overlap_efficiency"]), ("speedup", row["speedup_vs_sequential"])):
                low, high = group[field] or (value, value)
                group[field] = [min(low, value), max(high, value)]
    return list(groups.values())


def table(entries: list[dict[str, Any]]) -> str:
    """The standing as a markdown table."""
    def span(pair: list[float] | None, unit: str = "") -> str:
        return "—" if pair is None else f"{pair[0]:.2f}–{pair[1]:.2f}{unit}"

    lines = ["| gpu | kernel | backend | shape | size | met / in band | rows | overlap | vs sequential |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {e['gpu']} | {e['kernel']} | {e['backend']} | {e['shape']} | {e['size']} | "
              f"{e['met']} / {e['in_band']} | {e['rows']} | {span(e['overlap'])} | {span(e['speedup'], '×')} |"
              for e in entries]
    return "\n".join(lines)


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="also write the standing here, with the targets it was judged by")
@click.option("--source", "sources", multiple=True, metavar="PREFIX",
              help="count only the calls whose kernel_source digest starts with PREFIX (repeatable)")
def main(files: tuple[Path, ...], json_path: Path | None, sources: tuple[str, ...] = ()) -> None:
    """Count the rows of fused_bench JSONs FILES that met both targets, per GPU, kernel, backend, shape and size."""
    calls = []
    for path in files:
        try:
            call = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"{path}: not JSON ({exc})", param_hint="FILES") from None
        if not isinstance(call, dict) or not isinstance(call.get("rows", []), list):
            raise click.BadParameter(f"{path}: not a fused_bench JSON (an object with a list of rows)",
                                     param_hint="FILES")
        if sources and not str(call.get("kernel_source") or "").startswith(sources):
            click.echo(f"{path.name}: kernel source {call.get('kernel_source') or UNRECORDED_SOURCE}, not counted")
            continue
        if not call.get("rows"):
            click.echo(f"{path.name}: no rows")
        calls.append((path.name, call))
    try:
        entries = standing(calls)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="FILES") from None
    click.echo(table(entries))
    if json_path is not None:
        json_path.write_text(json.dumps({"targets": {"overlap": TARGET_OVERLAP, "speedup": TARGET_SPEEDUP,
                                                     "band": BAND}, "standing": entries}, indent=1) + "\n")


if __name__ == "__main__":
    main()
