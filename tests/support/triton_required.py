"""The CPU tests that compile or read Triton code: skipped where Triton is absent, except under CI, which installs
it (``pip install -e '.[cuda,triton]'`` in .ci/run), so a missing install fails there instead of passing by skip."""

from __future__ import annotations

import os

import pytest


def require_triton() -> None:
    """Call at the top of a test module, before its Triton imports."""
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the machine
        if os.environ.get("CI"):
            raise ImportError("CI must install Triton (pip install -e '.[cuda,triton]' in .ci/run)") from None
        pytest.skip("Triton is not installed here: pip install -e '.[triton]' (CI installs it)",
                    allow_module_level=True)
