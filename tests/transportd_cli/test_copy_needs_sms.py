"""benchmarks/copy_needs_sms.py's options: refused before any CUDA call (the run itself needs a GPU)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.support.benchmarks import load_benchmark


@pytest.mark.parametrize(("args", "option"), [
    (["--wait-ms", "nan"], "--wait-ms"),  # NaN would end every wait at once and report "not complete"
    (["--wait-ms", "inf"], "--wait-ms"),
    (["--wait-ms", "0.5"], "--wait-ms"),
    (["--blocks", "0"], "--blocks"),
])
def test_bad_options_are_refused(args: list[str], option: str) -> None:
    result = CliRunner().invoke(load_benchmark("copy_needs_sms").main, args)
    assert result.exit_code == 2 and option in result.output, result.output
