"""GPU tests: skipped with the reason when no CUDA device (or no cuda-python) is present; all marked ``gpu``.

CUDA MPS: where ``nvidia-cuda-mps-control`` exists, a private MPS daemon is started when this conftest is
loaded (before anything here creates a CUDA context: a context made earlier is not an MPS client) and
stopped at the end; the daemons, rail workers and rank processes the tests start inherit its
``CUDA_MPS_*`` variables. The run's header and summary say whether it ran. ``TRANSPORTD_GPU_MPS=0`` runs
without it (``tests/support/mps.py``, ``transportd_cli.mps``); a run that deselects GPU tests starts nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import started_clusters
from tests.support.cuda import gpu_unavailable
from tests.support.mps import (  # noqa: F401  (hooks: the run's MPS daemon)
    pytest_configure,
    pytest_report_header,
    pytest_terminal_summary,
    pytest_unconfigure,
)

KERNELS = Path(__file__).with_name("kernels.cu")
DEBUG_DEFINES = {"TPD_SPIN_TIMEOUT_NS": "20000000000ull"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def cuda_device() -> int:
    reason = gpu_unavailable()
    if reason:
        pytest.skip(reason)
    from gpuclient.cuda_memory import use_device

    use_device(0)
    return 0


@pytest.fixture(scope="session")
def kernels(cuda_device: int) -> Any:
    import gpuclient

    return gpuclient.compile(KERNELS.read_text(), device=cuda_device, debug=True, defines=DEBUG_DEFINES,
                             name="kernels.cu")


@pytest.fixture
def cluster_factory() -> Iterator[Any]:
    with started_clusters() as make:
        yield make
