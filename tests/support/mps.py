"""One private CUDA MPS daemon for a pytest run's GPU tests (transportd_cli.mps), shared by the conftests of
the folders that hold GPU tests (tests/gpu, tests/ibgda): each re-exports these hooks. Started when the
first of them is loaded — before a test makes a CUDA context, which would otherwise not be an MPS client —
unless the run deselects GPU tests (``-m "not gpu"``) or ``TRANSPORTD_GPU_MPS=0``; stopped at the end;
whether it ran is in the run's header and summary."""

from __future__ import annotations

from typing import Any

import pytest

from transportd_cli.mps import Mps

MPS = Mps()
_reported: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    if MPS.ran or "not gpu" in (config.getoption("markexpr", "") or ""):
        return
    MPS.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    MPS.stop()


def pytest_report_header(config: pytest.Config) -> str | None:
    if "header" in _reported:
        return None
    _reported.add("header")
    return MPS.describe()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "summary" not in _reported:  # once, however many conftests re-export this hook
        _reported.add("summary")
        terminalreporter.write_line(MPS.describe())
