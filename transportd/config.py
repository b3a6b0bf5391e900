"""The daemon's TOML config: every key defaulted, typed and checked before anything starts.

Each section is a frozen msgspec Struct whose fields carry their default, their limits and their meaning
in their annotation (:func:`key`: ``Meta(ge=, le=, description=)``, plus a ``check`` where a rule is more
than a range), so the defaults, the validation (:mod:`transportd.schema`, the same mechanism the protocol's
messages use) and the documentation table (:func:`describe_keys`, the table in docs/config.md) come from one
definition. Loading refuses unknown sections and keys, wrong types and bad values with a
:class:`ConfigError` naming the file, the dotted key and the reason — a typo must not silently become a
default. Relative paths in ``[security]`` are taken relative to the config file.

``TRANSPORTD_SOCKET`` in the environment overrides ``control.socket`` (the same variable clients read).
"""

from __future__ import annotations

import os
import re
import socket as _socket
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from cmd_ring.endpoints import DEFAULT_SOCKET, SOCKET_ENV, check_control_endpoint
from cmd_ring.endpoints import endpoint_check as _endpoint
from cmd_ring.endpoints import host_port as _host_port
from transportd import schema
from transportd.backends import EfaOptions, IbOptions, config_problems
from transportd.errors import ConfigError, Invalid
from transportd.limits import (
    MAX_BATCH,
    MAX_CHANNEL_CAPACITY,
    MAX_DEVICE,
    MAX_INFLIGHT_CAP,
    MAX_RAILS,
    MAX_TAKE,
    MIN_BATCH,
    MIN_CHANNEL_CAPACITY,
    MIN_INFLIGHT_CAP,
    MIN_TAKE,
)

__all__ = [
    "DEFAULT_SOCKET",
    "KEYS",
    "SOCKET_ENV",
    "BackendConfig",
    "Config",
    "ControlConfig",
    "EfaConfig",
    "FLAG_PUBLICATIONS",
    "FlagsConfig",
    "REMOVED_KEYS",
    "KeyInfo",
    "LoggingConfig",
    "MetricsConfig",
    "NodeConfig",
    "PeersConfig",
    "ProxyConfig",
    "RailConfig",
    "Section",
    "SecurityConfig",
    "SignalConfig",
    "SoftverbsConfig",
    "WORDS",
    "check_control_endpoint",
    "default_config",
    "describe_keys",
    "example_config",
    "key",
    "load_config",
]

DEFAULT_PEER_PORT = 18515


# ---------------------------------------------------------------------------------------------------------
# Value checks: each takes the type-checked value and returns it (possibly normalised) or raises ValueError.

# Ranges are not here: they are the fields' Meta(ge=, le=), which msgspec checks before these run.

Check = Callable[[Any], Any]


def _power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"must be a power of two, got {value}")
    return value


def _none_if_empty(value: str | None) -> str | None:
    return value or None


def _mode(value: int | str) -> int:
    if isinstance(value, str):
        if not re.fullmatch(r"(0o)?[0-7]{1,4}", value):
            raise ValueError(f"expected an octal mode such as 0o660 or \"0660\", got {value!r}")
        value = int(value.removeprefix("0o"), 8)
    if not 0 <= value <= 0o777:
        if re.fullmatch(r"[0-7]{3,4}", str(value)) and int(str(value), 8) <= 0o777:
            # `mode = 660` in TOML is the decimal number 660 (0o1224), not the octal mode the user meant
            raise ValueError(f"{value} is a decimal number in TOML; an octal mode needs 0o{value} (or \"0{value}\")")
        raise ValueError(f"must be a permission mode in 0..0o777, got {oct(value)}")
    return value


def _node_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", value):
        raise ValueError(f"{value!r} is not a node name (letters, digits, '.', '_', '-'; at most 253)")
    return value


def _optional_host_port(value: str) -> str:
    return value if value == "" else _host_port(value)


def _level(value: str) -> str:
    level = value.lower()
    if level not in ("debug", "info", "warning", "error", "critical"):
        raise ValueError(f"must be one of debug, info, warning, error, critical, got {value!r}")
    return level


# ---------------------------------------------------------------------------------------------------------
# Sections. Each field states its type, default, limits and meaning once, in its annotation.


def key(meaning: str, *, check: Check | None = None, default_doc: str | None = None, example: str | None = None,
        **limits: Any) -> msgspec.Meta:
    """A config key's Meta: what it means (docs/config.md's table), its limits (``ge``, ``le``, ...), an optional
    ``check`` (raises ValueError, may normalise), how to show its default where the value would mislead, and
    (``example``, TOML) a value the example config shows where that default is words, not a value."""
    extra = {name: value for name, value in (("check", check), ("default_doc", default_doc), ("example", example))
             if value is not None}
    return msgspec.Meta(description=meaning, extra=extra or None, **limits)


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every config table: immutable, and no key it does not name."""


class NodeConfig(Section):
    """[node]"""

    name: Annotated[str, key("This node's name in peer messages, logs and metrics.", check=_node_name,
                             default_doc="the host name", example='"node1"')] = msgspec.field(
        default_factory=_socket.gethostname)


class ControlConfig(Section):
    """[control] — the local client socket."""

    socket: Annotated[str, key(f"Client endpoint (ipc:// or tcp://); ${SOCKET_ENV} overrides it.",
                               check=_endpoint(ipc=True))] = DEFAULT_SOCKET
    # an int once loaded; TOML may also say "0660"
    mode: Annotated[int | str, key("Permission bits of an ipc socket file (octal).", check=_mode,
                                   default_doc="0o660")] = 0o660
    group: Annotated[str | None, key(
        "Group owning the ipc socket file; members may use the daemon. Empty: the daemon's group.",
        check=_none_if_empty)] = None
    max_message_bytes: Annotated[int, key(
        "Largest control message accepted; larger ones get a too_large error reply.",
        ge=4096, le=64 << 20)] = 1 << 20
    client_timeout_s: Annotated[float, key(
        "Seconds a session may stay silent before it is reclaimed (the client library sends keepalives at "
        "a quarter of it): sessions over tcp, and ipc sessions the kernel gave no pid for (a client in "
        "another pid namespace; its session still ends when its descriptor connection closes). An ipc "
        "session that vouched on the descriptor socket is watched by the pid SO_PEERCRED names and by that "
        "connection instead: reclaimed as soon as its process exits or the connection closes, kept while "
        "both last, however silent.", ge=0.5, le=86400.0)] = 30.0
    vouch_timeout_s: Annotated[float, key(
        "Seconds a connection to the descriptor socket may stay without presenting a valid hello token; "
        "then it is closed.", ge=0.05, le=600.0)] = 5.0
    max_unvouched: Annotated[int, key(
        "Connections to the descriptor socket waiting to vouch at once (a quarter of them per uid): a new "
        "one past that closes the oldest of its uid, or of the uid holding the most.", ge=4, le=4096)] = 64


class PeersConfig(Section):
    """[peers] — other nodes' daemons."""

    listen: Annotated[str, key("Endpoint peer daemons connect to.",
                               check=_endpoint(ipc=False))] = f"tcp://0.0.0.0:{DEFAULT_PEER_PORT}"
    static: Annotated[tuple[str, ...], key("Peer daemons to connect to at start, as 'host:port'.",
                                           check=_host_port)] = ()
    heartbeat_interval_s: Annotated[float, key("Seconds between heartbeats to each peer.",
                                               ge=0.01, le=60.0)] = 1.0
    heartbeat_timeout_s: Annotated[float, key(
        "Seconds without a heartbeat before a peer is declared lost (more than the interval).",
        ge=0.02, le=3600.0)] = 5.0
    ready_wait_s: Annotated[float, key(
        "Seconds the daemon waits for every static peer before it reports ready to systemd anyway "
        "(keep it below the unit's TimeoutStartSec).", ge=0.0, le=3600.0)] = 10.0
    restart_grace_s: Annotated[float, key(
        "Seconds a restarting peer daemon (one that said so, went silent, or came back as a new life) keeps "
        "its place in every job: records for it wait in the rings, it is shown as restarting, and only "
        "then its jobs' clients see PEER_LOST. Clients of this daemon wait as long for it to come back.",
        ge=0.0, le=3600.0)] = 10.0

    def _check(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise Invalid(("heartbeat_timeout_s",), f"must be more than peers.heartbeat_interval_s "
                                 f"({self.heartbeat_interval_s}), got {self.heartbeat_timeout_s}")


class SecurityConfig(Section):
    """[security] — CURVE authentication of peer daemons (and of tcp control clients)."""

    curve_secret_key_file: Annotated[str | None, key(
        "This daemon's CURVE secret key file (zmq certificate); enables CURVE when set.",
        check=_none_if_empty)] = None
    curve_public_key_file: Annotated[str | None, key(
        "This daemon's CURVE public key file, given to peers and clients.", check=_none_if_empty)] = None
    curve_authorized_keys_dir: Annotated[str | None, key(
        "Directory of public key files allowed to connect; required with a secret key.",
        check=_none_if_empty)] = None

    @property
    def curve_enabled(self) -> bool:
        """True when peer links (and tcp control sockets) must use CURVE."""
        return self.curve_secret_key_file is not None


class RailConfig(Section):
    """One entry of [[backend.rails]]: a NIC and the GPU / NUMA node it sits next to."""

    device: Annotated[str, key("Verbs device name, e.g. mlx5_0 or rdmap16s27.")]
    gpu: Annotated[int, key("Local GPU index closest to the NIC; -1: unknown.", ge=-1, le=MAX_DEVICE)] = -1
    numa_node: Annotated[int, key(
        "NUMA node of the NIC; the rail's worker is pinned to its CPUs. -1: the NIC's sysfs numa_node, "
        "else not pinned.", ge=-1, le=1023)] = -1
    loop_cpu: Annotated[int, key(
        "A CPU for the rail worker's loop alone (one of the worker's CPUs): its other threads, and those a "
        "request starts, run on the rest, which steadies the loop's latency under load (docs/performance.md). "
        "-1: the loop shares the worker's CPUs.", ge=-1, le=4095)] = -1


class BackendConfig(Section):
    """[backend] — which transport and which NICs."""

    kind: Annotated[Literal["ib", "efa", "soft"], key(
        "Transport: ib (RC), efa (SRD) or soft (software, for tests and demos).")] = "ib"
    rails: Annotated[tuple[RailConfig, ...], key(
        "NICs to use as [[backend.rails]] tables {device, gpu, numa_node}; empty: all found.",
        max_length=MAX_RAILS)] = ()
    verbs: Annotated[Literal["auto", "soft", "pyverbs"], key(
        "Verbs provider: pyverbs (real NICs; use it in production: no device is an error), soft (softverbs) "
        "or auto (pyverbs if a device exists, else softverbs over TCP, with a warning).")] = "auto"
    # each backend's own table (transportd.backends.OPTIONS says which kind reads which)
    ib: IbOptions = msgspec.field(default_factory=IbOptions)
    efa: EfaOptions = msgspec.field(default_factory=EfaOptions)

    def _check(self) -> None:
        names = [r.device for r in self.rails]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise Invalid(("rails", i, "device"), f"{name!r} is listed twice")


class ProxyConfig(Section):
    """[proxy] — the workers that turn ring commands into work requests."""

    batch_max: Annotated[int, key("Most work requests posted per connection in one batch.",
                                  ge=MIN_BATCH, le=MAX_BATCH)] = 8
    poll_window_us: Annotated[int, key("Microseconds a worker waits to fill a batch before posting a partial one.",
                                       ge=0, le=1_000_000)] = 50
    inflight_cap: Annotated[int, key("Most unacknowledged work requests per connection (at least 2: a PUT_SIGNAL "
                                     "is two).", ge=MIN_INFLIGHT_CAP, le=MAX_INFLIGHT_CAP)] = 256
    max_take: Annotated[int, key(
        "Most records a worker takes from one ring in a pass before posting them: fewer publish completions "
        "sooner when many GPU threads each wait for their own record, more drain a backlog in fewer passes "
        "(docs/performance-log.md, \"What bounds the sweep\").", ge=MIN_TAKE, le=MAX_TAKE)] = 4096
    ring_capacity: Annotated[int, key(
        "Command-ring slots of a channel a client opens without naming a capacity (a power of two).",
        check=_power_of_two, ge=MIN_CHANNEL_CAPACITY, le=MAX_CHANNEL_CAPACITY)] = 4096


class SignalConfig(Section):
    """[signal] — how a transfer's completion is made visible to the destination."""

    mode: Annotated[Literal["write", "atomic", "fence"], key(
        "write: flag written after the data (needs in-order placement); atomic or fence: safe "
        "with adaptive routing.")] = "write"
    decoupled: Annotated[bool, key("Send one signal per destination per batch instead of one per command.")] = False


#: ``flags.publication`` values (transportd.dataplane.flag_publication documents each path).
FLAG_PUBLICATIONS = ("auto", "gdrcopy", "loopback", "host-mapped", "cuda-copy")


class FlagsConfig(Section):
    """[flags]"""

    placement: Annotated[Literal["device", "host"], key(
        "Where `session.flags()` puts a rank's flag array when the client does not say (`where=` wins): "
        "GPU memory or host-mapped pinned memory. A client joined without a GPU, or a node whose rails "
        "could only publish into GPU memory through the daemon's CUDA context, gets host.")] = "host"
    publication: Annotated[Literal["auto", "gdrcopy", "loopback", "host-mapped", "cuda-copy"], key(
        "How an efa rail's worker publishes flags into GPU flag words. auto: gdrcopy where the gdrdrv "
        "module is loaded and libgdrapi loads, else loopback (an RDMA write through the rail's own NIC), "
        "else host-mapped (flags default to host memory). cuda-copy: copies through the daemon's CUDA "
        "context, posted each poll and not waited for; a flag lands when its copy runs (~2.4 ms while a "
        "client kernel runs without CUDA MPS; under MPS the cheaper path over softverbs). Naming a path forces it "
        "(start fails if it cannot work). Only efa rails publish flags; ib NICs write them.")] = "auto"
    gdrdrv_device: Annotated[str, key(
        "The gdrdrv device node; GDRCopy is used only where it exists (the gdrdrv kernel module is "
        "loaded).")] = "/dev/gdrdrv"
    gdrcopy_library: Annotated[str, key(
        "libgdrapi to load at run time (a name or a path); empty: libgdrapi.so.2, then libgdrapi.so.",
        default_doc='""')] = ""  # not "(off)": empty looks the library up by its usual names


class EfaConfig(Section):
    """[efa]"""

    visibility_flush: Annotated[bool, key(
        "Flush (read back) before publishing an EFA arrival's flag, so the data is visible to the GPU.")] = True


class SoftverbsConfig(Section):
    """[softverbs] — the software provider's own knobs (used when the verbs provider is softverbs)."""

    host: Annotated[str, key("Address the soft device listens on and advertises to peers (its GID).")] = "127.0.0.1"
    adaptive_routing: Annotated[bool, key(
        "Model adaptive routing: RC writes are split into packets placed out of order across WRs.")] = False
    reorder_seed: Annotated[int, key("Seed of the reordering (adaptive routing, SRD); -1: a fresh random seed.",
                                     ge=-1, le=2**31 - 1)] = -1
    direct_copy: Annotated[bool, key(
        "Place a write from GPU memory into a peer daemon's memory on this host with one copy from the "
        "client's buffer (CUDA IPC, run by the receiving worker) instead of over TCP; rkey, bounds and "
        "ordering rules are kept. On by default (the GPU suite runs with it); false: every write crosses TCP.")] = True
    direct_copy_via: Annotated[Literal["device", "host"], key(
        "How a direct copy between two GPU buffers is placed. device: one device-to-device copy (about "
        "1 TB/s on an H200, but the driver runs it on SMs, so it waits while kernels hold every SM and "
        "competes with a fused op's compute). host: device -> pinned host -> device with the copy engines "
        "in pipelined chunks, no SM, at PCIe's rate (about 30 GB/s for 4 MiB writes on an H200), as a "
        "NIC's DMA would.")] = "device"
    nic_bandwidth: Annotated[float, key(
        "NIC model: bytes/s each soft device sends at (ConnectX-7 400 Gb/s: 50e9; EFA 200 Gb/s: 25e9); "
        "0: unshaped.", ge=0.0, le=1e13)] = 0.0
    nic_latency_s: Annotated[float, key(
        "NIC model: seconds every request lands after its last byte is sent (base latency); 0: none.",
        ge=0.0, le=1.0)] = 0.0
    nic_message_rate: Annotated[float, key(
        "NIC model: requests/s each soft device sends at most; 0: unlimited.", ge=0.0, le=1e10)] = 0.0
    nic_spin_s: Annotated[float, key(
        "NIC model: seconds before a request lands that a soft device waits for it awake instead of asleep, so "
        "no wake-up (tens of us on a busy host) is added to the modeled latency: a request landing within it "
        "of its post, none queued ahead, is sent by the posting thread itself, and the I/O thread wakes this "
        "long before a queued one lands. 0: the I/O thread sleeps until each landing.", ge=0.0, le=0.01)] = 30e-6
    nic_streaming: Annotated[bool, key(
        "NIC model: a write from GPU memory leaves as its first byte lands, and the receiver copies it while the "
        "modeled link carries the rest, as a NIC places a write packet by packet (what follows it, and its "
        "completion, still wait for its last byte). false: store and forward, it leaves once its last byte has "
        "landed, so its copy adds to every landing.")] = True
    io_spin_s: Annotated[float, key(
        "Seconds a soft device's I/O thread stays awake after its last event, polling its sockets instead of "
        "sleeping, so the next frame is taken without waiting for a thread wake-up (20-50 us a step on a busy "
        "host); it costs a core per rail while traffic flows. 0: sleep at once. For benchmarks on a host with "
        "cores to spare.", ge=0.0, le=1.0)] = 0.0
    gil_switch_interval_s: Annotated[float, key(
        "Python's thread switch interval (sys.setswitchinterval) in a process that opens soft devices, the rail "
        "worker: how long a thread that wants the GIL waits before the holder must let it go. A soft device's "
        "I/O thread reading a peer's frame waits so for the worker's own post or poll to finish (Python's "
        "default 5 ms bounds nothing shorter than the post). 0: Python's default.", ge=0.0, le=0.1)] = 0.0


class LoggingConfig(Section):
    """[logging] — one line per event on stderr."""

    level: Annotated[str, key("debug, info, warning, error or critical.", check=_level)] = "info"
    format: Annotated[Literal["json", "text"], key(
        "json (one object per line, for journald and collectors) or text.")] = "json"


class MetricsConfig(Section):
    """[metrics]"""

    listen: Annotated[str, key("host:port for Prometheus text metrics (keep it on localhost); empty: off.",
                               check=_optional_host_port)] = ""


#: Keys that existed once, with what to do instead: loading names them instead of calling them unknown.
REMOVED_KEYS: dict[str, str] = {
    "proxy.workers": "removed (it set nothing): each rail in [[backend.rails]] has its own proxy worker "
                     "process, so there is one per NIC; delete this line",
}

_SECTIONS: dict[str, type] = {
    "node": NodeConfig,
    "control": ControlConfig,
    "peers": PeersConfig,
    "security": SecurityConfig,
    "backend": BackendConfig,
    "proxy": ProxyConfig,
    "signal": SignalConfig,
    "flags": FlagsConfig,
    "efa": EfaConfig,
    "softverbs": SoftverbsConfig,
    "logging": LoggingConfig,
    "metrics": MetricsConfig,
}


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The whole validated config; ``source`` is the file it came from (or ``<defaults>``), not a key, and
    not compared: two configs are equal when every key is."""

    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    control: ControlConfig = msgspec.field(default_factory=ControlConfig)
    peers: PeersConfig = msgspec.field(default_factory=PeersConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    backend: BackendConfig = msgspec.field(default_factory=BackendConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    signal: SignalConfig = msgspec.field(default_factory=SignalConfig)
    flags: FlagsConfig = msgspec.field(default_factory=FlagsConfig)
    efa: EfaConfig = msgspec.field(default_factory=EfaConfig)
    softverbs: SoftverbsConfig = msgspec.field(default_factory=SoftverbsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    source: str = "<defaults>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _SECTIONS)

    __hash__ = None  # type: ignore[assignment]  # equal configs may differ in source

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict by section (tuples as lists), for ``--json`` output and ``stats`` replies."""
        return {name: _plain(getattr(self, name)) for name in _SECTIONS}


#: section name -> its table, in the order the docs list them
_SECTIONS: dict[str, type[Section]] = {
    name: typing.get_type_hints(Config)[name] for name in Config.__struct_fields__ if name != "source"
}


def _plain(value: object) -> Any:
    if isinstance(value, msgspec.Struct):
        return {name: _plain(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------------
# Documentation, from the same annotations.


@dataclass(frozen=True)
class KeyInfo:
    """One documented key: its default as written in TOML, its type and what it means."""

    key: str
    default: str
    type: str
    meaning: str
    example: str | None = None  # what the example config shows when the default is words (node.name)


def _toml_literal(value: object) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value else '"" (off)'
    if isinstance(value, tuple):
        return "[]" if not value else "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return str(value)


def _type_doc(hint: Any) -> str:
    hint, _ = schema.field_metas(hint)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(hint))
    if origin is tuple:
        return f"list of {_type_doc(typing.get_args(hint)[0])}"
    if origin is not None and type(None) in typing.get_args(hint):
        return f"{_type_doc(typing.get_args(hint)[0])} (optional)"
    if origin is not None:  # a plain union: `mode` is an int or an octal string
        return " or ".join(_type_doc(a) for a in typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return "table"
    return getattr(hint, "__name__", str(hint))


def _describe_fields(prefix: str, cls: type[msgspec.Struct]) -> dict[str, KeyInfo]:
    keys: dict[str, KeyInfo] = {}
    for f in msgspec.structs.fields(cls):
        _, metas = schema.field_metas(f.type)
        meaning = next((m.description for m in metas if m.description), "")
        default_doc = next((m.extra["default_doc"] for m in metas if m.extra and "default_doc" in m.extra), None)
        example = next((m.extra["example"] for m in metas if m.extra and "example" in m.extra), None)
        if f.required:
            shown = "(required)"
        else:
            shown = default_doc or _toml_literal(None if f.default is msgspec.NODEFAULT else f.default)
        name = f"{prefix}.{f.name}"
        item, _ = schema.field_metas(f.type)
        if isinstance(item, type) and issubclass(item, msgspec.Struct):  # a table inside the section
            keys.update(_describe_fields(name, item))
            continue
        keys[name] = KeyInfo(name, shown, _type_doc(f.type), meaning, example)
        if typing.get_origin(item) is tuple:
            element = typing.get_args(item)[0]
            if isinstance(element, type) and issubclass(element, msgspec.Struct):
                keys.update(_describe_fields(f"{name}[]", element))
    return keys


def _keys() -> dict[str, KeyInfo]:
    keys: dict[str, KeyInfo] = {}
    for section, cls in _SECTIONS.items():
        keys.update(_describe_fields(section, cls))
    return keys


#: Every key, dotted, with its default and meaning (docs/config.md's table is generated from this).
KEYS: dict[str, KeyInfo] = _keys()


def describe_keys() -> str:
    """A Markdown table of every config key: key, type, default, meaning."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for info in KEYS.values():
        meaning = info.meaning.replace("|", "\\|")
        lines.append(f"| `{info.key}` | {info.type} | `{info.default}` | {meaning} |")
    return "\n".join(lines) + "\n"


def example_config() -> str:
    """A TOML file with every key commented out at its default, meaning above it (deploy/transportd.toml).

    Any commented line may be uncommented and the file still loads: the ``[[backend.rails]]`` example goes
    after its section's other keys (a key below an array-of-tables header would belong to that table), and
    a key whose default is words (``node.name``) shows an example value, with the default in words above it.
    """
    out = ["# transportd configuration: every key, commented out at its default.",
           "# Uncomment and edit what you need; `transportd run --config FILE` validates the whole file.", ""]
    current = None
    tables: list[str] = []  # an array-of-tables example, held back to the end of its section
    for info in KEYS.values():
        if "[]" in info.key:
            continue
        section, _, name = info.key.rpartition(".")
        if section != current:
            out += tables
            tables = []
            current = section
            out += [f"[{section}]"]
        if name == "rails":
            tables = [f"# {info.meaning}", "# [[backend.rails]]", "# device = \"mlx5_0\"   # verbs device name",
                      "# gpu = 0              # local GPU closest to this NIC",
                      "# numa_node = 0        # NUMA node of the NIC",
                      "# loop_cpu = -1        # a CPU of the worker's for its loop alone (-1: none)", ""]
            continue
        out.append(f"# {info.meaning}")
        if info.example is not None:
            out += [f"# Default: {info.default}.", f"# {name} = {info.example}", ""]
            continue
        shown = info.default
        if shown.startswith("(") or shown.endswith("(off)") or not shown[:1].isascii() or " " in shown and \
                not shown.startswith(("[", '"')):
            shown = {"(none)": '""', '"" (off)': '""'}.get(shown, f'"{shown}"')
        out += [f"# {name} = {shown}", ""]
    out += tables
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------
# Loading.


def _toml_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "table"
    return {int: "integer", float: "float", str: "string"}.get(type(value), type(value).__name__)


#: how the config names types in its errors (TOML's vocabulary, with the value that was given)
WORDS = schema.Words(types={int: "integer", float: "float", bool: "boolean", str: "string", bytes: "bytes",
                            tuple: "array", dict: "table", msgspec.Struct: "table"},
                     value_type=_toml_type, articles={"string": "a string", "array": "an array", "table": "a table"},
                     show_value=True)


class _Loader:
    def __init__(self, source: str, base_dir: Path | None) -> None:
        self.source = source
        self.base_dir = base_dir

    def fail(self, key: str, reason: str) -> typing.NoReturn:
        raise ConfigError(self.source, key, reason)

    def invalid(self, exc: Invalid, data: dict[str, Any]) -> typing.NoReturn:
        """A schema failure as the ConfigError an operator reads: dotted key, and what to do."""
        key = schema.dotted(exc.path)
        if exc.reason == "missing":
            self.fail(key, "required key is missing")
        if exc.reason == "unknown":
            self.fail(key, REMOVED_KEYS.get(key) or f"unknown key; known keys here: {', '.join(exc.known)}")
        if len(exc.path) == 1 and not isinstance(data.get(exc.path[0]), dict):
            self.fail(key, f"expected a [{key}] table, got {_toml_type(data.get(exc.path[0]))}")
        self.fail(key, exc.problem)

    def path(self, key: str, value: str | None) -> str | None:
        if value is None:
            return None
        p = Path(value).expanduser()
        if not p.is_absolute() and self.base_dir is not None:
            p = self.base_dir / p
        return str(p)


def _validate_security(loader: _Loader, sec: SecurityConfig) -> SecurityConfig:
    secret = loader.path("security.curve_secret_key_file", sec.curve_secret_key_file)
    public = loader.path("security.curve_public_key_file", sec.curve_public_key_file)
    authorized = loader.path("security.curve_authorized_keys_dir", sec.curve_authorized_keys_dir)
    if secret is None and (public is not None or authorized is not None):
        given = "curve_public_key_file" if public is not None else "curve_authorized_keys_dir"
        loader.fail("security.curve_secret_key_file", f"required when {given} is set (CURVE needs a secret key)")
    if secret is not None:
        from zmq.auth import load_certificate  # zmq only when CURVE is configured

        def load(key: str, path: str) -> tuple[bytes, bytes | None]:
            if not os.path.isfile(path):
                loader.fail(key, f"{path} does not exist or is not a file")
            try:
                return load_certificate(path)
            except (OSError, ValueError) as exc:
                loader.fail(key, f"{path} is not a zmq CURVE certificate ({exc})")

        secret_public, secret_key = load("security.curve_secret_key_file", secret)
        if secret_key is None:
            loader.fail("security.curve_secret_key_file", f"{secret} holds no secret key (it is a public file)")
        if public is not None:
            public_key, _ = load("security.curve_public_key_file", public)
            if public_key != secret_public:
                loader.fail("security.curve_public_key_file", f"{public} does not match the secret key's public key")
        if authorized is None:
            loader.fail("security.curve_authorized_keys_dir",
                        "required with a secret key (otherwise any key would be accepted)")
        if not os.path.isdir(authorized):
            loader.fail("security.curve_authorized_keys_dir", f"{authorized} does not exist or is not a directory")
    return msgspec.structs.replace(sec, curve_secret_key_file=secret, curve_public_key_file=public,
                                   curve_authorized_keys_dir=authorized)


def _validate(loader: _Loader, cfg: Config) -> Config:
    # what the backend cannot honour is the registry's to say (docs/design.md, "One backend registry": no branch
    # on the kind here)
    for key_name, reason in config_problems(cfg.backend.kind, signal_mode=cfg.signal.mode,
                                            flags_publication=cfg.flags.publication,
                                            adaptive_routing=cfg.softverbs.adaptive_routing):
        loader.fail(key_name, reason)
    return msgspec.structs.replace(cfg, security=_validate_security(loader, cfg.security))


def _apply_env(cfg: Config, env: Mapping[str, str]) -> Config:
    override = env.get(SOCKET_ENV)
    if not override:
        return cfg
    try:
        check_control_endpoint(override)
    except ValueError as exc:
        raise ConfigError(f"${SOCKET_ENV}", "control.socket", str(exc)) from None
    return msgspec.structs.replace(cfg, control=msgspec.structs.replace(cfg.control, socket=override))


def default_config(*, env: Mapping[str, str] | None = None) -> Config:
    """The config with every key at its default (``TRANSPORTD_SOCKET`` still applies)."""
    return _apply_env(Config(), os.environ if env is None else env)


def load_config(path: str | os.PathLike[str] | None, *, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config file; ``None`` gives the defaults. Raises :class:`ConfigError`."""
    if path is None:
        return default_config(env=env)
    source = os.fspath(path)
    loader = _Loader(source, Path(source).resolve().parent)
    try:
        with open(source, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        loader.fail("(file)", f"cannot read: {exc.strerror or exc}")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        loader.fail("(file)", f"not UTF-8 text ({exc.reason} at byte {exc.start})")
    except tomllib.TOMLDecodeError as exc:
        loader.fail("(syntax)", f"TOML syntax error: {exc}")
    for name in data:
        if name not in _SECTIONS:  # checked first, so that `source` (not a key) is refused as well
            loader.fail(name, f"unknown section; known sections: {', '.join(_SECTIONS)}")
    try:
        cfg = schema.convert(data, Config, WORDS)
    except Invalid as exc:
        loader.invalid(exc, data)
    cfg = _validate(loader, msgspec.structs.replace(cfg, source=source))
    return _apply_env(cfg, os.environ if env is None else env)
