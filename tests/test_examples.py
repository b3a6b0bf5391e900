"""The examples, when the setup is missing something (no daemon, no GPU or cuda-python, no launcher): one
line on stderr naming it and exit 1, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("script", "args", "env"), [
    ("launcher_ranks.py", ["--sockets", "ipc:///nonexistent/control.sock"],
     {"TRANSPORTD_JOB": "j", "TRANSPORTD_RANK": "0", "TRANSPORTD_WORLD": "1"}),
    ("launcher_ranks.py", [], {}),
    ("allgather_gemm.py", [], {"CUDA_VISIBLE_DEVICES": ""}),  # no GPU, or no cuda-python: either way refused
])
def test_an_example_that_cannot_run_says_why_in_one_line(script: str, args: list[str], env: dict[str, str]) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRANSPORTD_")}
    base["TRANSPORTD_SOCKET"] = "ipc:///nonexistent/control.sock"  # never the machine's own daemon
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], env=base | env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: ") and "Traceback" not in proc.stderr, proc.stderr
