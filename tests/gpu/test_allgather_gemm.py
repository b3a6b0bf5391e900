"""The tile-level AllGather+GEMM example runs and matches numpy (RC and SRD)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "allgather_gemm.py"


def _load():
    spec = importlib.util.spec_from_file_location("allgather_gemm_example", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_allgather_gemm_tiles_wait_for_their_chunk_and_match_reference(cuda_device, backend: str) -> None:
    result = _load().run(backend=backend, launches=2, device=cuda_device)
    assert result["ok"], result
    assert [launch["epoch"] for launch in result["launches"]] == [1, 2]
