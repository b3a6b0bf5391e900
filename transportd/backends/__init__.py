"""The one place that picks a backend by name (docs/design.md, "One backend registry": nothing else branches
on it).

Each backend registers a ``"module:Class"`` entry in :data:`BACKENDS`; the module is imported only when
that backend is opened, so a node without pyverbs can still run the null backend. What the config needs
to know about each backend is declared here too, so that the config and the rail workers ask instead of
branching on ``backend.kind``: its own options table (:data:`OPTIONS`, ``[backend.ib]``/``[backend.efa]``),
which of the shared keys it takes (:func:`open_configured`) and which settings it cannot honour
(:data:`RULES`, :func:`config_problems`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from transportd.backends.interface import Backend

__all__ = ["BACKENDS", "CAPABILITIES", "DEVICE_KINDS", "FIXED_PROVIDERS", "IBGDA", "OPTIONS", "RULES",
           "TRAITS", "TRANSPORTS", "BackendOptions", "ConfigRules", "EfaOptions", "IbOptions", "Traits",
           "config_problems", "has_capability", "kinds_with", "open_backend", "open_configured", "traits_of"]

BACKENDS: dict[str, str] = {
    "null": "transportd.backends.null:NullBackend",
    "ib": "ib.backend:IbBackend",
    "soft": "ib.backend:IbBackend",  # "soft" is ib semantics on the softverbs provider (config backend.kind)
    "efa": "efa.backend:EfaBackend",
}

# The kind of NIC each backend drives ("ib": an RC HCA, "efa": an SRD device). Where the verbs provider is
# softverbs, a rail naming a device that does not exist yet gets a soft device of this kind
# (``transportd.backends.verbs.configure_soft``'s ``devices``); pyverbs ignores it.
DEVICE_KINDS: dict[str, str] = {"ib": "ib", "soft": "ib", "efa": "efa"}

#: The queue-pair transport each backend posts on: reliable connected, or AWS's scalable reliable datagram.
TRANSPORTS: dict[str, str] = {"ib": "rc", "soft": "rc", "efa": "srd"}

#: A capability: the backend serves IBGDA channels (mlx5 queue pairs the GPU posts its own WQEs to).
IBGDA = "ibgda"



@dataclass(frozen=True)
class Traits:
    """What a backend does beyond the :class:`~transportd.backends.interface.Backend` interface, declared per
    kind (:data:`TRAITS`) and read by the rail worker, the proxy and the flag publisher: nothing probes a
    backend object for an optional method. Each trait names the methods it promises; a test checks every
    backend class against its declaration."""

    #: ``c_poster``: the engine posts to and polls this backend from C (no Python per pass); without it the
    #: engine calls ``post_batches`` and ``poll`` once per pass
    compiled_poster: bool = False
    #: ``create_ibgda_domain``: serves IBGDA channels (the daemon's main process asks by kind: CAPABILITIES)
    ibgda: bool = False
    #: arrivals come with no ring record (efa's write-with-imm): an idle worker keeps polling the CQ
    receives: bool = False
    #: ``set_host_flags``, ``clear_host_flags``, ``set_mapped_flags``, ``loopback_unavailable`` and
    #: ``open_flag_loopback``: the receiving daemon publishes flags, and the compiled path stores them itself
    #: into host-mapped (or BAR-mapped) words
    publishes_flags: bool = False


_RC_TRAITS = Traits(compiled_poster=True, ibgda=True)
TRAITS: dict[str, Traits] = {
    "null": Traits(),
    "ib": _RC_TRAITS,
    # ib on softverbs: the same class and abilities, but IBGDA is offered on kind "ib" only
    "soft": Traits(compiled_poster=True),
    "efa": Traits(compiled_poster=True, receives=True, publishes_flags=True),
}


def traits_of(backend: Any) -> Traits:
    """The declared traits of an open backend, by its class's ``name`` (the kind it implements); None (the
    engine as its own null NIC, in benchmarks and tests) has the null backend's."""
    return TRAITS["null" if backend is None else backend.name]


# What each backend can do beyond the interface, as the daemon's main process asks before any backend is
# open (only the rail workers open one): derived from TRAITS.
CAPABILITIES: dict[str, frozenset[str]] = {kind: frozenset({IBGDA}) for kind, t in TRAITS.items() if t.ibgda}

# The verbs provider a backend always runs on, whatever ``backend.verbs`` says ("soft": ib on softverbs).
FIXED_PROVIDERS: dict[str, str] = {"soft": "soft"}


def has_capability(kind: str, capability: str) -> bool:
    """Whether backend ``kind`` declares ``capability`` (:data:`CAPABILITIES`)."""
    return capability in CAPABILITIES.get(kind, frozenset())


def kinds_with(capability: str) -> list[str]:
    """The backends declaring ``capability``, by name (for messages that say which would do)."""
    return sorted(kind for kind, caps in CAPABILITIES.items() if capability in caps)


def open_backend(kind: str, **opts: Any) -> Backend:
    """Open backend ``kind`` with its options (see the backend class for what each accepts)."""
    try:
        target = BACKENDS[kind]
    except KeyError:
        raise ValueError(f"unknown backend {kind!r}; known: {', '.join(sorted(BACKENDS))}") from None
    module_name, _, class_name = target.partition(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(**opts)


# ---------------------------------------------------------------------------------------------------------
# Each backend's own options: its config table, handed to its constructor as keywords.


class BackendOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of a backend's own options, one config table ``[backend.<name>]`` each (see :data:`OPTIONS`)."""


_PORT = Meta(ge=1, le=255, description="Port of each rail's NIC its queue pairs use (verbs port numbers start at 1).")
_GID_INDEX = Meta(ge=0, le=255, description="GID table index of that port the queue pairs use: 0 on InfiniBand "
                                            "and EFA; on RoCE the entry holding the node's address and RoCE version.")


class IbOptions(BackendOptions):
    """[backend.ib] — the ib backend's own options (``backend.kind`` "ib", and "soft": ib on softverbs)."""

    port: Annotated[int, _PORT] = 1
    gid_index: Annotated[int, _GID_INDEX] = 0


class EfaOptions(BackendOptions):
    """[backend.efa] — the efa backend's own options."""

    port: Annotated[int, _PORT] = 1
    gid_index: Annotated[int, _GID_INDEX] = 0


#: backend.kind -> the options table it reads (by the config field under [backend] that holds it)
OPTIONS: dict[str, tuple[str, type[BackendOptions]]] = {"ib": ("ib", IbOptions), "soft": ("ib", IbOptions),
                                                        "efa": ("efa", EfaOptions)}

# The keys each backend takes from the config besides its own table: (constructor keyword, how to read it).
# The config is duck-typed here (transportd.config imports this module, not the other way round).
_SHARED: dict[str, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    "ib": (("signal_mode", lambda config: config.signal.mode),),
    "soft": (("signal_mode", lambda config: config.signal.mode),),
    "efa": (("visibility_flush", lambda config: config.efa.visibility_flush),),
}


def open_configured(config: Any, *, device: str | None, verbs: Any) -> Backend:
    """Open ``config.backend.kind``'s backend on ``device`` with the options it takes, and no other: its own
    table (:data:`OPTIONS`), the proxy's bounds, and the shared keys it reads (``signal.mode`` for ib,
    ``efa.visibility_flush`` for efa). ``config`` is a :class:`transportd.config.Config`."""
    kind = config.backend.kind
    table, _ = OPTIONS[kind]
    opts = msgspec.structs.asdict(getattr(config.backend, table))
    opts.update({name: read(config) for name, read in _SHARED[kind]})
    return open_backend(kind, device=device, verbs=verbs, inflight_cap=config.proxy.inflight_cap,
                        batch_max=config.proxy.batch_max, **opts)


# ---------------------------------------------------------------------------------------------------------
# What each backend makes of the shared signal and flag settings; the config refuses what one cannot honour.


@dataclass(frozen=True)
class ConfigRules:
    """Which shared settings a backend honours (docs/design.md, "Flags follow their data", says why for each)."""

    signal_modes: tuple[str, ...] = ("write", "atomic", "fence")
    signal_modes_why: str = ""  #: why a mode outside ``signal_modes`` does not apply
    write_needs_in_order: bool = False  #: ``write`` signaling relies on in-order placement


_RC = ConfigRules(write_needs_in_order=True)  # write-then-flag on one RC QP: adaptive routing breaks it
RULES: dict[str, ConfigRules] = {
    "ib": _RC,
    "soft": _RC,
    # SRD has no ordered flag write, no fence and no atomics to order with: an efa signal is published by
    # the receiving daemon once every piece it covers has arrived, whatever the mode says; accepting
    # atomic/fence would promise an ordering that is not what happens. Decoupling keeps each batch's
    # leading signals and trailing writes in place, so no efa signal covers less than it did as pushed
    # (transportd_models/batching.py; tests/transportd/dataplane/test_flag_order_property.py).
    "efa": ConfigRules(signal_modes=("write",),
                       signal_modes_why="the receiving daemon publishes a flag once every piece it covers arrived"),
}


def config_problems(kind: str, *, signal_mode: str, flags_publication: str,
                    adaptive_routing: bool) -> list[tuple[str, str]]:
    """``(config key, reason)`` for each shared setting backend ``kind`` cannot honour ([] when it can)."""
    rules = RULES.get(kind, ConfigRules())
    problems = []
    if rules.write_needs_in_order and adaptive_routing and signal_mode == "write":
        problems.append(("signal.mode", "write signaling is unsafe with adaptive routing "
                                        "(softverbs.adaptive_routing); use atomic or fence"))
    if signal_mode not in rules.signal_modes:
        problems.append(("signal.mode", f"{signal_mode!r} does not apply to backend.kind = \"{kind}\" "
                                        f"({rules.signal_modes_why}); leave it at \"write\" (the default)"))
    if flags_publication != "auto" and not TRAITS.get(kind, Traits()).publishes_flags:
        publishers = " or ".join(f'"{k}"' for k, t in TRAITS.items() if t.publishes_flags)
        problems.append(("flags.publication", f"{flags_publication!r} applies to backend.kind = {publishers} only, "
                                              f"where the receiving daemon publishes flags; on {kind!r} leave it "
                                              "at \"auto\""))
    return problems
