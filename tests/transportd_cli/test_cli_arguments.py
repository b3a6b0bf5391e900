"""`transportd demo` checks its arguments before it starts a daemon: one usage line, exit 2, no traceback;
and LocalCluster refuses a config the daemons would refuse, before launching one."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from transportd.errors import ConfigError
from transportd_cli.cli import main
from transportd_cli.localcluster import LocalCluster


@pytest.mark.parametrize(("args", "says"), [
    (["--mib", "0"], "--mib"),
    (["--mib", "-5"], "--mib"),
    (["--chunk-kib", "0"], "--chunk-kib"),
    (["--chunk-kib", "3"], "3 KiB does not divide --mib 256"),
    (["--backend", "efa", "--signal-mode", "atomic"], "--signal-mode atomic does not apply to --backend efa"),
    (["--backend", "efa", "--signal-mode", "fence"], "--signal-mode fence does not apply to --backend efa"),
])
def test_demo_refuses_bad_arguments_before_starting(args: list[str], says: str) -> None:
    result = CliRunner().invoke(main, ["demo", *args])
    assert result.exit_code == 2, result.output + repr(result.exception)
    assert says in result.output and "Traceback" not in result.output
    assert "started 2 daemons" not in result.output and not isinstance(result.exception, ZeroDivisionError)


def test_a_local_cluster_refuses_a_bad_config_before_launching(tmp_path) -> None:
    workdir = tmp_path / "cluster"
    workdir.mkdir()
    with pytest.raises(ConfigError, match="signal.mode: 'atomic' does not apply to backend.kind"):
        LocalCluster(2, backend="efa", overrides={"signal": {"mode": "atomic"}}, workdir=str(workdir))
    assert not any(p.suffix == ".log" for p in workdir.iterdir())  # no daemon was started
    assert os.listdir(workdir)  # the first node's config was written, then refused
