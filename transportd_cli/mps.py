"""A private CUDA MPS control daemon for the GPU tests and benchmarks.

Without MPS every process on a GPU has its own context and the GPU time-slices between them while one of
them has a kernel resident: a copy the daemon's worker makes into GPU memory (softverbs' GPU accessor, the
``cuda-copy`` flag path) waits for a slice, 2.38 ms on the H200. Under MPS the processes share one server
context and nothing waits for a slice, so a measurement shows the transport, not the scheduler.

:class:`Mps` starts ``nvidia-cuda-mps-control -d`` with its pipe and log directories under a temporary
directory, puts ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` into this process's environment
(so every process started afterwards — daemons, rail workers, rank processes — is a client of the same
server), and on :meth:`Mps.stop` sends ``quit`` and restores the environment. A process that created its
CUDA context before MPS started is not a client: start it first. Where the control program is missing,
or ``TRANSPORTD_GPU_MPS=0``, nothing is started and :meth:`Mps.describe` says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["CONTROL", "DISABLE_ENV", "MPS_ENV_KEYS", "Mps", "mps_env", "mps_wanted"]

CONTROL = "nvidia-cuda-mps-control"
DISABLE_ENV = "TRANSPORTD_GPU_MPS"  # "0" (or off/no/false): run the GPU tests and benchmarks without MPS
MPS_ENV_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def mps_wanted(environ: MutableMapping[str, str]) -> bool:
    """False when ``TRANSPORTD_GPU_MPS`` turns MPS off."""
    return environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def mps_env(root: str | os.PathLike[str]) -> dict[str, str]:
    """The two variables every MPS client and the control daemon must agree on, under ``root``."""
    root = Path(root)
    return {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}


Runner = Callable[..., Any]  # subprocess.run's signature


class Mps:
    """Start (:meth:`start`) and stop (:meth:`stop`) a private MPS control daemon; also a context manager.

    ``environ``: the environment to set the variables in (``os.environ``: inherited by every later child).
    ``which``: how to find the control program (``shutil.which``; tests name a stand-in script);
    ``run``: how to run it (``subprocess.run``).
    """

    def __init__(self, *, environ: MutableMapping[str, str] | None = None,
                 which: Callable[[str], str | None] = shutil.which, run: Runner = subprocess.run) -> None:
        self.environ = os.environ if environ is None else environ
        self._which, self._run = which, run
        self.running = False
        self.ran = False  # started at some point (what a run's summary reports)
        self.reason = "not started"
        self.root: str | None = None
        self.control: str | None = None
        self._saved: dict[str, str | None] = {}

    def commands(self) -> tuple[list[str], tuple[list[str], str]]:
        """(the start command, (the stop command, its stdin))."""
        assert self.control is not None
        return [self.control, "-d"], ([self.control], "quit\n")

    def start(self) -> bool:
        """Start MPS if wanted and present; True if it runs. Never raises for a missing or failing MPS:
        the tests still run, without it, and :meth:`describe` says why."""
        if not mps_wanted(self.environ):
            self.reason = f"turned off ({DISABLE_ENV}={self.environ.get(DISABLE_ENV)})"
            return False
        if all(self.environ.get(k) for k in MPS_ENV_KEYS):
            self.reason = f"not started here: this environment already names an MPS server ({MPS_ENV_KEYS[0]})"
            return False
        self.control = self._which(CONTROL)
        if self.control is None:
            self.reason = f"{CONTROL} not found"
            return False
        self.root = tempfile.mkdtemp(prefix="tpd-mps-")
        env_vars = mps_env(self.root)
        for path in env_vars.values():
            os.makedirs(path, exist_ok=True)
        start, _ = self.commands()
        proc = self._run(start, env={**self.environ, **env_vars}, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            self.reason = f"{' '.join(start)} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}"
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            return False
        for key, value in env_vars.items():
            self._saved[key] = self.environ.get(key)
            self.environ[key] = value
        self.running = self.ran = True
        self.reason = f"started (pipe and log directories under {self.root})"
        return True

    def stop(self) -> None:
        """Send ``quit`` to the control daemon (it stops the server), restore the environment, clean up.

        A process that is itself still an MPS client (pytest, after its GPU tests made a context) cannot
        wait for the server to stop: the daemon waits for its clients first. So the wait is short; on
        timeout the quit stands, the daemon stops once this process's context goes, and its directory
        stays for it until then."""
        if not self.running:
            return
        _, (stop, stdin) = self.commands()
        env = {**self.environ}
        stopped = True
        try:
            self._run(stop, input=stdin, env=env, capture_output=True, text=True, timeout=5)
        except subprocess.TimeoutExpired:
            stopped = False
        for key, value in self._saved.items():
            if value is None:
                self.environ.pop(key, None)
            else:
                self.environ[key] = value
        self._saved.clear()
        self.running = False
        if not stopped:
            self.reason = "started; quit sent, the server stops when this process's CUDA context goes"
            return
        self.reason = "started, then stopped"
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def describe(self) -> str:
        """One line: whether MPS ran, and why not where it did not."""
        return f"CUDA MPS: {'ran' if self.ran else 'did not run'}: {self.reason}"

    def __enter__(self) -> Mps:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
