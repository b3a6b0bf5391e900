"""`transportd demo` checks its arguments before it starts a daemon: one usage line, exit 2, no traceback;
and LocalCluster refuses a config the daemons would refuse, before launching one."""

from __future__ import annotations

import os

import click
import numpy as np
import pytest
from click.testing import CliRunner

from transportd.dataplane.trace import ENTRY_DTYPE, HEADER_DTYPE, MAGIC, VERSION
from transportd.errors import ConfigError
from transportd_cli.cli import main
from transportd_cli.ctl import main as ctl_main
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


def test_demo_refuses_a_size_this_machine_has_no_memory_for() -> None:
    """`demo --mib N` holds about 4 N MiB (a send and a receive buffer per rank): checked before anything starts."""
    from transportd_cli.cli_options import available_memory

    available = available_memory()
    if available is None:
        pytest.skip("/proc/meminfo gives no MemAvailable here")
    mib = (available >> 20) // 2  # twice what there is: 4 x (available / 2)
    result = CliRunner().invoke(main, ["demo", "--mib", str(mib), "--chunk-kib", "1024"])
    assert result.exit_code == 2, result.output + repr(result.exception)
    assert "--mib" in result.output and "is available" in result.output and "started 2 daemons" not in result.output


def test_a_local_cluster_refuses_a_bad_config_before_launching(tmp_path) -> None:
    workdir = tmp_path / "cluster"
    workdir.mkdir()
    with pytest.raises(ConfigError, match="signal.mode: 'atomic' does not apply to backend.kind"):
        LocalCluster(2, backend="efa", overrides={"signal": {"mode": "atomic"}}, workdir=str(workdir))
    assert not any(p.suffix == ".log" for p in workdir.iterdir())  # no daemon was started
    assert os.listdir(workdir)  # the first node's config was written, then refused


def _header(version: int = VERSION, context: bytes = b"{}") -> bytes:
    h = np.zeros(1, dtype=HEADER_DTYPE)
    h[0]["magic"], h[0]["version"], h[0]["context_len"] = MAGIC, version, len(context)
    h[0]["header_size"], h[0]["entry_size"] = HEADER_DTYPE.itemsize, ENTRY_DTYPE.itemsize
    return h.tobytes() + context + b"\0" * (-len(context) % 8)


@pytest.mark.parametrize(("content", "says"), [
    (b"", "not a transportd trace file"),
    (b"garbage, not a trace" * 10, "not a transportd trace file"),
    (_header(version=99), "trace format version 99"),
    (_header(context=b"{not json"), "its context is not JSON"),
    (_header(context=b"\xff\xfe"), "its context is not JSON"),
])
def test_replay_refuses_a_file_that_is_not_a_trace_in_one_line(tmp_path, content: bytes, says: str) -> None:
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)  # a refusal, not a crash
    assert says in res.output and len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_replay_of_a_missing_file_is_a_usage_error() -> None:
    res = CliRunner().invoke(main, ["replay", "/nonexistent/run.trace"])
    assert res.exit_code == 2 and "does not exist" in res.output


@pytest.mark.parametrize(("context", "says"), [
    (b"{}", "context is not a trace context"),
    (b"[1, 2]", "context is not a trace context"),
    (b'{"world": "two", "rank": 0, "channels": {}}', "context is not a trace context"),
    (b'{"world": 2, "rank": 0, "channels": {"1": {"capacity": 64}}, "peers": {"1": {"regions": []}}}',
     "context is not a trace context"),
    (b'{"world": 2, "rank": 5, "channels": {"1": {"capacity": 64}}}', "rank 5 in a world of 2"),
])
def test_replay_refuses_a_context_of_the_wrong_shape_in_one_line(tmp_path, context: bytes, says: str) -> None:
    path = tmp_path / "shape.trace"
    path.write_bytes(_header(context=context))
    res = CliRunner().invoke(main, ["replay", str(path), "--socket", f"ipc://{tmp_path}/none.sock"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    assert says in res.output and len(res.output.strip().splitlines()) == 1 and str(path) in res.output


def _float_options(command: click.Command, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    out = [(path, p.opts[0]) for p in command.params
           if isinstance(p, click.Option) and isinstance(p.type, click.types.FloatParamType)]
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            out += _float_options(sub, (*path, name))
    return out


FLOAT_OPTIONS = [(program, path, opt) for program, group in (("transportd", main), ("transportctl", ctl_main))
                 for path, opt in _float_options(group)]


def test_the_float_options_include_those_the_issue_named() -> None:
    named = {("transportctl", ("selftest",), "--timeout"), ("transportctl", ("top",), "--interval"),
             ("transportd", ("replay",), "--timeout"), ("transportd", ("bench", "e2e"), "--seconds"),
             ("transportd", ("bench", "softverbs"), "--seconds")}
    assert named <= set(FLOAT_OPTIONS)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(("program", "path", "option"), FLOAT_OPTIONS)
def test_every_float_option_refuses_non_finite_numbers(program: str, path: tuple[str, ...], option: str,
                                                       value: str) -> None:
    """NaN passes every range check (a NaN timeout hung, an infinite interval overflowed time.sleep): each
    float option of both programs refuses it as a usage error, before anything runs."""
    group = main if program == "transportd" else ctl_main
    res = CliRunner().invoke(group, [*path, f"{option}={value}"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    assert "is not a finite number" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args", [
    ["proxy", "--peers", "-1"], ["proxy", "--peers", "0"], ["proxy", "--batch-max", "0"], ["proxy", "--batch-max", "9"],
    ["proxy", "--inflight-cap", "-5"], ["proxy", "--channels", "0"], ["signals", "--records", "-1"],
    ["signals", "--burst", "0"], ["signals", "--dests", "0"], ["softverbs", "--seconds", "-1"],
    ["softverbs", "--seconds", "0"], ["e2e", "--window", "0"], ["rails", "--seconds", "-1"],
    ["rails", "--samples", "0"],
])
def test_bench_refuses_out_of_range_numbers_before_running(args: list[str]) -> None:
    res = CliRunner().invoke(main, ["bench", *args])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    assert "Invalid value" in res.output and args[1] in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("bench", ["ring", "softverbs", "proxy", "signals", "e2e", "rails"])
@pytest.mark.parametrize("where", ["missing-dir", "directory"])
def test_bench_checks_its_json_path_before_running(tmp_path, bench: str, where: str) -> None:
    """A --json PATH that cannot be written fails at once, not after the whole benchmark (and leaves no file)."""
    path = tmp_path / "no" / "such" / "dir" / "out.json" if where == "missing-dir" else tmp_path
    res = CliRunner().invoke(main, ["bench", bench, "--json", str(path)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output + repr(res.exception)
    assert ("cannot write" in res.output or "is a directory" in res.output) and "Traceback" not in res.output
    assert not (tmp_path / "no").exists()


def test_keygen_refuses_to_overwrite_keys_without_force(tmp_path) -> None:
    first = CliRunner().invoke(main, ["keygen", str(tmp_path), "node1"])
    assert first.exit_code == 0, first.output
    public, secret = tmp_path / "node1.key", tmp_path / "node1.key_secret"
    kept = public.read_bytes(), secret.read_bytes()
    assert os.stat(secret).st_mode & 0o777 == 0o600
    again = CliRunner().invoke(main, ["keygen", str(tmp_path), "node1"])
    assert again.exit_code == 1 and "exist already" in again.output and "--force" in again.output
    assert (public.read_bytes(), secret.read_bytes()) == kept
    forced = CliRunner().invoke(main, ["keygen", str(tmp_path), "node1", "--force"])
    assert forced.exit_code == 0 and public.read_bytes() != kept[0]


def test_refusals_of_both_programs_read_alike(tmp_path) -> None:
    """One style of error line: `<program>: message` (transportd's commands printed click's `Error: ...`,
    transportctl and the daemon's bad config `transportctl: ...` / `transportd: ...`)."""
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"garbage")
    (tmp_path / "keys").mkdir()
    CliRunner().invoke(main, ["keygen", str(tmp_path / "keys"), "n"])
    lines = {
        "replay": CliRunner().invoke(main, ["replay", str(bad)]).output,
        "keygen": CliRunner().invoke(main, ["keygen", str(tmp_path / "keys"), "n"]).output,
        "transportctl": CliRunner().invoke(ctl_main, ["status", "--socket", f"ipc://{tmp_path}/none.sock"]).output,
    }
    for what, line in lines.items():
        program = "transportctl" if what == "transportctl" else "transportd"
        assert line.startswith(f"{program}: ") and len(line.strip().splitlines()) == 1, (what, line)
