"""transportd_cli.mps on the CPU: the commands it runs, the environment it sets and restores, and every reason it
gives for not running — against a stand-in control program (a real script that records what it got)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from transportd_cli.mps import CONTROL, DISABLE_ENV, Mps, mps_env, mps_wanted

SCRIPT = """#!/bin/sh
# stand-in for nvidia-cuda-mps-control: append argv, the MPS variables and stdin to $RECORD
stdin=""
[ "$1" = "-d" ] || stdin=$(cat)
printf '{"argv": "%s", "pipe": "%s", "log": "%s", "stdin": "%s"}\\n' "$*" "$CUDA_MPS_PIPE_DIRECTORY" \\
    "$CUDA_MPS_LOG_DIRECTORY" "$stdin" >> "$RECORD"
[ -d "$CUDA_MPS_PIPE_DIRECTORY" ] && [ -d "$CUDA_MPS_LOG_DIRECTORY" ] || exit 9
[ -n "$HOLD" ] && [ "$1" != "-d" ] && sleep "$HOLD"  # as quit waits for this process, still a client
exit ${FAIL:-0}
"""


def _stand_in(tmp_path: Path) -> tuple[str, Path]:
    script = tmp_path / CONTROL
    script.write_text(SCRIPT)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), tmp_path / "record.jsonl"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_env_names_both_directories_under_the_root(tmp_path: Path) -> None:
    assert mps_env(tmp_path) == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
                                 "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log")}
    assert mps_wanted({}) and mps_wanted({DISABLE_ENV: "1"})
    assert not any(mps_wanted({DISABLE_ENV: v}) for v in ("0", "off", "No", "false"))


def test_start_and_stop_run_the_control_program_and_restore_the_environment(tmp_path: Path) -> None:
    script, record = _stand_in(tmp_path)
    environ = {"RECORD": str(record), "PATH": os.environ["PATH"], "CUDA_MPS_LOG_DIRECTORY": "/before"}
    mps = Mps(environ=environ, which=lambda name: script if name == CONTROL else None)
    assert mps.start() and mps.running
    root = mps.root
    assert root is not None and environ["CUDA_MPS_PIPE_DIRECTORY"] == f"{root}/pipe"
    assert environ["CUDA_MPS_LOG_DIRECTORY"] == f"{root}/log"
    assert "ran: started" in mps.describe()
    mps.stop()
    (started, stopped) = _records(record)
    assert started == {"argv": "-d", "pipe": f"{root}/pipe", "log": f"{root}/log", "stdin": ""}
    assert stopped == {"argv": "", "pipe": f"{root}/pipe", "log": f"{root}/log", "stdin": "quit"}
    assert "CUDA_MPS_PIPE_DIRECTORY" not in environ and environ["CUDA_MPS_LOG_DIRECTORY"] == "/before"
    assert not Path(root).exists() and not mps.running and mps.describe().startswith("CUDA MPS: ran")
    mps.stop()  # twice: nothing more is run
    assert len(_records(record)) == 2


def test_a_failing_control_program_leaves_everything_as_it_was(tmp_path: Path) -> None:
    script, record = _stand_in(tmp_path)
    environ = {"RECORD": str(record), "FAIL": "3", "PATH": os.environ["PATH"]}
    with Mps(environ=environ, which=lambda name: script) as mps:
        assert not mps.running and "failed (3)" in mps.describe() and "did not run" in mps.describe()
        assert not any(k.startswith("CUDA_MPS") for k in environ)
    assert len(_records(record)) == 1  # no quit sent to a daemon that never started


def test_reasons_for_not_starting(tmp_path: Path) -> None:
    script, record = _stand_in(tmp_path)
    off = Mps(environ={DISABLE_ENV: "0"}, which=lambda name: script)
    assert not off.start() and f"turned off ({DISABLE_ENV}=0)" in off.describe()
    missing = Mps(environ={}, which=lambda name: None)
    assert not missing.start() and f"{CONTROL} not found" in missing.describe()
    theirs = Mps(environ=mps_env(tmp_path), which=lambda name: script)
    assert not theirs.start() and "already names an MPS server" in theirs.describe()
    assert not record.exists()


def test_the_gpu_tests_start_and_stop_mps_and_say_so(tmp_path: Path) -> None:
    """A pytest run of GPU tests with the stand-in on PATH: started before the tests, quit after, reported."""
    script, record = _stand_in(tmp_path)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "RECORD": str(record)}
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", DISABLE_ENV):
        env.pop(key, None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--co",
                          "tests/gpu/test_ring_stress.py"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("CUDA MPS: ran: started (pipe and log directories under") == 1  # the summary
    started, stopped = _records(record)
    assert started["argv"] == "-d" and stopped["stdin"] == "quit" and started["pipe"] == stopped["pipe"]
    off = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--co",
                          "tests/gpu/test_ring_stress.py"], cwd=root, env={**env, DISABLE_ENV: "0"},
                         capture_output=True, text=True, timeout=300)
    assert f"CUDA MPS: did not run: turned off ({DISABLE_ENV}=0)" in off.stdout
    assert len(_records(record)) == 2


def test_a_quit_that_waits_for_this_very_process_does_not_hang_it(tmp_path: Path) -> None:
    """The control daemon finishes a quit only when its clients are gone, and the process asking is one:
    stop waits a moment, leaves the quit standing and the directory for the daemon, and raises nothing."""
    script, record = _stand_in(tmp_path)
    environ = {"RECORD": str(record), "PATH": os.environ["PATH"], "HOLD": "30"}
    mps = Mps(environ=environ, which=lambda name: script if name == CONTROL else None)
    assert mps.start()
    root = mps.root
    mps.stop()
    assert not mps.running and "CUDA_MPS_PIPE_DIRECTORY" not in environ
    assert "quit sent" in mps.describe() and root is not None and Path(root).exists()
