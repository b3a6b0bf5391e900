"""`transportd bench softverbs` runs end to end and writes the JSON summary (timings are not asserted); its
direct row's writes go as references."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from softverbs.soft.bench import bench_softverbs


def test_bench_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(bench_softverbs, ["--seconds", "0.05", "--no-srd", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 MiB GB/s" in result.output
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"gbps_4kib", "gbps_64kib", "gbps_1mib", "wr_per_s", "shaped_chain_us",
                            "direct_wr_per_s"}
    assert all(v > 0 for v in summary.values())
    chain = json.loads(out.read_text())["rc"]["shaped_chain"]
    assert chain["wrs"] > 0 and chain["per_write_us"] >= chain["model_us"] > 0  # never faster than the model
    assert "shaped as an EFA port" in result.output
    # the writes went as references, but those posted before the peer had opened the allocation (a window)
    direct = json.loads(out.read_text())["rc"]["direct"]
    assert direct["wrs"] >= 8 and direct["direct_sent"] >= direct["wrs"] - 256 - 8, direct
    assert "between emulated device memories" in result.output
