"""benchmarks/moe_stage_bench.py's options: refused before any session or CUDA call (the run itself needs a GPU)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.support.benchmarks import load_benchmark


@pytest.mark.parametrize(("args", "option"), [
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "many"], "--tokens"),
    (["--reps", "0"], "--reps"),
    (["--warmup", "-1"], "--warmup"),
    (["--hidden", "0"], "--hidden"),
    (["--route-programs", "0"], "--route-programs"),
])
def test_bad_options_are_refused(args: list[str], option: str) -> None:
    result = CliRunner().invoke(load_benchmark("moe_stage_bench").main, args)
    assert result.exit_code == 2 and option in result.output, result.output
