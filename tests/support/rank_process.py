"""A GPU rank in its own process (tests/gpu/rank_proc.py), driven one JSON step at a time (the GPU tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = ROOT / "tests" / "gpu" / "rank_proc.py"
# a worker's first GPU registration initialises CUDA while the daemon's main loop waits for it: give the
# peers' heartbeats room for that
SLOW_START = {"peers": {"heartbeat_timeout_s": 20.0}}


class RankProcess:
    """A rank_proc.py child: send it a step, read its JSON reply."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, str(RANK_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, text=True, cwd=ROOT, env=env)

    def send(self, step: str, **args: Any) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(json.dumps({"step": step, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout
        for line in self.proc.stdout:
            if line.startswith("@@"):
                reply = json.loads(line[2:])
                assert reply["ok"], reply.get("trace") or reply
                return reply
        raise AssertionError(f"rank process exited ({self.proc.poll()}) without a reply")

    def call(self, step: str, **args: Any) -> dict[str, Any]:
        self.send(step, **args)
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("leave")
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
