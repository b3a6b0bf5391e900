"""``transportctl`` from the tests: in this process (click's runner) or as the installed console script."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from transportd_cli.ctl import main as ctl_main


@dataclass
class CtlResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def installed_script(name: str) -> str | None:
    """The console script ``name`` installed next to this interpreter (a venv's bin/), else on PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def ctl(*args: str) -> CtlResult:
    """Run ``transportctl ARGS`` in this process (click's runner): fast, and exercises the same code."""
    kwargs = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {}
    runner = CliRunner(**kwargs)
    result = runner.invoke(ctl_main, list(args), catch_exceptions=False, env={"TRANSPORTD_SOCKET": None})
    return CtlResult(result.exit_code, result.stdout, result.stderr)


def ctl_process(*args: str, prefix: tuple[str, ...] = ()) -> CtlResult:
    """Run the installed ``transportctl`` script in a child process (the real entry point and exit status)."""
    script = installed_script("transportctl")
    if script is None:
        pytest.skip("the transportctl console script is not installed (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k != "TRANSPORTD_SOCKET"}
    proc = subprocess.run([*prefix, script, *args], capture_output=True, text=True, timeout=60, env=env)
    return CtlResult(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line(text: str) -> str:
    lines = text.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip(), f"expected one line, got {text!r}"
    return lines[0]
