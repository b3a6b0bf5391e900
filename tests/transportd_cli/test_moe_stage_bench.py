"""benchmarks/moe_stage_bench.py's options, refused before any session or CUDA call, and its summary (the run
itself needs a GPU)."""

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
    (["--route-programs", "64", "--route-programs", "x"], "--route-programs"),
    (["--fp8", "--hidden", "200"], "--hidden"),  # FP8 rows scale 128 values at a time
])
def test_bad_options_are_refused(args: list[str], option: str) -> None:
    result = CliRunner().invoke(load_benchmark("moe_stage_bench").main, args)
    assert result.exit_code == 2 and option in result.output, result.output


def row(tokens: int, grid: int, us: float) -> dict:
    return {"tokens": tokens, "route_programs": grid, "route_and_stage_us_p50": us}


def test_the_summary_is_per_token_count_and_per_grid_where_grids_were_compared() -> None:
    summary = load_benchmark("moe_stage_bench").summary
    assert summary([row(128, 64, 5.0), row(1024, 64, 9.0)], by_grid=False) == {
        "route_and_stage_us_128": 5.0, "route_and_stage_us_1024": 9.0}
    # repeated grids (an alternation) give the median of their rows
    rows = [row(128, 32, 7.0), row(128, 64, 5.0), row(128, 32, 9.0), row(128, 64, 4.0), row(128, 32, 8.0)]
    assert summary(rows, by_grid=True) == {"route_and_stage_us_128_route_32": 8.0,
                                           "route_and_stage_us_128_route_64": 4.5}
