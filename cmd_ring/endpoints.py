"""Where a client finds the daemon: the default control endpoint, the variable that overrides it, and the
check both sides apply to an endpoint string (the daemon's config on ``control.socket``, a client on
``--socket`` or ``socket=`` before zmq sees it). The config re-exports these names."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_SOCKET", "SOCKET_ENV", "check_control_endpoint", "endpoint_check", "host_port"]

DEFAULT_SOCKET = "ipc:///run/transportd/control.sock"
SOCKET_ENV = "TRANSPORTD_SOCKET"


def host_port(value: str) -> str:
    """``value`` if it is ``host:port`` (IPv6 as ``[addr]:port``, port 1..65535); else :class:`ValueError`."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d+)", value)
    if not match:
        raise ValueError(f"expected 'host:port' (IPv6 as '[addr]:port'), got {value!r}")
    if not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(f"port must be 1..65535, got {match.group(2)}")
    return value


def endpoint_check(*, ipc: bool) -> Callable[[Any], Any]:
    """A check for an endpoint string: ``tcp://host:port`` (``*`` for any host), and ``ipc://`` too when ``ipc``."""
    def check(value: str) -> str:
        if value.startswith("tcp://"):
            address = value[len("tcp://"):]
            host_port("0.0.0.0" + address[1:] if address.startswith("*:") else address)
            return value
        if ipc and value.startswith("ipc://"):
            path = value[len("ipc://"):]
            if not path.startswith("/") and not path.startswith("@"):
                raise ValueError(f"ipc endpoint needs an absolute path (ipc:///...), got {value!r}")
            return value
        schemes = "'ipc:///path' or 'tcp://host:port'" if ipc else "'tcp://host:port'"
        raise ValueError(f"expected {schemes}, got {value!r}")

    return check


def check_control_endpoint(value: str) -> str:
    """``value`` if it is a control endpoint (``ipc:///path``, ``ipc://@abstract`` or ``tcp://host:port``);
    else :class:`ValueError` saying what was expected. Clients check ``--socket`` with it before zmq sees it."""
    return endpoint_check(ipc=True)(value)
