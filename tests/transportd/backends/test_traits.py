"""Every backend's abilities beyond the interface are declared once per kind (transportd.backends.TRAITS),
and each class has exactly the methods its declaration promises: nothing is probed on a backend object."""

from __future__ import annotations

import importlib

import pytest

from transportd.backends import BACKENDS, CAPABILITIES, IBGDA, TRAITS, Traits, traits_of

# what each trait promises a backend class has
PROMISES = {
    "compiled_poster": ("c_poster",),
    "ibgda": ("create_ibgda_domain",),
    "publishes_flags": ("set_host_flags", "clear_host_flags", "set_mapped_flags", "loopback_unavailable",
                        "open_flag_loopback"),
}


def _class(kind: str) -> type:
    module, _, name = BACKENDS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_registered_backend_declares_its_traits() -> None:
    assert set(TRAITS) == set(BACKENDS)
    assert all(isinstance(t, Traits) for t in TRAITS.values())


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_a_declared_trait_is_backed_by_its_methods_and_an_undeclared_one_is_not(kind: str) -> None:
    cls = _class(kind)
    own = TRAITS[cls.name]  # the traits of the kind the class implements ("soft" is the ib class)
    for trait, methods in PROMISES.items():
        for method in methods:
            assert hasattr(cls, method) == getattr(own, trait), (kind, trait, method)


def test_the_main_process_capabilities_agree_with_the_traits() -> None:
    assert CAPABILITIES == {kind: frozenset({IBGDA}) for kind, t in TRAITS.items() if t.ibgda}


def test_traits_are_looked_up_by_the_backend_name() -> None:
    class Efa:
        name = "efa"

    assert traits_of(Efa()).receives and traits_of(Efa()).publishes_flags
    with pytest.raises(KeyError):
        traits_of(type("Unknown", (), {"name": "nic9"})())
