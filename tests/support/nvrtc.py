"""Skip NVRTC compile checks, with the reason, where cuda-python or the NVRTC library is missing."""

from __future__ import annotations

from typing import Any

import pytest


def nvrtc_or_skip() -> Any:
    """The ``cuda.bindings.nvrtc`` module, or a skip saying what to install (CI installs both)."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - ImportError, or the NVRTC library missing
        pytest.skip(f"NVRTC not available here ({type(exc).__name__}): install cuda-python and nvidia-cuda-nvrtc")
    return nvrtc
