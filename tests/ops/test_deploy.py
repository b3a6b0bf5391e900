"""deploy/: the systemd unit meets the operations rules (and systemd itself accepts it); the example config
is exactly what the config module documents and loads."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.ctl import installed_script
from transportd.config import KEYS, default_config, example_config, load_config

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "transportd.service"
EXAMPLE = DEPLOY / "transportd.toml"


def _unit(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{raw!r} outside a section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_file_meets_the_operations_rules() -> None:
    unit = _unit(UNIT.read_text())
    service = {k: v[-1] for k, v in unit["Service"].items()}
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    exec_start = service["ExecStart"].split()
    assert exec_start[0].startswith("/") and Path(exec_start[0]).name == "transportd", "absolute script path"
    assert exec_start[1:] == ["run", "--config", "/etc/transportd/transportd.toml"]
    assert service["LimitMEMLOCK"] == "infinity"
    assert service["Restart"] == "on-failure"
    # reload restarts without stopping the jobs: the daemon starts its successor on SIGHUP (docs/restart.md)
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["RuntimeDirectory"] == "transportd"
    assert "WatchdogSec" in service and service["KillMode"] == "mixed"
    # hardening is on, but nothing that closes /dev/infiniband or /dev/nvidia*
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert service.get("PrivateDevices", "no") == "no"
    for closing in ("DevicePolicy", "DeviceAllow", "ProtectClock"):
        assert closing not in service, f"{closing}= would switch the device cgroup to an allow-list"
    # ProtectSystem=strict leaves /tmp read-only: the rail workers' link sockets need PrivateTmp
    assert service["PrivateTmp"] == "yes"
    assert "AF_IB" in service["RestrictAddressFamilies"] and "AF_NETLINK" in service["RestrictAddressFamilies"]
    # least privilege: its own user and group, no capabilities, nothing writable in /dev/shm
    assert service["User"] == "transportd" and service["Group"] == "transportd"
    assert unit["Service"]["CapabilityBoundingSet"] == [""] and unit["Service"]["AmbientCapabilities"] == [""]
    assert "/dev/shm" not in service.get("ReadWritePaths", "")
    assert service["RuntimeDirectoryMode"] == "0750" and service["UMask"] == "0007"
    # the daemon's own wait for peers fits in the start timeout
    assert default_config(env={}).peers.ready_wait_s < int(service["TimeoutStartSec"].rstrip("s"))
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_analyze_verify_accepts_the_unit(tmp_path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing (Debian package systemd; .ci/run installs it)")
    script = installed_script("transportd")
    if script is None:
        pytest.skip("the transportd console script is not installed (pip install -e .)")
    # `verify` checks that ExecStart's program exists and is executable. The unit names the path a root
    # `pip install` gives (/usr/local/bin/transportd), which a test machine or a virtualenv does not have,
    # so a copy points at the script installed for this interpreter; every other line is verified as is.
    text = UNIT.read_text()
    original = re.search(r"^ExecStart=(\S+)", text, re.M)
    assert original is not None
    copy = tmp_path / "transportd.service"  # verify wants the real unit name (type from the suffix)
    copy.write_text(text.replace(f"ExecStart={original.group(1)} ", f"ExecStart={script} "))
    assert f"ExecStart={script} run --config /etc/transportd/transportd.toml" in copy.read_text()
    proc = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # unknown keys and bad values are only warnings (exit 0): none may mention our file
    assert "transportd.service" not in output, output


def test_example_config_is_generated_and_loads() -> None:
    assert EXAMPLE.read_text() == example_config(), "regenerate: python -c 'from transportd.config import " \
        "example_config; print(example_config(), end=\"\")' > deploy/transportd.toml"
    assert load_config(EXAMPLE, env={}) == default_config(env={})


def test_example_config_documents_every_key_at_its_default(tmp_path) -> None:
    text = EXAMPLE.read_text()
    section = None
    in_rails_example = False  # the commented [[backend.rails]] table stays commented (its device is made up)
    commented: set[str] = set()
    uncommented = []
    for line in text.splitlines():
        if re.fullmatch(r"\[([\w.]+)\]", line):  # [backend.ib] too
            section = line.strip("[]")
        in_rails_example = (in_rails_example or line == "# [[backend.rails]]") and line != ""
        match = re.fullmatch(r"# (\w+) = (.*)", line)
        if match and section and not in_rails_example:
            commented.add(f"{section}.{match.group(1)}")
            if f"{section}.{match.group(1)}" != "node.name":  # its default is the host name: an example is shown
                line = f"{match.group(1)} = {match.group(2)}"
        uncommented.append(line)
    documented = {k for k in KEYS if "[]" not in k and k != "backend.rails"}
    assert commented == documented
    assert "# [[backend.rails]]" in text
    # every line uncommented: still valid, and still the defaults
    path = tmp_path / "all.toml"
    path.write_text("\n".join(uncommented) + "\n")
    assert load_config(path, env={}) == default_config(env={})


def test_example_config_loads_with_every_commented_line_uncommented(tmp_path) -> None:
    """As docs/operations.md says to edit it: every commented key and table uncommented at once (the rails example
    and node.name included) still loads, and each key lands in the table it sits under."""
    text = example_config()
    uncommented = re.sub(r"(?m)^# (?=\w+ = |\[\[)", "", text)
    assert "\n# name = " not in uncommented and "\n[[backend.rails]]\n" in uncommented
    path = tmp_path / "every-line.toml"
    path.write_text(uncommented)
    config = load_config(path, env={})
    assert config.node.name == "node1"
    assert [(r.device, r.gpu, r.numa_node) for r in config.backend.rails] == [("mlx5_0", 0, 0)]
    assert config.backend.verbs == "auto"


def test_a_bad_config_exits_78_and_the_unit_does_not_restart_it(tmp_path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text('[signal]\nmode = "bogus"\n')
    result = subprocess.run([sys.executable, "-m", "transportd", "run", "--config", str(bad)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 78
    assert "signal.mode" in result.stderr and str(bad) in result.stderr
    unit = (Path(__file__).resolve().parents[2] / "deploy" / "transportd.service").read_text()
    assert "RestartPreventExitStatus=78" in unit


@pytest.mark.parametrize("kind", ["directory", "missing", "unreadable bytes"])
def test_a_config_that_cannot_be_read_exits_78_too(tmp_path, kind: str) -> None:
    """Not click's usage error (exit 2, which systemd restarts): the config is wrong, restarting will not help."""
    import subprocess
    import sys

    path = {"directory": tmp_path, "missing": tmp_path / "none.toml", "unreadable bytes": tmp_path / "bin.toml"}[kind]
    if kind == "unreadable bytes":
        path.write_bytes(b"\xff\xfe\x00")
    result = subprocess.run([sys.executable, "-m", "transportd", "run", "--config", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 78, result.stderr
    assert "bad config" in result.stderr and str(path) in result.stderr and "Traceback" not in result.stderr


def _operations_section(title: str) -> str:
    text = (DEPLOY.parent / "docs" / "operations.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_operations_install_steps_match_the_unit() -> None:
    """docs/operations.md's install steps create the user and group the unit runs as, put the unit and the config
    where it looks, and describe its privileges (memlock, capabilities, groups) as the unit sets them."""
    unit = _unit(UNIT.read_text())
    service = {k: v[-1] for k, v in unit["Service"].items()}
    install = _operations_section("Install on a node")
    steps = re.search(r"```sh\n(.*?)```", install, re.S)
    assert steps is not None
    commands = [line.split("#")[0].split() for line in steps.group(1).splitlines()]
    groupadd = next(c for c in commands if c[:1] == ["groupadd"])
    useradd = next(c for c in commands if c[:1] == ["useradd"])
    assert groupadd[-1] == service["Group"] and "--system" in groupadd
    assert useradd[-1] == service["User"] and useradd[useradd.index("--gid") + 1] == service["Group"]
    assert "--system" in useradd and useradd[useradd.index("--shell") + 1] == "/usr/sbin/nologin"
    # the unit's own header comment gives the same two commands
    header = " ".join(line.lstrip("# ").rstrip("\\ ") for line in UNIT.read_text().splitlines()[:6])
    assert " ".join(groupadd) in header and " ".join(useradd) in " ".join(header.split()), header
    config = service["ExecStart"].split()[-1]
    assert any(c[:1] == ["install"] and c[-1] == config for c in commands), f"the config goes to {config}"
    assert any(c[:1] == ["install"] and c[-1] == "/etc/systemd/system/" and c[-2].endswith("transportd.service")
               for c in commands)
    assert ["systemctl", "daemon-reload", "&&", "systemctl", "enable", "--now", "transportd"] in commands
    # privileges, as the prose says them
    assert f"`LimitMEMLOCK={service['LimitMEMLOCK']}`" in install and service["LimitMEMLOCK"] == "infinity"
    assert "**no capabilities**" in install and "(`CapabilityBoundingSet=` empty)" in install
    assert unit["Service"]["CapabilityBoundingSet"] == [""] and unit["Service"]["AmbientCapabilities"] == [""]
    assert "(`User=`, `Group=`)" in install and f"the `{service['User']}` user and group" in install
    # extra device groups come by drop-in only, as docs/operations.md says
    assert "SupplementaryGroups" not in service and "`SupplementaryGroups=rdma video`" in install
    memlock = _operations_section("Pinned memory")
    assert "`LimitMEMLOCK=infinity`" in memlock
    users = _operations_section("Who may use the daemon")
    assert f"usermod -aG {service['Group']} alice" in users
