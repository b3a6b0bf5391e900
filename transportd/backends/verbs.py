"""The one place backends get verbs from: real pyverbs where an RDMA device exists, softverbs otherwise.

Backends never import pyverbs or softverbs themselves; they call :func:`load` and use the namespace it
returns, whose attributes are the pyverbs modules by their pyverbs names (``device``, ``pd``, ``mr``,
``cq``, ``qp``, ``wr``, ``addr``, ``libibverbs_enums``, ``pyverbs_error``, ``efadv``, ``efa_enums``) plus
short aliases (``enums``, ``error``) and ``name`` ("pyverbs" or "soft").

Which provider: the explicit argument (from config ``[backend] verbs``), else ``TRANSPORTD_VERBS``
(``soft`` | ``pyverbs`` | ``auto``), else ``auto``: pyverbs if it imports and reports at least one device,
else softverbs with ``fallback`` set (production configs say ``pyverbs``, which fails instead).
pyverbs' ``get_device_list()`` raises ``PyverbsRDMAError`` when there is no device rather than returning
``[]``; both mean "no device" here.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from transportd.errors import VerbsUnavailableError

__all__ = ["ENV", "PROVIDERS", "VerbsModules", "configure_soft", "load", "pyverbs_devices"]

ENV = "TRANSPORTD_VERBS"
PROVIDERS = ("auto", "soft", "pyverbs")
_MODULES = ("device", "pd", "mr", "cq", "qp", "wr", "addr", "libibverbs_enums", "pyverbs_error")


@dataclass(frozen=True)
class VerbsModules:
    """The verbs modules of one provider, by pyverbs' module names."""

    name: str
    device: ModuleType
    pd: ModuleType
    mr: ModuleType
    cq: ModuleType
    qp: ModuleType
    wr: ModuleType
    addr: ModuleType
    libibverbs_enums: ModuleType
    pyverbs_error: ModuleType
    efadv: ModuleType | None
    efa_enums: ModuleType | None
    soft: ModuleType | None  # softverbs.soft (knobs) for the soft provider, else None
    #: True when "auto" found no RDMA device and chose softverbs: data then moves over TCP, which a node
    #: meant to use its NICs must hear about (the rail worker warns; status and metrics show it)
    fallback: bool = False

    @property
    def enums(self) -> ModuleType:
        return self.libibverbs_enums

    @property
    def error(self) -> ModuleType:
        return self.pyverbs_error


def _import_provider(pkg: str) -> VerbsModules:
    mods = {m: importlib.import_module(f"{pkg}.{m}") for m in _MODULES}
    try:
        efadv: ModuleType | None = importlib.import_module(f"{pkg}.providers.efa.efadv")
        efa_enums: ModuleType | None = importlib.import_module(f"{pkg}.providers.efa.efa_enums")
    except ImportError:
        efadv = efa_enums = None
    soft = importlib.import_module("softverbs.soft") if pkg == "softverbs" else None
    return VerbsModules(name="soft" if pkg == "softverbs" else "pyverbs", efadv=efadv, efa_enums=efa_enums,
                        soft=soft, **mods)


def pyverbs_devices() -> list[str] | None:
    """Names of the real RDMA devices, [] if pyverbs works but sees none, None if pyverbs is unusable."""
    try:
        device = importlib.import_module("pyverbs.device")
        err = importlib.import_module("pyverbs.pyverbs_error")
    except (ImportError, OSError):
        return None
    try:
        devs = device.get_device_list()
    except err.PyverbsError:
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devs]


def configure_soft(options: Mapping[str, Any] | Any) -> None:
    """Apply ``[softverbs]`` settings (host, adaptive_routing, reorder_seed, the NIC model's nic_bandwidth,
    nic_latency_s, nic_message_rate, nic_spin_s and nic_streaming, io_spin_s; a mapping or the config dataclass) to the
    default soft devices, and ``gil_switch_interval_s`` (0: left as it is) to this process. The listen host
    takes effect when a device is next opened. (``direct_copy`` and
    ``direct_copy_via`` are the rail worker's: it installs its GPU memory, which places copies one way or the
    other, as the process's direct copier.)

    ``devices`` (only in a mapping: the rail worker adds it, it is not a config key) names soft devices the
    caller needs, as ``{name: kind}`` (kind "ib" or "efa") or a list of names (kind "ib"). Those that do not
    exist yet in this process are created (``softverbs.soft.add_device``, ephemeral port), and every setting
    above applies to them as to the defaults. This is how a rail configured with a device such as
    ``softib1`` gets one; pyverbs never sees this option, so real NICs are never invented.
    """
    from softverbs import soft

    get = options.get if isinstance(options, Mapping) else (lambda k, d=None: getattr(options, k, d))
    changes: dict[str, Any] = {}
    host = get("host", None)
    if host:
        changes["host"] = host
        changes["advertise"] = None if host in ("0.0.0.0", "") else host
    for name in ("adaptive_routing", "nic_streaming"):
        if get(name, None) is not None:
            changes[name] = bool(get(name))
    seed = get("reorder_seed", None)
    if seed is not None:
        changes["reorder_seed"] = None if seed < 0 else int(seed)
    for name in ("nic_bandwidth", "nic_message_rate"):  # 0: unshaped
        value = get(name, None)
        if value is not None:
            changes[name] = float(value) or None
    for name in ("nic_latency_s", "nic_spin_s", "io_spin_s"):
        value = get(name, None)
        if value is not None:
            changes[name] = float(value)
    switch = get("gil_switch_interval_s", None)
    if switch:  # process-wide: the soft devices' threads and the worker's share one GIL
        sys.setswitchinterval(float(switch))
    wanted = get("devices", None) or {}
    if not isinstance(wanted, Mapping):
        wanted = dict.fromkeys(wanted, "ib")
    names = ["softib0", "softefa0"]
    for name, kind in wanted.items():
        if name not in names:
            names.append(name)
        if not _soft_device_exists(soft, name):
            base = soft.device_options("softefa0" if kind == "efa" else "softib0")  # the defaults' listen host
            soft.add_device(name, kind, host=base.host, advertise=base.advertise,
                            adaptive_routing=base.adaptive_routing)
    for name in names:
        soft.configure(name, **changes)


def _soft_device_exists(soft: ModuleType, name: str) -> bool:
    try:
        soft.device_options(name)
    except KeyError:
        return False
    return True


def load(provider: str | None = None, *, soft_options: Mapping[str, Any] | Any = None) -> VerbsModules:
    """The verbs namespace for ``provider`` (None: ``$TRANSPORTD_VERBS``, else "auto").

    ``soft_options`` (the ``[softverbs]`` config) is applied when the soft provider is chosen.
    """
    choice = (provider or os.environ.get(ENV) or "auto").strip().lower()
    if choice not in PROVIDERS:
        raise VerbsUnavailableError(f"unknown verbs provider {choice!r}; choose one of {', '.join(PROVIDERS)}")
    fallback = False
    if choice == "auto":
        choice = "pyverbs" if pyverbs_devices() else "soft"
        fallback = choice == "soft"
    if choice == "pyverbs":
        try:
            return _import_provider("pyverbs")
        except (ImportError, OSError) as exc:
            raise VerbsUnavailableError(
                f"pyverbs cannot be imported ({exc}); install rdma-core 59's pyverbs or set {ENV}=soft "
                "(docs/design.md, \"pyverbs from the node's rdma-core\")") from exc
    mods = _import_provider("softverbs")
    if soft_options is not None:
        configure_soft(soft_options)
    return dataclasses.replace(mods, fallback=True) if fallback else mods
