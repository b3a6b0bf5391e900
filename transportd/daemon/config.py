"""The daemon's TOML config: every key defaulted, typed and checked before anything starts.

Each section is a frozen dataclass whose fields carry their own meaning and check (``metadata``), so the
defaults, the validation and the documentation table (:func:`describe_keys`, used for the README) come
from one definition. Loading refuses unknown sections and keys, wrong types and bad values with a
:class:`ConfigError` naming the file, the dotted key and the reason — a typo must not silently become a
default. Relative paths in ``[security]`` are taken relative to the config file.

``TRANSPORTD_SOCKET`` in the environment overrides ``control.socket`` (the same variable clients read).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket as _socket
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transportd.control.protocol import MAX_CHANNEL_CAPACITY, MIN_CHANNEL_CAPACITY
from transportd.errors import ConfigError
from transportd.limits import MAX_BATCH, MAX_INFLIGHT_CAP, MIN_BATCH, MIN_INFLIGHT_CAP

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
    "SecurityConfig",
    "SignalConfig",
    "check_control_endpoint",
    "default_config",
    "describe_keys",
    "load_config",
]

DEFAULT_SOCKET = "ipc:///run/transportd/control.sock"
SOCKET_ENV = "TRANSPORTD_SOCKET"
DEFAULT_PEER_PORT = 18515


# ---------------------------------------------------------------------------------------------------------
# Value checks: each takes the type-checked value and returns it (possibly normalised) or raises ValueError.

Check = Callable[[Any], Any]


def _between(lo: float, hi: float) -> Check:
    def check(value: float) -> float:
        if not lo <= value <= hi:
            raise ValueError(f"must be in [{lo}, {hi}], got {value}")
        return value

    return check


def _power_of_two(lo: int, hi: int) -> Check:
    def check(value: int) -> int:
        _between(lo, hi)(value)
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value

    return check


def _host_port(value: str) -> str:
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d+)", value)
    if not match:
        raise ValueError(f"expected 'host:port' (IPv6 as '[addr]:port'), got {value!r}")
    if not 1 <= int(match.group(2)) <= 65535:
        raise ValueError(f"port must be 1..65535, got {match.group(2)}")
    return value


def _endpoint(*, ipc: bool) -> Check:
    def check(value: str) -> str:
        if value.startswith("tcp://"):
            address = value[len("tcp://"):]
            _host_port("0.0.0.0" + address[1:] if address.startswith("*:") else address)
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
    return _endpoint(ipc=True)(value)


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


def _meta(meaning: str, check: Check | None = None, default_doc: str | None = None) -> dict[str, Any]:
    return {"meaning": meaning, "check": check, "default_doc": default_doc}


# ---------------------------------------------------------------------------------------------------------
# Sections.


@dataclass(frozen=True)
class NodeConfig:
    """[node]"""

    name: str = field(
        default_factory=_socket.gethostname,
        metadata=_meta("This node's name in peer messages, logs and metrics.", _node_name, "the host name"),
    )


@dataclass(frozen=True)
class ControlConfig:
    """[control] — the local client socket."""

    socket: str = field(default=DEFAULT_SOCKET, metadata=_meta(
        f"Client endpoint (ipc:// or tcp://); ${SOCKET_ENV} overrides it.", _endpoint(ipc=True)))
    mode: int = field(default=0o660, metadata=_meta(
        "Permission bits of an ipc socket file (octal).", _mode, "0o660"))
    group: str | None = field(default=None, metadata=_meta(
        "Group owning the ipc socket file; members may use the daemon. Empty: the daemon's group."))
    max_message_bytes: int = field(default=1 << 20, metadata=_meta(
        "Largest control message accepted; larger ones get a too_large error reply.",
        _between(4096, 64 << 20)))
    client_timeout_s: float = field(default=30.0, metadata=_meta(
        "Seconds a session may stay silent before it is reclaimed (the client library sends keepalives at "
        "a quarter of it): sessions over tcp, and ipc sessions the kernel gave no pid for (a client in "
        "another pid namespace; its session still ends when its descriptor connection closes). An ipc "
        "session that vouched on the descriptor socket is watched by the pid SO_PEERCRED names and by that "
        "connection instead: reclaimed as soon as its process exits or the connection closes, kept while "
        "both last, however silent.",
        _between(0.5, 86400.0)))
    vouch_timeout_s: float = field(default=5.0, metadata=_meta(
        "Seconds a connection to the descriptor socket may stay without presenting a valid hello token; "
        "then it is closed.", _between(0.05, 600.0)))
    max_unvouched: int = field(default=64, metadata=_meta(
        "Connections to the descriptor socket waiting to vouch at once (a quarter of them per uid): a new "
        "one past that closes the oldest of its uid, or of the uid holding the most.", _between(4, 4096)))


@dataclass(frozen=True)
class PeersConfig:
    """[peers] — other nodes' daemons."""

    listen: str = field(default=f"tcp://0.0.0.0:{DEFAULT_PEER_PORT}", metadata=_meta(
        "Endpoint peer daemons connect to.", _endpoint(ipc=False)))
    static: tuple[str, ...] = field(default=(), metadata=_meta(
        "Peer daemons to connect to at start, as 'host:port'.", _host_port))
    heartbeat_interval_s: float = field(default=1.0, metadata=_meta(
        "Seconds between heartbeats to each peer.", _between(0.01, 60.0)))
    heartbeat_timeout_s: float = field(default=5.0, metadata=_meta(
        "Seconds without a heartbeat before a peer is declared lost (more than the interval).",
        _between(0.02, 3600.0)))
    ready_wait_s: float = field(default=10.0, metadata=_meta(
        "Seconds the daemon waits for every static peer before it reports ready to systemd anyway "
        "(keep it below the unit's TimeoutStartSec).", _between(0.0, 3600.0)))


@dataclass(frozen=True)
class SecurityConfig:
    """[security] — CURVE authentication of peer daemons (and of tcp control clients)."""

    curve_secret_key_file: str | None = field(default=None, metadata=_meta(
        "This daemon's CURVE secret key file (zmq certificate); enables CURVE when set."))
    curve_public_key_file: str | None = field(default=None, metadata=_meta(
        "This daemon's CURVE public key file, given to peers and clients."))
    curve_authorized_keys_dir: str | None = field(default=None, metadata=_meta(
        "Directory of public key files allowed to connect; required with a secret key."))

    @property
    def curve_enabled(self) -> bool:
        """True when peer links (and tcp control sockets) must use CURVE."""
        return self.curve_secret_key_file is not None


@dataclass(frozen=True)
class RailConfig:
    """One entry of [[backend.rails]]: a NIC and the GPU / NUMA node it sits next to."""

    device: str = field(metadata=_meta("Verbs device name, e.g. mlx5_0 or rdmap16s27."))
    gpu: int = field(default=-1, metadata=_meta("Local GPU index closest to the NIC; -1: unknown.",
                                                _between(-1, 63)))
    numa_node: int = field(default=-1, metadata=_meta(
        "NUMA node of the NIC; the rail's worker is pinned to its CPUs. -1: the NIC's sysfs numa_node, "
        "else not pinned.", _between(-1, 1023)))


@dataclass(frozen=True)
class BackendConfig:
    """[backend] — which transport and which NICs."""

    kind: Literal["ib", "efa", "soft"] = field(default="ib", metadata=_meta(
        "Transport: ib (RC), efa (SRD) or soft (software, for tests and demos)."))
    rails: tuple[RailConfig, ...] = field(default=(), metadata=_meta(
        "NICs to use as [[backend.rails]] tables {device, gpu, numa_node}; empty: all found."))
    verbs: Literal["auto", "soft", "pyverbs"] = field(default="auto", metadata=_meta(
        "Verbs provider: pyverbs (real NICs; use it in production: no device is an error), soft (softverbs) "
        "or auto (pyverbs if a device exists, else softverbs over TCP, with a warning)."))


@dataclass(frozen=True)
class ProxyConfig:
    """[proxy] — the workers that turn ring commands into work requests."""

    batch_max: int = field(default=8, metadata=_meta(
        "Most work requests posted per connection in one batch.", _between(MIN_BATCH, MAX_BATCH)))
    poll_window_us: int = field(default=50, metadata=_meta(
        "Microseconds a worker waits to fill a batch before posting a partial one.",
        _between(0, 1_000_000)))
    inflight_cap: int = field(default=256, metadata=_meta(
        "Most unacknowledged work requests per connection (at least 2: a PUT_SIGNAL is two).",
        _between(MIN_INFLIGHT_CAP, MAX_INFLIGHT_CAP)))
    ring_capacity: int = field(default=4096, metadata=_meta(
        "Command-ring slots of a channel a client opens without naming a capacity (a power of two).",
        _power_of_two(MIN_CHANNEL_CAPACITY, MAX_CHANNEL_CAPACITY)))


@dataclass(frozen=True)
class SignalConfig:
    """[signal] — how a transfer's completion is made visible to the destination."""

    mode: Literal["write", "atomic", "fence"] = field(default="write", metadata=_meta(
        "write: flag written after the data (needs in-order placement); atomic or fence: safe "
        "with adaptive routing."))
    decoupled: bool = field(default=False, metadata=_meta(
        "Send one signal per destination per batch instead of one per command."))


#: ``flags.publication`` values (transportd.dataplane.flag_publication documents each path).
FLAG_PUBLICATIONS = ("auto", "gdrcopy", "loopback", "host-mapped", "cuda-copy")


@dataclass(frozen=True)
class FlagsConfig:
    """[flags]"""

    placement: Literal["device", "host"] = field(default="host", metadata=_meta(
        "Where `session.flags()` puts a rank's flag array when the client does not say (`where=` wins): "
        "GPU memory or host-mapped pinned memory. A client joined without a GPU, or a node whose rails "
        "could only publish into GPU memory through the daemon's CUDA context, gets host."))
    publication: Literal["auto", "gdrcopy", "loopback", "host-mapped", "cuda-copy"] = field(
        default="auto", metadata=_meta(
            "How an efa rail's worker publishes flags into GPU flag words. auto: gdrcopy where the gdrdrv "
            "module is loaded and libgdrapi loads, else loopback (an RDMA write through the rail's own NIC), "
            "else host-mapped (flags default to host memory). cuda-copy: copies through the daemon's CUDA "
            "context (~2.4 ms per flag while a client kernel runs; the last resort). Naming a path forces it "
            "(start fails if it cannot work). Only efa rails publish flags; ib NICs write them."))
    gdrdrv_device: str = field(default="/dev/gdrdrv", metadata=_meta(
        "The gdrdrv device node; GDRCopy is used only where it exists (the gdrdrv kernel module is loaded)."))
    gdrcopy_library: str = field(default="", metadata=_meta(
        "libgdrapi to load at run time (a name or a path); empty: libgdrapi.so.2, then libgdrapi.so."))


@dataclass(frozen=True)
class EfaConfig:
    """[efa]"""

    visibility_flush: bool = field(default=True, metadata=_meta(
        "Flush (read back) before publishing an EFA arrival's flag, so the data is visible to the GPU."))


@dataclass(frozen=True)
class SoftverbsConfig:
    """[softverbs] — the software provider's own knobs (used when the verbs provider is softverbs)."""

    host: str = field(default="127.0.0.1", metadata=_meta(
        "Address the soft device listens on and advertises to peers (its GID)."))
    adaptive_routing: bool = field(default=False, metadata=_meta(
        "Model adaptive routing: RC writes are split into packets placed out of order across WRs."))
    reorder_seed: int = field(default=-1, metadata=_meta(
        "Seed of the reordering (adaptive routing, SRD); -1: a fresh random seed.", _between(-1, 2**31 - 1)))


@dataclass(frozen=True)
class LoggingConfig:
    """[logging] — one line per event on stderr."""

    level: str = field(default="info", metadata=_meta(
        "debug, info, warning, error or critical.", _level))
    format: Literal["json", "text"] = field(default="json", metadata=_meta(
        "json (one object per line, for journald and collectors) or text."))


@dataclass(frozen=True)
class MetricsConfig:
    """[metrics]"""

    listen: str = field(default="", metadata=_meta(
        "host:port for Prometheus text metrics (keep it on localhost); empty: off.", _optional_host_port))


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


@dataclass(frozen=True)
class Config:
    """The whole validated config; ``source`` is the file it came from (or ``<defaults>``)."""

    node: NodeConfig = field(default_factory=NodeConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    peers: PeersConfig = field(default_factory=PeersConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    signal: SignalConfig = field(default_factory=SignalConfig)
    flags: FlagsConfig = field(default_factory=FlagsConfig)
    efa: EfaConfig = field(default_factory=EfaConfig)
    softverbs: SoftverbsConfig = field(default_factory=SoftverbsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    source: str = field(default="<defaults>", compare=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict by section (tuples as lists), for ``--json`` output and ``stats`` replies."""
        out: dict[str, dict[str, Any]] = {}
        for name in _SECTIONS:
            out[name] = _plain(getattr(self, name))
        return out


def _plain(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------------
# Documentation.


@dataclass(frozen=True)
class KeyInfo:
    """One documented key: its default as written in TOML, its type and what it means."""

    key: str
    default: str
    type: str
    meaning: str


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
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(hint))
    if origin is tuple:
        return f"list of {_type_doc(typing.get_args(hint)[0])}"
    if origin is not None and type(None) in typing.get_args(hint):
        return f"{_type_doc(typing.get_args(hint)[0])} (optional)"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "table"
    return getattr(hint, "__name__", str(hint))


def _keys() -> dict[str, KeyInfo]:
    keys: dict[str, KeyInfo] = {}
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = meta["default_doc"] or _toml_literal(default)
            key = f"{section}.{f.name}"
            keys[key] = KeyInfo(key, shown, _type_doc(hints[f.name]), meta["meaning"])
            if f.name == "rails":
                for rf in dataclasses.fields(RailConfig):
                    rdefault = rf.default if rf.default is not dataclasses.MISSING else "(required)"
                    rkey = f"{section}.rails[].{rf.name}"
                    rhint = typing.get_type_hints(RailConfig)[rf.name]
                    shown = rdefault if rdefault == "(required)" else _toml_literal(rdefault)
                    keys[rkey] = KeyInfo(rkey, shown, _type_doc(rhint), rf.metadata["meaning"])
    return keys


#: Every key, dotted, with its default and meaning (the README's config table is generated from this).
KEYS: dict[str, KeyInfo] = _keys()


def describe_keys() -> str:
    """A Markdown table of every config key: key, type, default, meaning."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for info in KEYS.values():
        meaning = info.meaning.replace("|", "\\|")
        lines.append(f"| `{info.key}` | {info.type} | `{info.default}` | {meaning} |")
    return "\n".join(lines) + "\n"


def example_config() -> str:
    """A TOML file with every key commented out at its default, meaning above it (deploy/transportd.toml)."""
    out = ["# transportd configuration: every key, commented out at its default.",
           "# Uncomment and edit what you need; `transportd run --config FILE` validates the whole file.", ""]
    current = None
    for info in KEYS.values():
        section, _, name = info.key.partition(".")
        if "[]" in name:
            continue
        if section != current:
            current = section
            out += [f"[{section}]"]
        out.append(f"# {info.meaning}")
        if name == "rails":
            out += ["# [[backend.rails]]", "# device = \"mlx5_0\"   # verbs device name", "# gpu = 0              "
                    "# local GPU closest to this NIC", "# numa_node = 0        # NUMA node of the NIC", ""]
            continue
        shown = info.default
        if shown.startswith("(") or shown.endswith("(off)") or not shown[:1].isascii() or " " in shown and \
                not shown.startswith(("[", '"')):
            shown = {"(none)": '""', '"" (off)': '""'}.get(shown, f'"{shown}"')
        out += [f"# {name} = {shown}", ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------
# Loading.


_TOML_TYPES = {int: "integer", float: "float", bool: "boolean", str: "string"}


def _toml_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    return _TOML_TYPES.get(type(value), type(value).__name__)


class _Loader:
    def __init__(self, source: str, base_dir: Path | None) -> None:
        self.source = source
        self.base_dir = base_dir

    def fail(self, key: str, reason: str) -> typing.NoReturn:
        raise ConfigError(self.source, key, reason)

    def convert(self, hint: Any, value: object, key: str) -> Any:
        """Type-check one TOML value against a field's annotation."""
        origin = typing.get_origin(hint)
        if hint is bool or hint is str:
            if isinstance(value, hint):
                return value
        elif hint is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif hint is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                if not math.isfinite(value):
                    self.fail(key, f"must be a finite number, got {value}")
                return float(value)
        elif origin is Literal:
            allowed = typing.get_args(hint)
            if isinstance(value, str) and value in allowed:
                return value
            self.fail(key, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        elif origin is tuple:
            item_hint = typing.get_args(hint)[0]
            if not isinstance(value, list):
                self.fail(key, f"expected an array, got {_toml_type(value)}")
            return tuple(self.convert(item_hint, item, f"{key}[{i}]") for i, item in enumerate(value))
        elif origin is not None and type(None) in typing.get_args(hint):  # `str | None`
            if isinstance(value, str):
                return value or None
            self.fail(key, f"expected a string, got {_toml_type(value)}")
        elif origin is not None:  # a plain union such as `int | str`
            options = typing.get_args(hint)
            if isinstance(value, options) and not isinstance(value, bool):
                return value
            names = " or ".join(_TOML_TYPES.get(o, o.__name__) for o in options)
            self.fail(key, f"expected {names}, got {_toml_type(value)} {value!r}")
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                self.fail(key, f"expected a table, got {_toml_type(value)}")
            return self.build(hint, value, key)
        else:  # pragma: no cover - a section used an annotation this loader does not know
            raise TypeError(f"unsupported config type {hint!r}")
        self.fail(key, f"expected {_TOML_TYPES.get(hint, str(hint))}, got {_toml_type(value)} {value!r}")

    def build(self, cls: type, table: dict[str, Any], prefix: str) -> Any:
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name, raw in table.items():
            key = f"{prefix}.{name}"
            f = fields.get(name)
            if f is None:
                if key in REMOVED_KEYS:
                    self.fail(key, REMOVED_KEYS[key])
                self.fail(key, f"unknown key; known keys here: {', '.join(fields)}")
            value = self.convert(_check_hint(f, hints[name]), raw, key)
            check = f.metadata.get("check")
            if check is not None:
                if isinstance(value, tuple):  # list keys check each item, naming it
                    value = tuple(self.check(check, item, f"{key}[{i}]") for i, item in enumerate(value))
                else:
                    value = self.check(check, value, key)
            values[name] = value
        for name, f in fields.items():
            if name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self.fail(f"{prefix}.{name}", "required key is missing")
        return cls(**values)

    def check(self, check: Check, value: Any, key: str) -> Any:
        try:
            return check(value)
        except ValueError as exc:
            self.fail(key, str(exc))

    def path(self, key: str, value: str | None) -> str | None:
        if value is None:
            return None
        p = Path(value).expanduser()
        if not p.is_absolute() and self.base_dir is not None:
            p = self.base_dir / p
        return str(p)


def _check_hint(f: dataclasses.Field, hint: Any) -> Any:
    # `mode` accepts "0660" strings as well as TOML octal integers.
    return int | str if f.name == "mode" and f.metadata.get("check") is _mode else hint


def _load_section(loader: _Loader, name: str, value: object) -> Any:
    if not isinstance(value, dict):
        loader.fail(name, f"expected a [{name}] table, got {_toml_type(value)}")
    return loader.build(_SECTIONS[name], value, name)


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
    return SecurityConfig(secret, public, authorized)


def _validate(loader: _Loader, cfg: Config) -> Config:
    if cfg.peers.heartbeat_timeout_s <= cfg.peers.heartbeat_interval_s:
        loader.fail("peers.heartbeat_timeout_s",
                    f"must be more than peers.heartbeat_interval_s ({cfg.peers.heartbeat_interval_s}), "
                    f"got {cfg.peers.heartbeat_timeout_s}")
    if cfg.softverbs.adaptive_routing and cfg.signal.mode == "write" and cfg.backend.kind in ("ib", "soft"):
        # write-then-flag relies on in-order placement, which adaptive routing breaks (DESIGN.md section 4)
        loader.fail("signal.mode", "write signaling is unsafe with adaptive routing (softverbs.adaptive_routing); "
                                   "use atomic or fence")
    if cfg.backend.kind == "efa" and cfg.signal.mode != "write":
        # SRD has no ordered flag write, no fence and no atomics to order with: an efa signal is published
        # by the receiving daemon once every piece it covers has arrived (DESIGN.md section 4), whatever
        # the mode says. Accepting atomic/fence would promise an ordering that is not what happens.
        loader.fail("signal.mode", f"{cfg.signal.mode!r} does not apply to backend.kind = \"efa\" (the receiving "
                                   "daemon publishes a flag once every piece it covers arrived); leave it at "
                                   "\"write\" (the default)")
    if cfg.signal.decoupled and cfg.backend.kind == "efa":
        # decoupling moves writes ahead of signals, which regroups SRD writes and can shrink what an efa
        # signal covers (tests/transportd/dataplane/test_batching.py documents the case): refuse until batching keeps
        # efa groups intact
        loader.fail("signal.decoupled", "not supported with backend.kind = \"efa\" (it would regroup SRD "
                                        "writes so a flag could cover less than it should)")
    if cfg.flags.publication != "auto" and cfg.backend.kind != "efa":
        # on ib (and null) the sender's NIC writes the flag (or nothing does): no receiver-side path to pick
        loader.fail("flags.publication", f"{cfg.flags.publication!r} applies to backend.kind = \"efa\" only, where "
                                         "the receiving daemon publishes flags; on "
                                         f"{cfg.backend.kind!r} leave it at \"auto\"")
    names = [r.device for r in cfg.backend.rails]
    for i, name in enumerate(names):
        if names.index(name) != i:
            loader.fail(f"backend.rails[{i}].device", f"{name!r} is listed twice")
    return dataclasses.replace(cfg, security=_validate_security(loader, cfg.security))


def _apply_env(cfg: Config, env: Mapping[str, str]) -> Config:
    override = env.get(SOCKET_ENV)
    if not override:
        return cfg
    try:
        check_control_endpoint(override)
    except ValueError as exc:
        raise ConfigError(f"${SOCKET_ENV}", "control.socket", str(exc)) from None
    return dataclasses.replace(cfg, control=dataclasses.replace(cfg.control, socket=override))


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
    sections: dict[str, Any] = {}
    for name, value in data.items():
        if name not in _SECTIONS:
            loader.fail(name, f"unknown section; known sections: {', '.join(_SECTIONS)}")
        sections[name] = _load_section(loader, name, value)
    cfg = Config(**sections, source=source)
    cfg = _validate(loader, cfg)
    return _apply_env(cfg, os.environ if env is None else env)
