"""Two daemons, two GPU client processes on one GPU: kernel A streams chunks with put_signal, kernel B waits
chunk by chunk and verifies; RC (write / atomic / fence under adaptive routing) and SRD; device and
host-mapped flags; a ring far smaller than the commands (backpressure); a bad command read by the kernel."""

from __future__ import annotations

import pytest

from tests.support.rank_process import SLOW_START, RankProcess
from transportd.errors import ErrorCode

TRANSPORTS = [
    pytest.param("ib", "write", False, "device", "ring", id="rc-write-devflags"),
    pytest.param("ib", "write", False, "host", "ring", id="rc-write-hostflags"),
    pytest.param("ib", "atomic", True, "device", "ring", id="rc-ar-atomic-devflags"),
    pytest.param("ib", "fence", True, "device", "ring", id="rc-ar-fence-devflags"),
    pytest.param("efa", "write", False, "device", "ring", id="srd-devflags"),
    pytest.param("efa", "write", False, "host", "ring", id="srd-hostflags"),
    # the same kernels built with -DTPD_IBGDA, posting to the daemon's queue pairs themselves
    pytest.param("ib", "write", False, "device", "ibgda", id="ibgda-rc-write-devflags"),
    pytest.param("ib", "write", False, "host", "ibgda", id="ibgda-rc-write-hostflags"),
    pytest.param("ib", "atomic", True, "device", "ibgda", id="ibgda-rc-ar-atomic-devflags"),
    pytest.param("ib", "fence", True, "device", "ibgda", id="ibgda-rc-ar-fence-devflags"),
]

CHUNK = 64 << 10
NCHUNKS = 48
CAPACITY = 16  # far fewer slots than the commands of one launch: the kernel feels backpressure
SLOTS = NCHUNKS + 8


@pytest.mark.parametrize(("backend", "mode", "ar", "where", "kind"), TRANSPORTS)
def test_kernel_streams_chunks_and_peer_kernel_verifies(cuda_device, cluster_factory, backend: str, mode: str,
                                                         ar: bool, where: str, kind: str) -> None:
    cluster = cluster_factory(backend=backend, overrides={
        "signal": {"mode": mode}, "softverbs": {"adaptive_routing": ar, "reorder_seed": 7}, **SLOW_START})
    a, b = RankProcess(), RankProcess()
    try:
        setup = {"job": "gpujob", "world": 2, "nbytes": CHUNK * NCHUNKS, "flags": SLOTS, "where": where}
        a.send("setup", socket=cluster.socket(cluster.names[0]), rank=0, src_kind="torch", dst_kind="cupy", **setup)
        b.send("setup", socket=cluster.socket(cluster.names[1]), rank=1, src_kind="cupy", dst_kind="dlpack", **setup)
        ra, rb = a.reply(), b.reply()
        assert rb["dst_via"] == "DLPackOnly" and ra["flags"] == ("DeviceFlags" if where == "device" else "FlagArray")
        a.send("exchange", capacity=CAPACITY, kind=kind)
        b.send("exchange", capacity=CAPACITY, kind=kind)
        a.reply(), b.reply()
        ring = kind == "ring"
        for epoch in (1, 2):  # flags are monotonic: the second launch waits for 2, no reset in between
            b.call("recv", chunk=CHUNK, nchunks=NCHUNKS, epoch=epoch)
            sent = a.call("send", peer=1, dst_region=rb["dst"], chunk=CHUNK, nchunks=NCHUNKS, epoch=epoch)
            assert sent["status"] == 0 and sent["host_status"] == ([0, 0, 0] if ring else [0, 0]), sent
            if ring:
                assert sent["head"] == epoch * (NCHUNKS + 1)  # every put_signal and the QUIET claimed a slot
            done = b.call("finish")
            assert done == {"ok": True, "bad_words": 0, "chunks": NCHUNKS}, done
        # a bad command from a kernel: refused (by the proxy, or by the device code on the IBGDA path),
        # read by the kernel with tpd::status; the good put_signal right after it is still delivered
        bad = a.call("bad", peer=1, dst_region=rb["dst"], slot=NCHUNKS + 1)
        assert bad["status"] == ErrorCode.BAD_REGION and bad["count"] == 1, bad
        position = 2 * (NCHUNKS + 1) if ring else 0  # IBGDA commands have no ring position
        assert bad["position"] == position
        assert bad["host_status"] == ([ErrorCode.BAD_REGION, 1, position] if ring else [ErrorCode.BAD_REGION, 1])
        seen = b.call("wait_flag", slot=NCHUNKS + 1, at_least=1)
        assert seen["value"] == 1 and seen["host_value"] == 1
    except BaseException:
        for name in cluster.names:  # the daemons' side of the story, in the test's output
            print(f"--- {name} log ---\n{cluster.log(name)}")
        raise
    finally:
        a.close()
        b.close()
