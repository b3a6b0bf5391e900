"""The device half of a channel: the ``tpd::Channel`` handle a kernel takes by value, and device flags.

``CHANNEL_DTYPE`` mirrors ``struct tpd::Channel`` (``include/transportd/channel_device.cuh``) byte for byte;
a test compiles a probe against the header and compares every offset::

    word 0  | records:u64   device address of ring slot 0 (ring file, mapped pinned host memory)  |
    word 1  | control:u64   device address of the ring's control page (credits, QUIET, errors)    |
    word 2  | head:u64      device address of the slot-claim counter (device memory)              |
    word 3  | credit:u64    device address of the cached consumer position (device memory)        |
    word 4  | capacity:u32                  | abi:u32                                             |
    word 5  | flags:u64     device address of this rank's flag words (device or mapped host)      |
    word 6  | flag_count:u32                | rank:u32                                            |
    word 7  | world:u32                     | id:u32                                              |

The client maps the ring file into the GPU's address space (``cuMemHostRegister`` with DEVICEMAP) and
allocates the head and credit words in device memory; flags are either the daemon's host flag file
(mapped the same way) or device memory this client allocated and registered by IPC handle
(``session.flags(count, where="device")``), into which the daemon publishes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cmd_ring.flagfile import HEADER_BYTES, FlagFile
from cmd_ring.ring import CONTROL_BYTES

if TYPE_CHECKING:
    from gpuclient.cuda_memory import DeviceMemory, HostMapping
    from gpuclient.session import ChannelHandle, Session

__all__ = ["CHANNEL_ABI", "CHANNEL_DTYPE", "CHANNEL_SIZE", "RING_DTYPE", "ChannelStruct", "DeviceChannel",
           "DeviceFlags", "DeviceRing", "device_handle", "map_ring"]

CHANNEL_ABI = 1  # TPD_CHANNEL_ABI
CHANNEL_SIZE = 64  # TPD_CHANNEL_SIZE

CHANNEL_DTYPE = np.dtype(
    [
        ("records", "<u8"),
        ("control", "<u8"),
        ("head", "<u8"),
        ("credit", "<u8"),
        ("capacity", "<u4"),
        ("abi", "<u4"),
        ("flags", "<u8"),
        ("flag_count", "<u4"),
        ("rank", "<u4"),
        ("world", "<u4"),
        ("id", "<u4"),
    ],
    align=True,
)
assert CHANNEL_DTYPE.itemsize == CHANNEL_SIZE

#: ``struct tpd::RingDevice`` (ring_device.cuh): the first five words of a Channel, usable on its own.
RING_DTYPE = np.dtype([(name, CHANNEL_DTYPE.fields[name][0]) for name in CHANNEL_DTYPE.names[:6]], align=True)
assert RING_DTYPE.itemsize == 40


class ChannelStruct(ctypes.Structure):
    """A ctypes view of ``tpd::Channel`` (same fields and offsets as CHANNEL_DTYPE)."""

    _fields_ = [(name, ctypes.c_uint64 if CHANNEL_DTYPE.fields[name][0].itemsize == 8 else ctypes.c_uint32)
                for name in CHANNEL_DTYPE.names]


assert ctypes.sizeof(ChannelStruct) == CHANNEL_SIZE


@dataclass
class DeviceRing:
    """A ring mapped for kernels: the file registered with CUDA plus the head/credit words in device memory."""

    ring_map: HostMapping
    counters: DeviceMemory  # u64 head at 0, u64 credit at 8
    value: np.ndarray = field(repr=False)  # one RING_DTYPE record

    @property
    def bytes(self) -> bytes:
        """The 40 bytes of ``tpd::RingDevice`` (a kernel argument)."""
        return self.value.tobytes()

    def head(self) -> int:
        """Positions claimed by kernels so far (reads the device head word)."""
        return int.from_bytes(self.counters.read(0, 8), "little")

    def release(self) -> None:
        self.counters.free()
        self.ring_map.unmap()


def map_ring(ring: Any, device: int) -> DeviceRing:
    """Map ``ring`` (a ``cmd_ring.RingFile``) into ``device``'s address space and allocate its head and credit.

    The head starts at the ring's host producer position and the credit cache at its consumer position,
    so a kernel continues where a CPU producer stopped (never drive one ring from both at once).
    """
    from gpuclient.cuda_memory import DeviceMemory, map_host

    ring_map = map_host(ring.address, ring.size, device)
    try:
        counters = DeviceMemory(16, device)
    except BaseException:
        ring_map.unmap()
        raise
    counters.write(0, int(ring.producer_pos).to_bytes(8, "little") + int(ring.consumer_pos).to_bytes(8, "little"))
    value = np.zeros(1, dtype=RING_DTYPE)
    value[0] = (ring_map.device_ptr + CONTROL_BYTES, ring_map.device_ptr, counters.ptr, counters.ptr + 8,
                ring.capacity, CHANNEL_ABI)
    return DeviceRing(ring_map, counters, value)


@dataclass
class DeviceChannel:
    """The GPU resources behind one channel's handle; ``handle`` is the kernel argument."""

    channel: ChannelHandle
    device: int
    ring: DeviceRing
    flags_map: HostMapping | None
    value: np.ndarray = field(repr=False)  # one CHANNEL_DTYPE record

    @property
    def bytes(self) -> bytes:
        """The 64 bytes of ``tpd::Channel`` to pass as a kernel argument."""
        return self.value.tobytes()

    @property
    def ctypes(self) -> ChannelStruct:
        """The handle as a ctypes structure (for launchers that take ctypes arguments)."""
        return ChannelStruct.from_buffer_copy(self.bytes)

    def __bytes__(self) -> bytes:
        return self.bytes

    def head(self) -> int:
        """Positions claimed by kernels so far (reads the device head word)."""
        return self.ring.head()

    def release(self) -> None:
        """Free the device words and unregister the host mappings (the channel must be idle)."""
        self.ring.release()
        if self.flags_map is not None:
            self.flags_map.unmap()


class DeviceFlags:
    """A rank's flag words in GPU memory, allocated here and registered with the daemon by IPC handle.

    Session.wait reads them with small device-to-host copies (``values[slot]``); kernels read them in
    place through the channel handle. ``status`` is the daemon's session-wide error word (host file).
    """

    def __init__(self, status_file: FlagFile, count: int, memory: DeviceMemory) -> None:
        """``status_file``: the daemon's host flag array (its status word), mapped from its descriptor."""
        self._file = status_file
        self.memory = memory
        self.count = count
        self.device_ptr = memory.ptr
        self.values = _DeviceWords(memory, count)

    @property
    def status(self) -> int:
        return self._file.status

    def __getitem__(self, slot: int) -> int:
        return int(self.values[slot])

    def __len__(self) -> int:
        return self.count


class _DeviceWords:
    """``words[i]`` reads one little-endian u64 from device memory; ``words[:]`` reads them all."""

    def __init__(self, memory: DeviceMemory, count: int) -> None:
        self._memory = memory
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return np.frombuffer(self._memory.read(0, 8 * self._count), dtype="<u8")[index]
        if not -self._count <= index < self._count:
            raise IndexError(f"flag slot {index} out of range ({self._count})")
        index %= self._count
        return np.uint64(int.from_bytes(self._memory.read(8 * index, 8), "little"))


def allocate_device_flags(count: int, device: int) -> tuple[DeviceMemory, bytes, int]:
    """Zeroed device memory for ``count`` flag words, its IPC handle and offset (for the Flags request)."""
    from gpuclient.cuda_memory import DeviceMemory, export_ipc

    memory = DeviceMemory(8 * count, device)
    exported = export_ipc(memory.buffer())
    return memory, exported.handle, exported.offset


def flag_pointer(session: Session, device: int) -> tuple[int, int, HostMapping | None]:
    """(device address, count, mapping) of the session's flags; (0, 0, None) without flags."""
    from gpuclient.cuda_memory import map_host

    flags = session.flag_array
    if flags is None:
        return 0, 0, None
    if isinstance(flags, DeviceFlags):
        return flags.device_ptr, flags.count, None
    flag_file: FlagFile = flags._file  # a host flag file: map the whole file, point past its header
    base = flag_file.address - HEADER_BYTES
    mapping = map_host(base, len(flag_file._mm), device)
    return mapping.device_ptr + HEADER_BYTES, flags.count, mapping


def device_handle(channel: ChannelHandle, device: int | None = None) -> DeviceChannel:
    """Build (once per channel) the device resources and the ``tpd::Channel`` value for ``channel``.

    Call it after ``session.flags(...)`` so the handle carries the flags. A channel driven from a kernel
    must not also be pushed to from the CPU (the two would keep separate heads).
    """
    from gpuclient.cuda_memory import use_device

    existing = channel._device_channel
    if existing is not None:
        return existing
    session = channel._session
    if device is None:
        device = session.device if getattr(session, "device", None) not in (None, -1) else 0
    use_device(device)
    ring = map_ring(channel.ring, device)
    flags_ptr, flag_count, flags_map = flag_pointer(session, device)
    value = np.zeros(1, dtype=CHANNEL_DTYPE)
    value[0] = tuple(ring.value[0]) + (flags_ptr, flag_count, session.rank, session.world, channel.id)
    dc = DeviceChannel(channel, device, ring, flags_map, value)
    channel._device_channel = dc
    return dc
