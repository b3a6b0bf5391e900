"""Soft-only knobs and hooks: things real hardware sets elsewhere (fabric, firmware) or does not have.

Nothing here exists in pyverbs; an API-agreement test ignores this package by name (`softverbs.soft.bench`
holds the `transportd bench softverbs` command for the same reason, and `softverbs.soft.batch` the
compiled data path's one-call-per-pass entry points, `post_wr_batch` and `poll_wc_batch`). Knobs:

- `add_device(name, kind, host=..., port=..., advertise=...)`: another soft device in this process
  ("ib" = ConnectX-like RC, "efa" = EFA-like SRD). Defaults: `softib0` and `softefa0` on 127.0.0.1,
  ephemeral port; `SOFTVERBS_LISTEN=host[:port]` changes the listen address of the defaults.
- `configure(device, **options)`: change a device's `DeviceOptions` (adaptive_routing, reorder_seed,
  reorder_window, reorder_window_bytes, packet_size, srd_packet_size, efa_device_caps, max_rdma_size,
  max_qp_wr, max_cqe, max_inline_data, connect_timeout_s, reconnect_backoff_s, srd_rnr_timer_ms,
  direct_packet_size, local_sockets, io_spin_s, and the NIC model below). Listen address options apply at
  next open.
  After a failed connect, WRs toward that endpoint fail at once for `reconnect_backoff_s`. `local_sockets`
  (default on): a device also listens on an abstract Unix socket named after its advertised address and
  port, and connects to a peer there when one on this host (the same network namespace) listens, else over
  TCP, whose loopback costs more per frame. `io_spin_s` (default 0): the device's I/O thread stays awake
  that long after its last event, polling its sockets with the GIL released before it sleeps in epoll, so
  the next frame does not wait for a wake-up; it costs a core per device while traffic flows.
- The NIC model (`softverbs._link`): `nic_bandwidth` (bytes/s), `nic_latency_s` (s) and
  `nic_message_rate` (messages/s) shape what a device sends: each request lands when a link of that
  bandwidth and message rate, taking requests one after another, has carried it, plus the latency.
  None / 0: unshaped. Per-QP order is kept; acknowledgements, read responses and requests to the device
  itself (loopback: never on the wire) are not shaped. `nic_spin_s` (default 30 µs): how long before a request
  lands a thread waits for it awake (GIL released) instead of asleep: one landing within that of its post,
  none queued ahead, leaves from the posting thread; the I/O thread wakes that long before a queued one
  lands. 0: the I/O thread sleeps until each landing.
- `set_direct_copier(copier)`: a `DirectCopier` (export, open, close, copy) lets this process's devices
  place writes from device memory between processes on one host with one copy, agreed per connection and
  allocation (`softverbs._direct`); `ShmCopier` does it for host memory in /dev/shm (tests).
- `device_stats(device, reset=False)`: the device's counters (direct writes, imports) and its link's
  schedule (messages, bytes, busy time, span).
- `set_adaptive_routing(ctx_or_qp, on)`: RC adaptive routing for a whole device or one QP (the requester's
  setting decides how its packets are placed). `SOFTVERBS_ADAPTIVE_ROUTING=1` turns it on for the defaults.
- `set_placement_observer(ctx, fn)`: `fn(qp_num, addr, length)` runs on the device's I/O thread after
  each placement of inbound data into memory; tests use it to see the order in which bytes land.
- `wait_closed(timeout=None)`: wait until every resource dropped without `close()` that the cyclic
  collector or a softverbs thread found is closed (`softverbs._dropped`: those close on a thread of their
  own; a resource whose last reference goes on an ordinary thread closes there at once).
- `register_memory(base, length, accessor)`: memory the CPU cannot address (GPU memory) is read and
  written through `accessor` (a `MemoryAccessor`); MRs inside that range use it. `HostAccessor` is a
  host-memory implementation for tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from .._device import STAT_NAMES, DeviceOptions, SoftDevice
from .._direct import DirectCopier, ShmCopier, copier, set_copier
from .._dropped import wait_closed
from .._memory import ACCESSORS, HostAccessor, MemoryAccessor
from ..addr import endpoint_from_gid, gid_for_endpoint

__all__ = [
    "DeviceOptions", "DirectCopier", "HostAccessor", "MemoryAccessor", "ShmCopier", "add_device", "configure",
    "device_options", "device_stats", "direct_copier", "endpoint_from_gid", "endpoint_of", "gid_for_endpoint",
    "register_memory", "set_adaptive_routing", "set_direct_copier", "set_placement_observer", "unregister_memory",
    "wait_closed",
]

_OPTION_NAMES = {f.name for f in fields(DeviceOptions)}


def _device(target: Any) -> SoftDevice:
    from ..device import registry

    if isinstance(target, str):
        dev = registry().get(target)
        if dev is None:
            raise KeyError(f"no soft device named {target!r}")
        return dev
    dev = getattr(target, "_dev", None)
    if dev is None:
        core = getattr(target, "_core", None)
        dev = getattr(core, "device", None)
    if not isinstance(dev, SoftDevice):
        raise TypeError(f"{type(target).__name__} is not a softverbs object")
    return dev


def add_device(name: str, kind: str = "ib", **options: Any) -> None:
    """Register another soft device in this process (e.g. a second "node" for one-process tests)."""
    from ..device import registry

    if kind not in ("ib", "efa"):
        raise ValueError("kind must be 'ib' or 'efa'")
    bad = set(options) - _OPTION_NAMES
    if bad:
        raise TypeError(f"unknown device options: {sorted(bad)}")
    reg = registry()
    if name in reg:
        raise ValueError(f"soft device {name!r} exists")
    reg[name] = SoftDevice(name, DeviceOptions(kind=kind, **options))


def configure(target: Any, **options: Any) -> None:
    """Change options of a device (by name, or of a Context/PD/QP on it)."""
    dev = _device(target)
    bad = set(options) - _OPTION_NAMES - {"kind"}
    if bad or "kind" in options:
        raise TypeError(f"unknown or fixed device options: {sorted(bad | ({'kind'} & set(options)))}")
    for key, val in options.items():
        setattr(dev.options, key, val)
    if "reorder_seed" in options:
        dev.rng.seed(options["reorder_seed"])


def device_options(target: Any) -> DeviceOptions:
    return _device(target).options


def set_adaptive_routing(target: Any, enabled: bool | None) -> None:
    """Adaptive routing for a device's QPs (Context or name) or one QP (None = follow the device)."""
    core = getattr(target, "_core", None)
    if core is not None and hasattr(core, "qpn"):
        core.ar = enabled
        return
    _device(target).options.adaptive_routing = bool(enabled)


def set_placement_observer(target: Any, fn: Callable[[int, int, int], None] | None) -> None:
    """Call fn(qp_num, addr, length) after every placement of inbound bytes on this device."""
    _device(target).placement_observer = fn


def endpoint_of(target: Any) -> tuple[str, int]:
    """(host, port) that peers reach this device at (the device must be open)."""
    dev = _device(target)
    return dev.advertise, dev.port


def register_memory(base: int, length: int, accessor: MemoryAccessor) -> None:
    """Serve [base, base+length) through `accessor` (call before registering MRs in the range)."""
    ACCESSORS.register(base, length, accessor)


def unregister_memory(base: int) -> None:
    ACCESSORS.unregister(base)


def set_direct_copier(obj: DirectCopier | None) -> None:
    """Place writes from device memory between processes on one host by direct copies (None: never)."""
    if obj is not None and not isinstance(obj, DirectCopier):
        raise TypeError(f"{type(obj).__name__} is not a DirectCopier (export_range, open_export, close_export, copy)")
    set_copier(obj)


def direct_copier() -> DirectCopier | None:
    return copier()


def device_stats(target: Any, reset: bool = False) -> dict[str, Any]:
    """A device's counters (`softverbs._device.STAT_NAMES`) and its link's schedule under "link"
    (messages, bytes, busy_s, span_s: `softverbs._link.LinkModel.stats`); ``reset`` zeroes them after."""
    dev = _device(target)
    out: dict[str, Any] = {name: dev.stats[name] for name in STAT_NAMES}
    with dev._dep_lock:
        out["link"] = dev.link.stats()
        if reset:
            dev.link.reset_stats()
    if reset:
        for name in STAT_NAMES:
            dev.stats[name] = 0
    return out
