"""Running a kernel harness under Triton's interpreter, in a process of its own (``TRITON_INTERPRET=1`` must be
set before Triton decorates the kernels, so the harness cannot run in the test's process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, *args: object, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root with the interpreter on; output captured as text."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
