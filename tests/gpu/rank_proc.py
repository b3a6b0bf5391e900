"""One GPU client process (one rank) driven by a GPU test over stdin/stdout, one JSON line per step.

Steps: ``setup`` (connect, join, GPU buffers from PyTorch / CuPy / DLPack, register, flags, publish),
``exchange`` (wait for the job, open a channel, build the kernel handle, compile the test kernels),
``recv`` (launch the verifying kernel, which waits chunk by chunk), ``send`` (launch the streaming kernel,
then QUIET and the error word from a kernel), ``finish`` (wait for the verifier, report), ``bad`` (a bad
command between good ones; the kernel reads tpd::status), ``wait_flag`` and ``leave``.
Replies are ``@@{json}`` lines so library output on stdout cannot be mistaken for one.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(ROOT))

import gpuclient  # noqa: E402
from gpuclient.cuda_memory import DeviceMemory, check, driver, use_device  # noqa: E402

KERNELS = Path(__file__).with_name("kernels.cu")
DEFINES = {"TPD_SPIN_TIMEOUT_NS": "20000000000ull"}


class DLPackOnly:
    """Exposes a CuPy array through DLPack alone, so registration takes the DLPack path."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


class CudaArray:
    """A bare ``__cuda_array_interface__`` over our own allocation (when neither CuPy nor PyTorch is there)."""

    def __init__(self, nbytes: int) -> None:
        self.memory = DeviceMemory(nbytes, 0)
        self.__cuda_array_interface__ = {"shape": (nbytes // 4,), "typestr": "<u4", "data": (self.memory.ptr, False),
                                         "version": 3}


def _alloc(kind: str, nbytes: int) -> tuple[Any, Any, int]:
    """(object to register, object to keep, device pointer)."""
    if kind == "torch":
        try:
            import torch

            t = torch.zeros(nbytes // 4, dtype=torch.int32, device="cuda:0")
            return t, t, int(t.data_ptr())
        except ImportError:
            kind = "cupy"
    if kind in ("cupy", "dlpack"):
        try:
            import cupy

            with cupy.cuda.Device(0):
                a = cupy.zeros(nbytes // 4, dtype=cupy.uint32)
            return (DLPackOnly(a) if kind == "dlpack" else a), a, int(a.data.ptr)
        except ImportError:
            pass
    c = CudaArray(nbytes)
    return c, c, c.memory.ptr


class Rank:
    def __init__(self) -> None:
        self.keep: list[Any] = []
        self.stream = None

    def setup(self, socket: str, job: str, rank: int, world: int, nbytes: int, flags: int, where: str,
              src_kind: str, dst_kind: str, device: int = 0) -> dict[str, Any]:
        # device: the node's GPU index given to join (it picks the rail); a process narrowed to that GPU by
        # CUDA_VISIBLE_DEVICES still allocates on its CUDA device 0
        use_device(0)
        self.client = gpuclient.connect(socket, timeout=30)
        self.session = self.client.join(job, rank=rank, world=world, device=device)
        src_obj, src_keep, self.src_ptr = _alloc(src_kind, nbytes)
        dst_obj, dst_keep, self.dst_ptr = _alloc(dst_kind, nbytes)
        self.keep += [src_keep, dst_keep]
        self.src = self.session.register(src_obj, access=("read", "write"))
        self.dst = self.session.register(dst_obj, access=("read", "write"))
        self.flags = self.session.flags(flags, where=where)
        self.session.exchange(wait=False)
        self.out = DeviceMemory(64, 0)
        return {"src": self.src.id, "dst": self.dst.id, "src_via": type(src_obj).__name__,
                "dst_via": type(dst_obj).__name__, "flags": type(self.flags).__name__,
                "rail": self.session.info.get("rail")}

    def exchange(self, capacity: int, kind: str = "ring") -> dict[str, Any]:
        # kind "ibgda": the same kernels built with -DTPD_IBGDA post to the daemon's queue pairs themselves
        self.session.exchange(timeout=60)
        self.channel = self.session.channel(capacity, kind=kind)
        self.handle = self.channel.device_handle(0)
        defines = {**DEFINES, "TPD_IBGDA": 1} if kind == "ibgda" else DEFINES
        self.module = gpuclient.compile(KERNELS.read_text(), device=0, debug=True, defines=defines, name="kernels.cu")
        drv = driver()
        self.stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return {"channel": self.channel.id, "handle": self.handle.bytes.hex()}

    def _sync(self, stream: Any = None) -> None:
        drv = driver()
        check(drv.cuCtxSynchronize() if stream is None else drv.cuStreamSynchronize(stream), "synchronize")

    def _out(self, n: int, dtype: str = "<u4") -> list[int]:
        return [int(v) for v in np.frombuffer(self.out.read(0, 4 * n if dtype == "<u4" else 8 * n), dtype=dtype)]

    def recv(self, chunk: int, nchunks: int, epoch: int) -> dict[str, Any]:
        self.out.write(0, bytes(64))
        self.module.function("verify_chunks").launch(
            min(nchunks, 132), 256, (self.handle, np.uint64(self.dst_ptr), np.uint32(chunk), np.uint32(nchunks),
                                     np.uint32(epoch), np.uint64(self.out.ptr)), stream=self.stream)
        return {"launched": True}

    def send(self, peer: int, dst_region: int, chunk: int, nchunks: int, epoch: int) -> dict[str, Any]:
        status = DeviceMemory(16, 0)
        try:
            self.module.function("stream_chunks").launch(
                min(nchunks, 132), 256, (self.handle, np.uint64(self.src_ptr), np.uint32(peer), np.uint32(self.src.id),
                                         np.uint32(dst_region), np.uint32(chunk), np.uint32(nchunks),
                                         np.uint32(epoch)))
            self.module.function("quiet_status").launch(1, 1, (self.handle, np.uint64(status.ptr)))
            self._sync()
            code, count, position = np.frombuffer(status.read(0, 12), dtype="<u4")
        finally:
            status.free()
        return {"status": int(code), "count": int(count), "position": int(position), "head": self._head(),
                "host_status": list(self.channel.status())}

    def send_paced(self, peer: int, dst_region: int, chunk: int, nchunks: int, epoch: int,
                   gap_us: int) -> dict[str, Any]:
        """Launch stream_paced and the QUIET after it on this rank's stream and return at once (the kernel runs
        on while the test restarts a daemon); ``send_finish`` waits for it."""
        self.out.write(0, bytes(64))
        self.module.function("stream_paced").launch(
            1, 256, (self.handle, np.uint64(self.src_ptr), np.uint32(peer), np.uint32(self.src.id),
                     np.uint32(dst_region), np.uint32(chunk), np.uint32(nchunks), np.uint32(epoch),
                     np.uint64(gap_us * 1000)), stream=self.stream)
        self.module.function("quiet_status").launch(1, 1, (self.handle, np.uint64(self.out.ptr + 32)),
                                                    stream=self.stream)
        return {"launched": True}

    def head(self) -> dict[str, Any]:
        """Ring positions the running kernel has claimed so far."""
        return {"head": self._head()}

    def send_finish(self) -> dict[str, Any]:
        self._sync(self.stream)
        code, count, position = self._out(11)[8:11]
        return {"status": code, "count": count, "position": position, "head": self._head(),
                "host_status": list(self.channel.status())}

    def reattached(self) -> dict[str, Any]:
        r = self.session.reattach
        return {"count": r.count, "state": r.state, "error": r.error}

    def flag_values(self, count: int) -> dict[str, Any]:
        return {"values": [int(self.flags[i]) for i in range(count)]}

    def _head(self) -> int | None:
        """Ring positions claimed by kernels (None for an IBGDA channel: it has no ring)."""
        return self.handle.head() if hasattr(self.handle, "head") else None

    def finish(self) -> dict[str, Any]:
        self._sync(self.stream)
        bad, chunks = self._out(2)
        return {"bad_words": bad, "chunks": chunks}

    def bad(self, peer: int, dst_region: int, slot: int) -> dict[str, Any]:
        self.out.write(0, bytes(64))
        self.module.function("bad_then_good").launch(
            1, 1, (self.handle, np.uint32(peer), np.uint32(self.src.id), np.uint32(dst_region), np.uint32(slot),
                   np.uint64(self.out.ptr)))
        self._sync()
        code, count, position = self._out(3)
        return {"status": code, "count": count, "position": position, "host_status": list(self.channel.status())}

    def wait_flag(self, slot: int, at_least: int) -> dict[str, Any]:
        self.out.write(0, bytes(64))
        self.module.function("wait_flag").launch(1, 1, (self.handle, np.uint32(slot), np.uint64(at_least),
                                                        np.uint64(self.out.ptr)))
        self._sync()
        return {"value": self._out(1, "<u8")[0], "host_value": self.session.wait(slot, at_least, timeout=5)}

    def leave(self) -> dict[str, Any]:
        self.session.leave()
        self.client.close()
        return {"left": True}


def main() -> None:
    rank = Rank()
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        step = msg.pop("step")
        try:
            reply = {"ok": True, **getattr(rank, step)(**msg)}
        except Exception as exc:  # report, keep serving: the test decides
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        sys.stdout.write("@@" + json.dumps(reply) + "\n")
        sys.stdout.flush()
        if step == "leave":
            break


if __name__ == "__main__":
    main()
