"""A second uid for the identity tests: the users they run clients as, and how a client drops to one."""

from __future__ import annotations

import grp
import json
import os
import pwd
import subprocess
import sys
import textwrap

GROUP, OTHER, OUTSIDER = "tpd-test", "tpd-other", "tpd-outsider"

_DROP = """
    import json, os, sys
    import click.testing, numpy, zmq, msgpack  # everything the client needs, loaded while still root: the
    import gpuclient, gpuclient.cuda_memory, transportd_cli.ctl  # interpreter may live where the user cannot read
    from transportd.control.client import ControlConnection
    from transportd.errors import RequestError
    from transportd.control.protocol import Hello, Inspect, Join, Register, Stats
    os.setgroups([])
    os.setgid(int(os.environ["TPD_AS_GID"]))
    os.setuid(int(os.environ["TPD_AS_UID"]))
    assert os.getuid() == int(os.environ["TPD_AS_UID"]) and os.getgroups() in ([], [os.getgid()])
"""


def ensure_user(name: str, group: str) -> pwd.struct_passwd:
    """The system user ``name`` with primary group ``group``, both created if missing (needs root)."""
    try:
        grp.getgrnam(group)
    except KeyError:
        subprocess.run(["groupadd", "--system", group], check=True)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--gid", group, "--shell", "/usr/sbin/nologin",
                        name], check=True)
        return pwd.getpwnam(name)


def run_as(user: pwd.struct_passwd, script: str, *args: str, timeout: float = 60) -> dict:
    """Run ``script`` in a process that drops to ``user`` (its uid and primary gid, no other groups) before
    the script starts; the script's last line is JSON."""
    env = {**os.environ, "HOME": "/", "TPD_AS_UID": str(user.pw_uid), "TPD_AS_GID": str(user.pw_gid)}
    code = textwrap.dedent(_DROP) + textwrap.dedent(script)
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd="/", env=env)
    assert proc.returncode == 0, f"client as {user.pw_name} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
