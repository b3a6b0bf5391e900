"""transportd/core/verbs_abi.h against the real rdma-core 59 headers: every offset, size and constant the
compiled core relies on (the lists in verbs_abi_members.h) must agree.

The probe (verbs_abi_probe.c) is compiled against ``<tree>/build/include``; the tree is
``TRANSPORTD_RDMA_CORE_TREE`` or the CI cache. Without a tree the test skips, unless
``TRANSPORTD_REQUIRE_PYVERBS=1`` (CI), where a missing tree or compiler fails it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from transportd import _core

ROOT = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).with_name("verbs_abi_probe.c")
REQUIRE = os.environ.get("TRANSPORTD_REQUIRE_PYVERBS", "") == "1"
RDMA_CORE_VERSION = "59.0"


def _include_dir() -> Path | None:
    candidates = []
    if os.environ.get("TRANSPORTD_RDMA_CORE_TREE"):
        candidates.append(Path(os.environ["TRANSPORTD_RDMA_CORE_TREE"]))
    cache = Path(os.environ.get("TRANSPORTD_CACHE", "/var/cache/transportd"))
    candidates.append(cache / f"rdma-core-{RDMA_CORE_VERSION}-py{sysconfig.get_python_version()}" / "rdma-core")
    for tree in candidates:
        inc = tree / "build" / "include"
        if (inc / "infiniband" / "verbs.h").is_file():
            return inc
    return None


def _unavailable(msg: str) -> None:
    if REQUIRE:
        pytest.fail(f"TRANSPORTD_REQUIRE_PYVERBS=1 but {msg}", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def real_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    inc = _include_dir()
    if inc is None:
        _unavailable("no rdma-core tree with build/include/infiniband/verbs.h (set TRANSPORTD_RDMA_CORE_TREE, "
                     "or build it with .ci/build_pyverbs.sh)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _unavailable("no C compiler to build the layout probe")
    exe = tmp_path_factory.mktemp("abi") / "probe"
    subprocess.run([cc, "-std=gnu11", "-I", str(inc), "-I", str(ROOT / "transportd" / "core"), "-o", str(exe),
                    str(PROBE)], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout = {}
    for line in out.splitlines():
        kind, name, value = line.split()
        layout[f"{kind} {name}"] = int(value)
    return layout


def test_every_offset_size_and_constant_agrees_with_rdma_core(real_layout: dict[str, int]) -> None:
    ours = _core.abi_layout()
    assert set(ours) == set(real_layout), "the probe and the extension expand the same lists"
    wrong = {k: (ours[k], real_layout[k]) for k in ours if ours[k] != real_layout[k]}
    assert not wrong, f"verbs_abi.h (ours, rdma-core): {wrong}"


def test_the_lists_cover_what_the_core_calls() -> None:
    """Every function pointer the lowering, the poller and the shim use is in the checked lists."""
    ours = _core.abi_layout()
    for member in ("wr_id", "wr_flags", "wr_start", "wr_complete", "wr_abort", "wr_rdma_write", "wr_rdma_read",
                   "wr_atomic_fetch_add", "wr_set_sge", "wr_set_inline_data"):
        assert f"offset ibv_qp_ex.{member}" in ours
    for member in ("status", "wr_id", "start_poll", "next_poll", "end_poll", "read_vendor_err", "read_opcode"):
        assert f"offset ibv_cq_ex.{member}" in ours
    assert ours["size ibv_qp"] == ours["offset ibv_qp_ex.comp_mask"], "the extended QP embeds the base QP first"
