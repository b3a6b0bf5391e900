"""free_port: the ports LocalCluster and the tests give daemons to bind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from transportd_cli.localcluster import free_port

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    # outgoing connections take ports from the ephemeral range; a port from there could be gone by bind time
    assert all(p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
