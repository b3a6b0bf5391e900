"""gpuclient: the client library — host API (connect, join, register, flags, channels) and the CUDA header.

The CPU producer (``ChannelHandle``) speaks the same ring protocol as the device API, so CPU clients and
tests exercise the daemon exactly as GPU kernels do. GPU memory, device flags, channel handles for
kernels (``ch.device_handle()``), chunk plans on the GPU (``ChunkPlan.to_device``) and ``compile`` need
cuda-python, imported only when first used.
"""

from cmd_ring.errors import CudaError
from gpuclient.compiler import compile, get_include, get_include_dirs
from gpuclient.device_channel import CHANNEL_DTYPE, DeviceChannel, DeviceFlags
from gpuclient.errors import ChannelError, CompileError, HostBufferError, LauncherError, PlanError
from gpuclient.host_memory import host_array
from gpuclient.launcher import LaunchInfo, from_environment
from gpuclient.plan import (
    PLAN_ABI,
    PLAN_CHUNK_DTYPE,
    PLAN_DTYPE,
    PLAN_RECV_DTYPE,
    PLAN_SEND_DTYPE,
    PLAN_SIZE,
    ChunkPlan,
    DevicePlan,
)
from gpuclient.session import (
    ChannelHandle,
    Client,
    FlagArray,
    Region,
    Session,
    SignalOp,
    connect,
    exchange_all,
)

__all__ = [
    "CHANNEL_DTYPE",
    "PLAN_ABI",
    "PLAN_CHUNK_DTYPE",
    "PLAN_DTYPE",
    "PLAN_RECV_DTYPE",
    "PLAN_SEND_DTYPE",
    "PLAN_SIZE",
    "ChannelError",
    "ChannelHandle",
    "ChunkPlan",
    "Client",
    "CompileError",
    "CudaError",
    "DeviceChannel",
    "DeviceFlags",
    "DevicePlan",
    "FlagArray",
    "HostBufferError",
    "LaunchInfo",
    "LauncherError",
    "PlanError",
    "Region",
    "Session",
    "SignalOp",
    "compile",
    "connect",
    "exchange_all",
    "from_environment",
    "get_include",
    "get_include_dirs",
    "host_array",
]

