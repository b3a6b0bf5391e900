"""IBGDA test fixtures: the device header compiled for the host (ctypes), and soft mlx5 queue pairs.

``host_lib`` is tests/ibgda/host_lib.cpp built with g++ against the real headers: the tests drive the
soft NIC with bytes and calls from the device code itself. ``make_link`` connects a sender queue
(rank 0) to a receiver queue (rank 1) on two soft devices and builds a ``tpd::IbgdaChannel`` over
host memory, so the channel functions run exactly as a kernel would run them.
"""

from __future__ import annotations

import ctypes
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ibgda.soft_mlx5 import SoftMlx5Queue
from tests.support.ibgda_link import DATA_BYTES, IBGDA_TESTS, NFLAGS, SIGNATURES, Link, compiler, include_flags
from tests.support.mps import (  # noqa: F401  (hooks: the run's CUDA MPS daemon for the GPU tests here)
    pytest_configure,
    pytest_report_header,
    pytest_terminal_summary,
    pytest_unconfigure,
)
from tests.support.soft_backend import verbs  # noqa: F401  (the fixture)


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ibgda-build")


@pytest.fixture(scope="session")
def host_lib(build_dir: Path) -> ctypes.CDLL:
    out = build_dir / "libtpd_ibgda_host.so"
    subprocess.run([compiler(), "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
                    *include_flags(), str(IBGDA_TESTS / "host_lib.cpp"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


@pytest.fixture
def make_link(verbs: Any) -> Iterator[Callable[..., Link]]:  # noqa: F811  (the shared fixture)
    made: list[Link] = []

    def make(*, adaptive_routing: bool = False, seed: int = 1, wqe_cnt: int = 64, packet_size: int | None = None,
             max_inline: int = 64) -> Link:
        tag = uuid.uuid4().hex[:8]
        names = (f"mlx{tag}a", f"mlx{tag}b")
        for name in names:
            verbs.soft.add_device(name, "ib", adaptive_routing=adaptive_routing, reorder_seed=seed,
                                  packet_size=packet_size)
        a = SoftMlx5Queue(names[0], verbs=verbs, wqe_cnt=wqe_cnt, max_inline=max_inline)
        b = SoftMlx5Queue(names[1], verbs=verbs, wqe_cnt=wqe_cnt)
        rng = np.random.default_rng(seed)
        src = rng.integers(0, 256, DATA_BYTES, dtype=np.uint8)
        dst = np.zeros(DATA_BYTES, dtype=np.uint8)
        flags = np.zeros(NFLAGS, dtype=np.uint64)
        scratch = np.zeros(8, dtype=np.uint64)
        link = Link(verbs, a, b, src, dst, flags, scratch,
                    a.register(src.ctypes.data, src.nbytes),
                    b.register(dst.ctypes.data, dst.nbytes, remote_write=True, remote_read=True),
                    b.register(flags.ctypes.data, flags.nbytes, remote_write=True, remote_atomic=True),
                    a.register(scratch.ctypes.data, scratch.nbytes))
        ea, eb = a.endpoint(), b.endpoint()
        a.connect(eb)
        b.connect(ea)
        made.append(link)
        return link

    yield make
    for link in made:
        link.observe(None)
        link.a.close()
        link.b.close()
