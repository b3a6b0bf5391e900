"""ibgda.devx against rdma-core 59 without a ConnectX: every C symbol it calls exists in the built
libibverbs/libmlx5 (with the pyverbs build .ci/build_pyverbs.sh makes), the struct layouts and constants
its ctypes declarations assume are the headers' (a probe compiled with the tree's headers), and an import
of a descriptor that is not a device's fails with errno and closes the descriptor. The calls themselves run
on a ConnectX only: tests/ibgda/test_import_hardware.py."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
from pathlib import Path

import pytest

from ibgda import devx
from ibgda.errors import Mlx5QueueError

REQUIRE = os.environ.get("TRANSPORTD_REQUIRE_PYVERBS", "") == "1"


def _skip_or_fail(why: str) -> None:
    if REQUIRE:
        pytest.fail(f"TRANSPORTD_REQUIRE_PYVERBS=1 but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def libs() -> dict[str, ctypes.CDLL]:
    try:
        return devx.libraries()
    except Mlx5QueueError as exc:
        _skip_or_fail(f"rdma-core's libraries are not loadable ({exc}); build them with .ci/build_pyverbs.sh "
                      "and put its build/lib on LD_LIBRARY_PATH")
        raise


def _tree() -> Path:
    root = os.environ.get("TRANSPORTD_RDMA_CORE_TREE") or ""
    if not root:
        path = os.environ.get("TRANSPORTD_PYVERBS_PATH", "")
        root = path.removesuffix("/build/python") if path else ""
    tree = Path(root) if root else Path("/nonexistent")
    if not (tree / "build" / "include" / "infiniband" / "mlx5dv.h").is_file():
        _skip_or_fail(f"no rdma-core build tree with headers at {tree} (set TRANSPORTD_RDMA_CORE_TREE)")
    return tree


def test_every_symbol_exists_in_the_built_libraries(libs: dict[str, ctypes.CDLL]) -> None:
    for key, names in devx.SIGNATURES.items():
        for name in names:
            assert hasattr(libs[key], name), f"{name} missing from {key}"


PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <infiniband/mlx5dv.h>
#define P(name, value) printf("%s %lu\n", name, (unsigned long)(value))
int main(void) {
    P("uar.size", sizeof(struct mlx5dv_devx_uar));
    P("uar.reg_addr", offsetof(struct mlx5dv_devx_uar, reg_addr));
    P("uar.base_addr", offsetof(struct mlx5dv_devx_uar, base_addr));
    P("uar.page_id", offsetof(struct mlx5dv_devx_uar, page_id));
    P("uar.mmap_off", offsetof(struct mlx5dv_devx_uar, mmap_off));
    P("uar.comp_mask", offsetof(struct mlx5dv_devx_uar, comp_mask));
    P("umem.umem_id", offsetof(struct mlx5dv_devx_umem, umem_id));
    P("pd.size", sizeof(struct mlx5dv_pd));
    P("pd.pdn", offsetof(struct mlx5dv_pd, pdn));
    P("obj.size", sizeof(struct mlx5dv_obj));
    P("obj.pd.in", offsetof(struct mlx5dv_obj, pd.in));
    P("obj.pd.out", offsetof(struct mlx5dv_obj, pd.out));
    P("MLX5DV_OBJ_PD", MLX5DV_OBJ_PD);
    P("UAR_BF", MLX5DV_UAR_ALLOC_TYPE_BF);
    P("UAR_NC", MLX5DV_UAR_ALLOC_TYPE_NC);
    return 0;
}
"""


def test_struct_layouts_and_constants_match_the_headers(tmp_path: Path) -> None:
    tree = _tree()
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(PROBE)
    subprocess.run(["cc", "-I", str(tree / "build" / "include"), str(src), "-o", str(exe)], check=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                        text=True).stdout.splitlines())
    got = {k: int(v) for k, v in got.items()}
    uar, obj = devx.MlxDevxUar, devx.MlxObj
    assert got["uar.size"] == ctypes.sizeof(uar)
    for field in ("reg_addr", "base_addr", "page_id", "mmap_off", "comp_mask"):
        assert got[f"uar.{field}"] == getattr(uar, field).offset, field
    assert got["umem.umem_id"] == devx.MlxDevxUmem.umem_id.offset
    assert (got["pd.size"], got["pd.pdn"]) == (ctypes.sizeof(devx.MlxPd), devx.MlxPd.pdn.offset)
    assert got["obj.size"] == ctypes.sizeof(obj)
    assert got["obj.pd.in"] == obj.pd.offset + devx._InOut.in_.offset
    assert got["obj.pd.out"] == obj.pd.offset + devx._InOut.out.offset
    assert (got["MLX5DV_OBJ_PD"], got["UAR_BF"], got["UAR_NC"]) == (devx.MLX5DV_OBJ_PD, devx.UAR_ALLOC_TYPE_BF,
                                                                    devx.UAR_ALLOC_TYPE_NC)


def test_importing_a_descriptor_that_is_no_device_fails_and_closes_it(libs: dict[str, ctypes.CDLL]) -> None:
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(Mlx5QueueError, match=r"ibv_import_device.*errno"):
        devx.DevxContext.imported(r, 1)
    with pytest.raises(OSError) as info:
        os.fstat(r)  # owned and closed, as ibv_import_device's descriptor is on success
    assert info.value.errno == errno.EBADF
