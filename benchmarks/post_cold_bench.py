"""What a soft batch post's Python costs when its thread has just been idle, against back to back.

    python benchmarks/post_cold_bench.py --json benchmarks/results/post-cold.json

A rail worker posts a fused launch's first records after sitting idle between launches, so the post's Python
(`softverbs.soft.batch.post_wr_batch`: the WR list, its checks and queueing) runs with the thread's caches
cold. This times that part of a post, ``--wrs`` RDMA writes on an RC QP between two soft devices in this
process (``wr_complete`` left out: no frame is sent, so only the post's own Python is timed): ``warm``, posts
back to back; ``cold``, each after the thread slept ``--idle-ms``. Rows: µs per post, p50 / p90.
"""

from __future__ import annotations

import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from softverbs import addr as am  # noqa: E402
from softverbs import cq as cqm  # noqa: E402
from softverbs import device as dm  # noqa: E402
from softverbs import libibverbs_enums as e  # noqa: E402
from softverbs import mr as mrm  # noqa: E402
from softverbs import pd as pdm  # noqa: E402
from softverbs import qp as qpm  # noqa: E402
from softverbs import soft  # noqa: E402
from softverbs.soft.batch import BATCH_WR_DTYPE, SET_SGE, post_wr_batch  # noqa: E402


def _connected_qp(wrs: int) -> tuple[Any, np.ndarray, list[Any]]:
    """A client QP on one new soft device, connected to a server QP on another, and ``wrs`` 64-byte writes."""
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    ops = int(e.ibv_qp_create_send_ops_flags.IBV_QP_EX_WITH_RDMA_WRITE)
    sides, keep = [], []
    for _ in range(2):
        name = f"softib-post-{uuid.uuid4().hex[:6]}"
        soft.add_device(name, "ib")
        ctx = dm.Context(name=name)
        pd = pdm.PD(ctx)
        mr = mrm.MR(pd, 64 * wrs + 4096, access)
        cq = cqm.CQ(ctx, 4 * wrs)
        cap = qpm.QPCap(max_send_wr=4 * wrs, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
        init = qpm.QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, pd=pd, sq_sig_all=0,
                                comp_mask=int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
                                send_ops_flags=ops)
        qp = qpm.QPEx(ctx, init)
        port = ctx.query_port(1)
        sides.append({"qp": qp, "mr": mr, "lid": port.lid, "mtu": port.active_mtu, "gid": ctx.query_gid(1, 0),
                      "psn": random.getrandbits(24)})
        keep += [ctx, pd, mr, cq, qp]
    for me, peer in (sides, sides[::-1]):
        attr = qpm.QPAttr(port_num=1)
        attr.qp_access_flags, attr.path_mtu, attr.dest_qp_num = access, me["mtu"], peer["qp"].qp_num
        attr.rq_psn, attr.sq_psn = peer["psn"], me["psn"]
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.ah_attr = am.AHAttr(port_num=1, is_global=1, gr=am.GlobalRoute(dgid=peer["gid"], sgid_index=0),
                                 dlid=peer["lid"])
        me["qp"].to_rts(attr)
    client, server = sides
    rows = np.zeros(wrs, dtype=BATCH_WR_DTYPE)
    rows["wr_id"] = np.arange(wrs)
    rows["opcode"], rows["setters"] = 0, SET_SGE  # IBV_WR_RDMA_WRITE, one SGE
    rows["sge_addr"] = client["mr"].buf + 64 * np.arange(wrs)
    rows["sge_length"], rows["sge_lkey"] = 64, client["mr"].lkey
    rows["raddr"], rows["rkey"] = server["mr"].buf + 64 * np.arange(wrs), server["mr"].rkey
    return client["qp"], rows, keep


def measure(wrs: int, posts: int, idle_ms: float) -> list[dict[str, Any]]:
    qp, rows, keep = _connected_qp(wrs)
    core = qp._core
    core.wr_complete = lambda: 0  # the list is built and checked, then dropped: no frame, no completion
    wire = rows.tobytes()  # as the verbs shim hands it over

    def once() -> float:
        start = time.perf_counter_ns()
        post_wr_batch(qp, wire)
        core.wr_list = None
        return (time.perf_counter_ns() - start) / 1e3

    out = []
    try:
        for mode in ("warm", "cold"):
            took = []
            for i in range(posts + 10):
                if mode == "cold":
                    time.sleep(idle_ms / 1e3)
                t = once()
                if i >= 10:
                    took.append(t)
            took.sort()
            out.append({"mode": mode, "wrs": wrs, "posts": posts, "idle_ms": idle_ms if mode == "cold" else 0.0,
                        "p50_us": round(took[len(took) // 2], 1), "p90_us": round(took[9 * len(took) // 10], 1)})
    finally:
        for obj in reversed(keep):
            obj.close()
    return out


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--wrs", type=click.IntRange(min=1, max=1024), default=12, show_default=True,
              help="writes a post (a MoE dispatch's post to one peer: 12)")
@click.option("--posts", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--idle-ms", type=click.FloatRange(min=0.0, max=1000.0), default=20.0, show_default=True,
              help="how long the thread sleeps before each cold post")
def main(json_path: str | None, wrs: int, posts: int, idle_ms: float) -> None:
    rows = measure(wrs, posts, idle_ms)
    click.echo(f"post_wr_batch of {wrs} RDMA writes (its Python, no frame sent)")
    for r in rows:
        click.echo(f"  {r['mode']:>4}  p50 {r['p50_us']:8.1f} µs  p90 {r['p90_us']:8.1f} µs")
    if json_path:
        summary = {f"{r['mode']}_p50_us": r["p50_us"] for r in rows}
        Path(json_path).write_text(json.dumps({"benchmark": "post_cold", "rows": rows, "summary": summary},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
