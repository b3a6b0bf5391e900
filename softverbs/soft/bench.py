"""`transportd bench softverbs`: loopback throughput and work-request rate between two processes.

A responder process and this process each open a soft device, connect an RC QP (and, for the SRD rows, an
EFA SRD QP) over loopback TCP, and this process streams RDMA writes into the responder's memory through the
extended post API (wr_start / wr_rdma_write / wr_set_sge / wr_complete), keeping a window of WRs in flight
and signaling the last WR of each batch (every WR on SRD, as EFA requires). Reported: GB/s for 4 KiB,
64 KiB and 1 MiB writes, small-write WRs/s, (RC) the time a 2 MiB write takes one at a time on a link
shaped as an EFA port (``shaped_chain``), and (RC) 4 KiB writes from device memory into device memory in
batches of 8 (``direct``): memory that /dev/shm files emulate (`softverbs.soft.ShmCopier`), so each write
goes as a reference and the responder places it by a copy from the requester's allocation, as a GPU
buffer's write does between two daemons on one host. Its WRs/s is the soft fabric's own cost per write on
the path every fused kernel's bytes take, without a GPU. Timings are wall-clock on a shared machine: compare runs
on the same host, not across hosts.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

__all__ = ["bench_softverbs", "run_softverbs_benchmark"]

_MR_SIZE = 64 << 20
_DIRECT_MR_SIZE = 4 << 20  # the direct row's: /dev/shm files, one each side
_QKEY = 0x11111111


def _open(kind: str, direct: bool = False) -> dict[str, Any]:
    """A device, PD, CQ, MR and QP of ``kind``; with ``direct``, the MR over emulated device memory (a
    `ShmCopier` allocation behind a `HostAccessor`, the copier installed for this process)."""
    from softverbs import addr as am
    from softverbs import cq as cqm
    from softverbs import device as dm
    from softverbs import libibverbs_enums as e
    from softverbs import mr as mrm
    from softverbs import pd as pdm
    from softverbs import qp as qpm
    from softverbs.providers.efa import efa_enums as ee
    from softverbs.providers.efa import efadv

    acc = int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    if kind == "rc":
        ctx = dm.Context(name="softib0")
    else:
        ctx = efadv.EfaContext(name="softefa0")
    pd = pdm.PD(ctx)
    cq = cqm.CQ(ctx, 8192)
    copier = base = None
    if direct:
        from softverbs import soft

        copier = soft.ShmCopier()
        soft.set_direct_copier(copier)
        base = copier.allocate(_DIRECT_MR_SIZE)
        mr = mrm.MR(pd, _DIRECT_MR_SIZE, acc, address=base, soft_accessor=soft.HostAccessor())
    else:
        mr = mrm.MR(pd, _MR_SIZE, acc)
    cap = qpm.QPCap(max_send_wr=4096, max_recv_wr=4096, max_send_sge=1, max_recv_sge=1)
    ops = int(e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM)
    mask = int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
    if kind == "rc":
        init = qpm.QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, pd=pd, comp_mask=mask,
                                send_ops_flags=ops)
        qp = qpm.QPEx(ctx, init)
    else:
        init = qpm.QPInitAttrEx(qp_type=e.IBV_QPT_DRIVER, scq=cq, rcq=cq, cap=cap, pd=pd, comp_mask=mask,
                                send_ops_flags=ops)
        ea = efadv.EfaQPInitAttr()
        ea.driver_qp_type = ee.EFADV_QP_DRIVER_TYPE_SRD
        ea.flags = ee.EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV
        qp = efadv.SRDQPEx(ctx, init, ea)
    info = {"qpn": qp.qp_num, "gid": str(ctx.query_gid(1, 0)), "lid": ctx.query_port(1).lid,
            "addr": mr.buf, "rkey": mr.rkey}
    return {"ctx": ctx, "pd": pd, "cq": cq, "mr": mr, "qp": qp, "info": info, "kind": kind, "e": e, "am": am,
            "qpm": qpm, "acc": acc, "copier": copier, "base": base,
            "mr_size": _DIRECT_MR_SIZE if direct else _MR_SIZE}


def _close(r: dict[str, Any]) -> None:
    r["ctx"].close()
    if r["copier"] is not None:
        from softverbs import soft

        soft.set_direct_copier(None)
        r["copier"].free(r["base"])


def _connect(r: dict[str, Any], remote: dict[str, Any]) -> Any:
    e, am, qpm, qp = r["e"], r["am"], r["qpm"], r["qp"]
    attr = qpm.QPAttr(port_num=1)
    if r["kind"] == "rc":
        attr.qp_access_flags = r["acc"]
        attr.path_mtu = e.IBV_MTU_4096
        attr.dest_qp_num = remote["qpn"]
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.ah_attr = am.AHAttr(is_global=1, gr=am.GlobalRoute(dgid=am.GID(remote["gid"])), dlid=remote["lid"])
        qp.to_rts(attr)
        return None
    attr.qkey = _QKEY
    qp.to_rts(attr)
    return am.AH(r["pd"], attr=am.AHAttr(is_global=1, gr=am.GlobalRoute(dgid=am.GID(remote["gid"]))))


def _responder(conn: Any, kind: str, direct: bool = False) -> None:
    r = _open(kind, direct)
    conn.send(r["info"])
    _connect(r, conn.recv())
    conn.send("ready")  # its QP takes requests: a write sent before would be dropped, and retried until it failed
    conn.recv()  # "done"
    _close(r)


def _stream(r: dict[str, Any], remote: dict[str, Any], ah: Any, size: int, seconds: float, batch: int,
            window: int) -> dict[str, float]:
    """Write `size`-byte WRs back to back for about `seconds`; returns bytes/s and WRs/s."""
    from softverbs import wr as wrm

    qp, cq, mr = r["qp"], r["cq"], r["mr"]
    e = r["e"]
    srd = r["kind"] == "srd"
    signaled = int(e.IBV_SEND_SIGNALED)
    slots = max(1, r["mr_size"] // size)
    sges = [wrm.SGE(mr.buf + (i % slots) * size, size, mr.lkey) for i in range(min(slots, 4096))]
    rkey, raddr = remote["rkey"], remote["addr"]
    posted = completed = 0
    outstanding: list[int] = []  # WRs covered by each signaled completion still to come
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        now = time.perf_counter()
        if now >= deadline and not outstanding:
            break
        if now < deadline and posted - completed + batch <= window:
            qp.wr_start()
            for j in range(batch):
                i = posted + j
                qp.wr_id = i
                last = j == batch - 1
                qp.wr_flags = signaled if (srd or last) else 0
                off = (i % slots) * size
                qp.wr_rdma_write(rkey, raddr + off)
                qp.wr_set_sge(sges[i % len(sges)])
                if srd:
                    qp.wr_set_ud_addr(ah, remote["qpn"], _QKEY)
            qp.wr_complete()
            posted += batch
            if srd:
                outstanding.extend([1] * batch)
            else:
                outstanding.append(batch)
            continue
        n, wcs = cq.poll(64)
        for wc in wcs:
            if wc.status != 0:
                raise RuntimeError(f"completion error {wc.status} for wr {wc.wr_id}")
            completed += outstanding.pop(0)
    elapsed = time.perf_counter() - t0
    return {"bytes_per_s": completed * size / elapsed, "wr_per_s": completed / elapsed, "wrs": completed,
            "seconds": elapsed}


#: ``shaped_chain``: one write at a time through the NIC model of an EFA port, each posted once the last completed
CHAIN_SIZE, CHAIN_BANDWIDTH, CHAIN_LATENCY_S = 2 << 20, 25e9, 15e-6


def _shaped_chain(r: dict[str, Any], remote: dict[str, Any], ah: Any, seconds: float) -> dict[str, float]:
    """2 MiB writes one at a time on a link shaped as an EFA port: each should take the model's 99 µs (84 of
    bytes, 15 of latency) plus what the machine adds; an I/O loop that slept to epoll's next millisecond
    for each landing added about 1 ms."""
    from softverbs import soft

    name = "softib0"  # the RC rows' device (_open)
    soft.configure(name, nic_bandwidth=CHAIN_BANDWIDTH, nic_latency_s=CHAIN_LATENCY_S)
    try:
        got = _stream(r, remote, ah, CHAIN_SIZE, seconds, 1, 1)
    finally:
        soft.configure(name, nic_bandwidth=None, nic_latency_s=0.0)
    return {"size": CHAIN_SIZE, "model_us": (CHAIN_SIZE / CHAIN_BANDWIDTH + CHAIN_LATENCY_S) * 1e6,
            "per_write_us": 1e6 / got["wr_per_s"], "wrs": got["wrs"]}


#: ``direct``: 4 KiB writes from emulated device memory in batches of 8, the fused kernels' puts over the soft fabric
DIRECT_SIZE, DIRECT_BATCH = 4096, 8


@contextlib.contextmanager
def _connected_pair(kind: str, direct: bool = False) -> Iterator[tuple[dict[str, Any], dict[str, Any], Any]]:
    """This process's side (`_open`) connected to a responder process's, both ready for requests:
    (this side, the responder's info, the address handle of an SRD pair or None)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_responder, args=(child, kind, direct), daemon=True)
    proc.start()
    r = _open(kind, direct)
    try:
        remote = parent.recv()
        parent.send(r["info"])
        ah = _connect(r, remote)
        parent.recv()  # "ready"
        yield r, remote, ah
    finally:
        parent.send("done")
        proc.join(10)
        _close(r)


def _run_direct(seconds: float) -> dict[str, Any]:
    """RC writes between two processes' emulated device memory (`_open` with ``direct``): the first write of the
    allocation crosses the wire while the peer opens it, the rest go as references, placed by a copy."""
    from softverbs import soft

    with _connected_pair("rc", direct=True) as (r, remote, ah):
        name = r["ctx"].name
        before = soft.device_stats(name)["direct_sent"]
        got = _stream(r, remote, ah, DIRECT_SIZE, seconds, DIRECT_BATCH, 256)
        got["direct_sent"] = soft.device_stats(name)["direct_sent"] - before
        return got


def _run_kind(kind: str, sizes: list[int], seconds: float, rate_size: int) -> dict[str, Any]:
    with _connected_pair(kind) as (r, remote, ah):
        out: dict[str, Any] = {}
        for size in sizes:
            window = max(4, min(1024, (64 << 20) // size))
            batch = 1 if size >= (256 << 10) else (8 if size >= (16 << 10) else 32)
            out[str(size)] = _stream(r, remote, ah, size, seconds, batch, window)
        out["rate"] = _stream(r, remote, ah, rate_size, seconds, 64, 2048)
        if kind == "rc":
            out["shaped_chain"] = _shaped_chain(r, remote, ah, seconds)
        return out


def run_softverbs_benchmark(seconds: float = 2.0, srd: bool = True) -> dict[str, Any]:
    """Measure RC (and SRD) loopback write throughput and WR rate between two processes."""
    sizes = [4 << 10, 64 << 10, 1 << 20]
    rc = _run_kind("rc", sizes, seconds, 64)
    rc["direct"] = _run_direct(seconds)
    result: dict[str, Any] = {
        "summary": {
            "gbps_4kib": rc[str(4 << 10)]["bytes_per_s"] / 1e9,
            "gbps_64kib": rc[str(64 << 10)]["bytes_per_s"] / 1e9,
            "gbps_1mib": rc[str(1 << 20)]["bytes_per_s"] / 1e9,
            "wr_per_s": rc["rate"]["wr_per_s"],
            "shaped_chain_us": rc["shaped_chain"]["per_write_us"],
            "direct_wr_per_s": rc["direct"]["wr_per_s"],
        },
        "rc": rc,
        "seconds_per_point": seconds,
        "rate_write_bytes": 64,
    }
    if srd:
        result["srd"] = _run_kind("srd", sizes, seconds, 64)
    return result


@click.command("softverbs")
@click.option("--seconds", default=2.0, show_default=True, type=click.FloatRange(min=0, min_open=True, max=3600),
              help="Seconds per measured point.")
@click.option("--srd/--no-srd", default=True, show_default=True, help="Also measure SRD (EFA) QPs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the results as JSON here.")
def bench_softverbs(seconds: float, srd: bool, json_path: Path | None) -> None:
    """softverbs loopback: GB/s for 4 KiB / 64 KiB / 1 MiB RDMA writes and small-write WRs/s."""
    res = run_softverbs_benchmark(seconds, srd)
    rows = [("RC", res["rc"])] + ([("SRD", res["srd"])] if "srd" in res else [])
    click.echo(f"{'QP':<5}{'4 KiB GB/s':>12}{'64 KiB GB/s':>13}{'1 MiB GB/s':>12}{'64 B WRs/s':>13}")
    for name, d in rows:
        g4, g64, g1m = (d[str(s)]["bytes_per_s"] / 1e9 for s in (4 << 10, 64 << 10, 1 << 20))
        click.echo(f"{name:<5}{g4:>12.2f}{g64:>13.2f}{g1m:>12.2f}{d['rate']['wr_per_s']:>13,.0f}")
    chain = res["rc"]["shaped_chain"]
    click.echo(f"RC, 2 MiB writes one at a time shaped as an EFA port: {chain['per_write_us']:.0f} us a write "
               f"(model {chain['model_us']:.0f} us)")
    direct = res["rc"]["direct"]
    click.echo(f"RC, 4 KiB writes between emulated device memories (direct, batches of {DIRECT_BATCH}): "
               f"{direct['wr_per_s']:,.0f} WRs/s ({1e6 / direct['wr_per_s']:.1f} us a write)")
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=2))
        click.echo(f"wrote {json_path}")
