"""transportctl against a daemon whose control socket is tcp with CURVE: keys in, status out; no key, no answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.waiting import wait_until
from transportd.control.curve import generate_keypair
from transportd_cli.localcluster import free_port, render_toml

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def test_transportctl_speaks_curve_to_a_tcp_control_socket(tmp_path: Path) -> None:
    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    authorized.mkdir()
    server_public, server_secret = generate_keypair(keys, "daemon")
    client_public, client_secret = generate_keypair(keys, "operator")
    (authorized / "operator.key").write_bytes(client_public.read_bytes())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "node.toml"
    config.write_text(render_toml({
        "node": {"name": "solo"},
        "control": {"socket": endpoint},
        "peers": {"listen": f"tcp://127.0.0.1:{free_port()}"},
        "security": {"curve_secret_key_file": str(server_secret), "curve_public_key_file": str(server_public),
                     "curve_authorized_keys_dir": str(authorized)},
        "backend": {"kind": "ib", "verbs": "soft"},
        "logging": {"format": "text"},
    }))
    daemon = subprocess.Popen([sys.executable, "-m", "transportd", "run", "--config", str(config)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ctl = [sys.executable, "-m", "transportd_cli.ctl"]
    with_keys = [*ctl, "--curve-secret-key", str(client_secret), "--curve-server-key", str(server_public)]
    try:
        said = [""]  # transportctl's last complaint, for the timeout's message

        def status() -> subprocess.CompletedProcess | None:
            result = subprocess.run([*with_keys, "status", "--json", "--socket", endpoint], capture_output=True,
                                    text=True, timeout=30)
            assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
            said[0] = result.stderr
            return result if result.returncode == 0 else None

        result = wait_until(status, lambda: f"the CURVE daemon to answer status (last: {said[0]!r})", 30, interval=0.2)
        assert json.loads(result.stdout)["node"] == "solo"
        # without keys the daemon never answers: a clear "not reachable" error, exit 2
        bare = subprocess.run([*ctl, "status", "--socket", endpoint], capture_output=True, text=True, timeout=30)
        assert bare.returncode == 2 and "CURVE" in bare.stderr and "not running" not in bare.stderr
        # a key the daemon does not know is refused the same way
        _, stranger = generate_keypair(keys, "stranger")
        other = subprocess.run([*ctl, "--curve-secret-key", str(stranger), "--curve-server-key", str(server_public),
                                "status", "--socket", endpoint], capture_output=True, text=True, timeout=30)
        assert other.returncode == 2
    finally:
        daemon.terminate()
        daemon.wait(20)
