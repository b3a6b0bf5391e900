"""gpuclient: the client library — host API (connect, join, register, flags, channels) and the CUDA header.

The CPU producer (``ChannelHandle``) speaks the same ring protocol as the device API, so CPU clients and
tests exercise the daemon exactly as GPU kernels do. GPU memory, device flags, channel handles for
kernels (``ch.device_handle()``) and ``compile`` need cuda-python, imported only when first used.
"""

from gpuclient.compiler import compile, get_include
from gpuclient.device_channel import CHANNEL_DTYPE, DeviceChannel, DeviceFlags
from gpuclient.errors import ChannelError, CompileError, HostBufferError, LauncherError
from gpuclient.host_memory import host_array
from gpuclient.launcher import LaunchInfo, from_environment
from gpuclient.session import (
    ChannelHandle,
    Client,
    FlagArray,
    Region,
    Session,
    SignalOp,
    connect,
)
from transportd.errors import CudaError

__all__ = [
    "CHANNEL_DTYPE",
    "ChannelError",
    "ChannelHandle",
    "Client",
    "CompileError",
    "CudaError",
    "DeviceChannel",
    "DeviceFlags",
    "FlagArray",
    "HostBufferError",
    "LaunchInfo",
    "LauncherError",
    "Region",
    "Session",
    "SignalOp",
    "compile",
    "connect",
    "from_environment",
    "get_include",
    "host_array",
]

