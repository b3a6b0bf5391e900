"""gpuclient: the client library — host API (connect, join, register, flags, channels) and the CUDA header.

The CPU producer (``ChannelHandle``) speaks the same ring protocol as the device API, so CPU clients and
tests exercise the daemon exactly as GPU kernels do.
"""

from pathlib import Path

from gpuclient.host_memory import HostBufferError, host_array
from gpuclient.session import (
    ChannelError,
    ChannelHandle,
    Client,
    FlagArray,
    Region,
    Session,
    SignalOp,
    connect,
)

__all__ = [
    "ChannelError",
    "ChannelHandle",
    "Client",
    "FlagArray",
    "HostBufferError",
    "Region",
    "Session",
    "SignalOp",
    "connect",
    "get_include",
    "host_array",
]


def get_include() -> str:
    """The include directory for ``transportd/client.cuh`` and ``transportd/cmd_ring.h``."""
    return str(Path(__file__).parent / "include")
