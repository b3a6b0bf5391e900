"""Importing a context, a PD and an MR from another context (ibv_import_device / _pd / _mr), and the rules
softverbs keeps for them: handles are per context, the keys are the exporter's and work while its objects
live, and an import needs the command descriptor itself. In this process an import shares the exporter's
engine; the child-process test goes through the exporter's link (bytes, notices) as a client does."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from tests.support.verbs_resources import RCPair, open_provider, poll, raises_errno
from tests.support.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def soft():
    return open_provider("soft")


class Exporter:
    """A context on softib0 with a PD and a source MR over numpy memory of this process."""

    def __init__(self, v: Any) -> None:
        self.v = v
        self.ctx = v.device.Context(name="softib0")
        self.pd = v.pd.PD(self.ctx)
        self.src = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
        acc = int(v.enums.IBV_ACCESS_LOCAL_WRITE)
        self.mr = v.mr.MR(self.pd, self.src.nbytes, acc, address=int(self.src.ctypes.data))

    def close(self) -> None:
        self.ctx.close()


def _rc_qp(v: Any, ctx: Any, pd: Any) -> tuple[Any, Any]:
    e = v.enums
    cq = v.cq.CQ(ctx, 64)
    cap = v.qp.QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
    return v.qp.QP(pd, init), cq


def _to_rts(v: Any, qp: Any, remote: dict[str, Any]) -> None:
    attr = v.qp.QPAttr(port_num=1)
    attr.qp_access_flags = int(v.enums.IBV_ACCESS_REMOTE_WRITE)
    attr.path_mtu = int(v.enums.IBV_MTU_1024)
    attr.dest_qp_num, attr.rq_psn, attr.sq_psn = remote["qpn"], 0, 0
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    gr = v.addr.GlobalRoute(dgid=v.addr.GID(remote["gid"]), sgid_index=0)
    attr.ah_attr = v.addr.AHAttr(port_num=1, is_global=1, gr=gr, dlid=remote["lid"])
    qp.to_rts(attr)


def _write(v: Any, qp: Any, lkey: int, addr: int, n: int, rkey: int, raddr: int, wr_id: int = 1) -> None:
    e = v.enums
    wr = v.wr.SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[v.wr.SGE(addr, n, lkey)],
                     send_flags=int(e.IBV_SEND_SIGNALED))
    wr.set_wr_rdma(rkey, raddr)
    qp.post_send(wr)


def _endpoint(ctx: Any, qp: Any) -> dict[str, Any]:
    return {"qpn": qp.qp_num, "gid": str(ctx.query_gid(1, 0).gid), "lid": ctx.query_port(1).lid}


def test_imported_mr_has_the_exporters_keys_and_bytes(soft) -> None:
    v = soft.v
    ex = Exporter(v)
    try:
        ctx = v.device.Context(cmd_fd=os.dup(ex.ctx.cmd_fd))
        pd = v.pd.PD(ctx, handle=ex.pd.handle)
        mr = v.mr.MR(pd, handle=ex.mr.handle)
        assert (mr.lkey, mr.rkey, mr.length, mr.handle) == (ex.mr.lkey, ex.mr.rkey, ex.mr.length, ex.mr.handle)
        assert mr.buf == 0  # as pyverbs: the importer is not told the address; it may pass it in
        assert v.mr.MR(pd, handle=ex.mr.handle, address=ex.mr.buf).buf == ex.mr.buf
        assert pd.handle == ex.pd.handle and ctx.name == "softib0"
        assert mr.read(16, 100) == ex.src[100:116].tobytes()
        mr.write(b"imported", 8, 0)
        assert ex.src[:8].tobytes() == b"imported"  # the bytes are the exporter's
        raises_errno(v, errno.EOPNOTSUPP, v.mr.MR, pd, 64, int(v.enums.IBV_ACCESS_LOCAL_WRITE))
        mr.unimport()
        pd.unimport()
        assert ex.mr.read(8, 0) == b"imported"  # unimporting leaves the exporter's objects alone
        ctx.close()
    finally:
        ex.close()


def test_handles_are_per_context_and_an_mr_imports_only_on_its_pd(soft) -> None:
    v = soft.v
    ex = Exporter(v)
    other = v.device.Context(name="softib0")  # same device, another context
    try:
        other_pd = v.pd.PD(other)
        other_mr = v.mr.MR(other_pd, 64, int(v.enums.IBV_ACCESS_LOCAL_WRITE))
        second_pd = v.pd.PD(ex.ctx)
        ctx = v.device.Context(cmd_fd=os.dup(ex.ctx.cmd_fd))
        raises_errno(v, errno.EINVAL, v.pd.PD, ctx, handle=other_pd.handle + 1000)
        pd = v.pd.PD(ctx, handle=ex.pd.handle)
        raises_errno(v, errno.EINVAL, v.mr.MR, pd, handle=other_mr.handle)  # another context's MR
        pd2 = v.pd.PD(ctx, handle=second_pd.handle)
        raises_errno(v, errno.EINVAL, v.mr.MR, pd2, handle=ex.mr.handle)  # not on that PD
        ctx.close()
    finally:
        other.close()
        ex.close()


def test_a_qp_on_the_imported_pd_writes_from_the_exporters_memory_until_the_mr_is_gone(soft) -> None:
    v, e = soft.v, soft.v.enums
    ex = Exporter(v)
    with RCPair(soft, "softib0", connect=False) as far:
        try:
            ctx = v.device.Context(cmd_fd=os.dup(ex.ctx.cmd_fd))
            pd = v.pd.PD(ctx, handle=ex.pd.handle)
            src = v.mr.MR(pd, handle=ex.mr.handle, address=ex.mr.buf)
            qp, cq = _rc_qp(v, ctx, pd)
            qp.to_init(_init_attr(v))
            far.server.qp.to_init(_init_attr(v))
            _to_rts(v, qp, _endpoint(far.ctx, far.server.qp))
            _to_rts(v, far.server.qp, _endpoint(ctx, qp))
            _write(v, qp, src.lkey, src.buf, 4096, far.server.mr.rkey, far.server.mr.buf)
            (wc,) = poll(cq)
            assert wc.status == e.IBV_WC_SUCCESS
            assert far.server.read_buf(0, 4096) == ex.src.tobytes()
            ex.mr.close()  # the exporter deregisters: the imported keys stop working
            wait_until(lambda: not src._core.valid, "the importer to hear that the MR is gone")
            _write(v, qp, src.lkey, src.buf, 64, far.server.mr.rkey, far.server.mr.buf, wr_id=2)
            (wc,) = poll(cq)
            assert wc.status == e.IBV_WC_LOC_PROT_ERR and qp.qp_state == e.IBV_QPS_ERR
            ctx.close()
        finally:
            ex.close()


def _init_attr(v: Any) -> Any:
    attr = v.qp.QPAttr(port_num=1)
    attr.qp_access_flags = int(v.enums.IBV_ACCESS_REMOTE_WRITE)
    attr.pkey_index = 0
    return attr


def test_closing_the_exporting_context_takes_what_was_imported(soft) -> None:
    v = soft.v
    ex = Exporter(v)
    fd = os.dup(ex.ctx.cmd_fd)
    spare = os.dup(fd)
    ctx = v.device.Context(cmd_fd=fd)
    pd = v.pd.PD(ctx, handle=ex.pd.handle)
    mr = v.mr.MR(pd, handle=ex.mr.handle)
    ex.close()
    wait_until(lambda: pd._gone and not mr._core.valid, "the importer to hear that the context closed")
    raises_errno(v, errno.EINVAL, _rc_qp, v, ctx, pd)  # a PD imported from a closed context is gone
    raises_errno(v, errno.ENODEV, v.pd.PD, ctx, handle=ex.pd.handle)
    raises_errno(v, errno.ENODEV, v.device.Context, cmd_fd=spare)  # the descriptor leads nowhere now
    ctx.close()


CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from tests.support.verbs_resources import open_provider, poll
    from tests.support.waiting import wait_until
    from tests.softverbs.test_import import _rc_qp, _init_attr, _to_rts, _write, _endpoint
    v = open_provider("soft").v
    fd, pd_handle, mr_handle, addr = (int(x) for x in sys.argv[1:5])
    ctx = v.device.Context(cmd_fd=fd)
    pd = v.pd.PD(ctx, handle=pd_handle)
    mr = v.mr.MR(pd, handle=mr_handle, address=addr)  # the exporter's address: the NIC's view of the bytes
    qp, cq = _rc_qp(v, ctx, pd)
    qp.to_init(_init_attr(v))
    print(json.dumps(_endpoint(ctx, qp)), flush=True)
    far = json.loads(sys.stdin.readline())
    _to_rts(v, qp, far)
    _write(v, qp, mr.lkey, mr.buf, mr.length, far["rkey"], far["addr"])
    (wc,) = poll(cq)
    print(json.dumps({"status": int(wc.status)}), flush=True)
    sys.stdin.readline()  # the exporter has closed the MR since
    heard = wait_until(lambda: not mr._core.valid, "the exporter's notice that the MR is gone")
    _write(v, qp, mr.lkey, mr.buf, 64, far["rkey"], far["addr"], wr_id=2)
    (wc,) = poll(cq)
    print(json.dumps({"status": int(wc.status), "heard": heard}), flush=True)
    ctx.close()
""")


def test_another_process_imports_with_the_descriptor_and_writes_from_the_exporters_memory(soft) -> None:
    v, e = soft.v, soft.v.enums
    ex = Exporter(v)
    try:
        with RCPair(soft, "softib0", connect=False) as far:
            fd = os.dup(ex.ctx.cmd_fd)
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(fd), str(ex.pd.handle), str(ex.mr.handle),
                                      str(ex.mr.buf)],
                                     pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
            os.close(fd)
            try:
                theirs = json.loads(child.stdout.readline())
                far.server.qp.to_init(_init_attr(v))
                _to_rts(v, far.server.qp, theirs)
                child.stdin.write(json.dumps({**_endpoint(far.ctx, far.server.qp), "rkey": far.server.mr.rkey,
                                              "addr": far.server.mr.buf}) + "\n")
                child.stdin.flush()
                assert json.loads(child.stdout.readline())["status"] == e.IBV_WC_SUCCESS
                assert far.server.read_buf(0, 4096) == ex.src.tobytes()
                ex.mr.close()  # keys stay valid while the exporter's MR lives, and no longer
                child.stdin.write("again\n")
                child.stdin.flush()
                assert json.loads(child.stdout.readline())["status"] == e.IBV_WC_LOC_PROT_ERR
            finally:
                child.stdin.close()
                assert child.wait(30) == 0
    finally:
        ex.close()


def test_the_command_descriptor_has_no_name_to_reach_it_by(soft) -> None:
    v = soft.v
    ex = Exporter(v)
    try:
        sock = socket.socket(fileno=os.dup(ex.ctx.cmd_fd))
        assert sock.getsockname() in ("", b"")  # unnamed: not in the filesystem, not in the abstract namespace
        sock.close()
        r, w = os.pipe()
        os.close(w)
        raises_errno(v, errno.EINVAL, v.device.Context, cmd_fd=r)  # not a context's descriptor
    finally:
        ex.close()
