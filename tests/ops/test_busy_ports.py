"""A port the config names is held by another process: `transportd run` exits 1 with one line naming the
config key and the port, not a traceback (the port may free up, so this is not the config's exit 78)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from transportd_cli.localcluster import free_port, render_toml

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


@pytest.mark.parametrize("key", ["peers.listen", "metrics.listen"])
def test_a_busy_port_is_one_line_naming_its_key(tmp_path, key: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        sections = {
            "node": {"name": "busy"},
            "control": {"socket": f"ipc://{tmp_path}/control.sock"},
            "peers": {"listen": f"tcp://127.0.0.1:{busy if key == 'peers.listen' else free_port()}"},
            "backend": {"kind": "ib", "verbs": "soft"},
            "metrics": {"listen": f"127.0.0.1:{busy}" if key == "metrics.listen" else ""},
            "logging": {"format": "text"},
        }
        path = tmp_path / "busy.toml"
        path.write_text(render_toml(sections))
        result = subprocess.run([sys.executable, "-m", "transportd", "run", "--config", str(path)],
                                capture_output=True, text=True, timeout=90)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("transportd: cannot start: ") and f"{key} = " in last and f":{busy}" in last
    assert "another process holds it" in last
