"""benchmarks/post_cold_bench.py at a tiny size: every row comes out and each timed post built its WR list (no
timings asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from softverbs.soft import batch
from tests.support.benchmarks import load_benchmark


def test_every_timed_post_builds_its_list_and_every_row_is_written(tmp_path: Path, monkeypatch) -> None:
    built: list[int] = []
    real = batch.list_by_columns

    def counting(core: Any, rows: Any, setters: Any = None) -> None:
        real(core, rows, setters)
        assert core.wr_list_err == 0
        built.append(len(core.wr_list))

    monkeypatch.setattr(batch, "list_by_columns", counting)
    out = tmp_path / "post-cold.json"
    result = CliRunner().invoke(load_benchmark("post_cold_bench").main,
                                ["--wrs", "5", "--posts", "4", "--idle-ms", "0", "--thrash-mib", "1", "--json",
                                 str(out)])
    assert result.exit_code == 0, result.output
    assert built == [5] * 84, (
        "10 untimed and 4 timed posts a row, six rows, each a list of 5 WRs (no idle: nothing rehearsed)")
    doc = json.loads(out.read_text())
    assert [r["mode"] for r in doc["rows"]] == ["warm", "spun", "c_spun", "thrashed", "rehearsed", "cold"]
    assert all(r["wrs"] == 5 and r["posts"] == 4 and 0 < r["p50_us"] <= r["p90_us"] for r in doc["rows"])
    assert set(doc["summary"]) == {f"{m}_p50_us" for m in ("warm", "spun", "c_spun", "thrashed", "rehearsed", "cold")}
    assert (doc["thrash_mib"], doc["rehearse_ms"]) == (1, 1.0)


@pytest.mark.parametrize(("args", "option"), [(["--wrs", "0"], "--wrs"), (["--thrash-mib", "0"], "--thrash-mib"),
                                             (["--thrash-mib", "x"], "--thrash-mib"),
                                             (["--rehearse-ms", "0"], "--rehearse-ms"),
                                             (["--rehearse-ms", "nan"], "--rehearse-ms"),
                                             (["--idle-ms", "nan"], "--idle-ms"), (["--idle-ms", "-1"], "--idle-ms")])
def test_what_it_cannot_run_is_refused_before_any_work(args: list[str], option: str) -> None:
    result = CliRunner().invoke(load_benchmark("post_cold_bench").main, args)
    assert result.exit_code == 2 and option in result.output
