"""The one place that picks a backend by name (DESIGN.md section 2: nothing else branches on it).

Each backend registers a ``"module:Class"`` entry in :data:`BACKENDS`; the module is imported only when
that backend is opened, so a node without pyverbs can still run the null backend.
"""

from __future__ import annotations

import importlib
from typing import Any

from transportd.backends.interface import Backend

__all__ = ["BACKENDS", "CAPABILITIES", "DEVICE_KINDS", "FIXED_PROVIDERS", "IBGDA", "has_capability", "kinds_with",
           "open_backend"]

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

#: A capability: the backend serves IBGDA channels (mlx5 queue pairs the GPU posts its own WQEs to).
IBGDA = "ibgda"

# What each backend can do beyond the interface, declared here because the daemon's main process asks
# before any backend is open (only the rail workers open one).
CAPABILITIES: dict[str, frozenset[str]] = {"ib": frozenset({IBGDA})}

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
