"""A benchmark script (``benchmarks/<name>.py``) loaded as a module, for the tests of its pure parts and CLI."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` executed afresh as module ``name``, and registered in ``sys.modules`` under it
    (a benchmark's dataclasses look their module up there; a benchmark that imports another by name finds it)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
