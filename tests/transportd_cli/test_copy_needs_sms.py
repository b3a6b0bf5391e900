"""benchmarks/copy_needs_sms.py's options: refused before any CUDA call (the run itself needs a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "copy_needs_sms.py"


def _bench():
    spec = importlib.util.spec_from_file_location("copy_needs_sms", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("args", "option"), [
    (["--wait-ms", "nan"], "--wait-ms"),  # NaN would end every wait at once and report "not complete"
    (["--wait-ms", "inf"], "--wait-ms"),
    (["--wait-ms", "0.5"], "--wait-ms"),
    (["--blocks", "0"], "--blocks"),
])
def test_bad_options_are_refused(args: list[str], option: str) -> None:
    result = CliRunner().invoke(_bench().main, args)
    assert result.exit_code == 2 and option in result.output, result.output
