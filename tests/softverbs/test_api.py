"""softverbs' public surface and the transportd.backends.verbs switch (pyverbs side: tests/test_pyverbs_api.py)."""

from __future__ import annotations

import enum
import importlib

import pytest

from transportd.backends import verbs
from transportd.errors import VerbsUnavailableError

MODULES = ["device", "pd", "mr", "cq", "qp", "wr", "addr", "libibverbs_enums", "pyverbs_error",
           "providers.efa.efadv", "providers.efa.efa_enums"]


@pytest.mark.parametrize("path", MODULES)
def test_every_exported_name_exists(path: str) -> None:
    mod = importlib.import_module(f"softverbs.{path}")
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing
    assert not [n for n in mod.__all__ if n.startswith("soft_") or n.startswith("_")]


def test_enum_members_are_exported_at_module_level_with_their_class() -> None:
    e = importlib.import_module("softverbs.libibverbs_enums")
    for name in e.__all__:
        obj = getattr(e, name)
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            assert issubclass(obj, enum.IntFlag)  # what pyverbs' Cython enums are
            for member_name, member in obj.__members__.items():
                assert getattr(e, member_name) is member
    assert (e.IBV_WC_RECV_RDMA_WITH_IMM, e.IBV_QPT_DRIVER, e.IBV_ACCESS_RELAXED_ORDERING) == (129, 0xFF, 1 << 20)


def test_errors_carry_errno() -> None:
    from softverbs.pyverbs_error import PyverbsError, PyverbsRDMAError, PyverbsUserError

    err = PyverbsRDMAError("Failed to post send", 12)
    assert err.error_code == 12 and "Errno: 12" in str(err)
    assert issubclass(PyverbsRDMAError, PyverbsError) and issubclass(PyverbsUserError, PyverbsError)


def test_load_soft_gives_the_softverbs_modules() -> None:
    v = verbs.load("soft")
    assert v.name == "soft"
    assert v.device.__name__ == "softverbs.device"
    assert v.enums is v.libibverbs_enums and v.error is v.pyverbs_error
    assert v.efadv.__name__ == "softverbs.providers.efa.efadv" and v.soft is not None


def test_env_and_argument_choose_the_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(verbs.ENV, "soft")
    assert verbs.load().name == "soft"
    monkeypatch.setenv(verbs.ENV, "bogus")
    with pytest.raises(VerbsUnavailableError):
        verbs.load()
    assert verbs.load("soft").name == "soft"  # the explicit argument wins


def test_auto_falls_back_to_soft_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(verbs.ENV, raising=False)
    monkeypatch.setattr(verbs, "pyverbs_devices", lambda: [])
    assert verbs.load().name == "soft"
    monkeypatch.setattr(verbs, "pyverbs_devices", lambda: None)
    assert verbs.load("auto").name == "soft"


def test_pyverbs_is_loaded_when_asked_or_refused_clearly() -> None:
    if verbs.pyverbs_devices() is None:
        with pytest.raises(VerbsUnavailableError, match="TRANSPORTD_VERBS=soft"):
            verbs.load("pyverbs")
    else:
        assert verbs.load("pyverbs").name == "pyverbs"


def test_softverbs_config_is_applied_to_the_default_devices() -> None:
    from softverbs import soft

    before = soft.device_options("softib0")
    saved = (before.adaptive_routing, before.reorder_seed)
    try:
        verbs.load("soft", soft_options={"adaptive_routing": True, "reorder_seed": 5})
        assert (soft.device_options("softib0").adaptive_routing, soft.device_options("softefa0").reorder_seed) \
            == (True, 5)
        verbs.configure_soft({"reorder_seed": -1, "adaptive_routing": False})
        assert soft.device_options("softib0").reorder_seed is None
    finally:
        soft.configure("softib0", adaptive_routing=saved[0], reorder_seed=saved[1])
        soft.configure("softefa0", reorder_seed=None)


def test_get_device_list_names_the_soft_devices() -> None:
    v = verbs.load("soft")
    names = [d.name for d in v.device.get_device_list()]
    assert b"softib0" in names and b"softefa0" in names
    with pytest.raises(v.error.PyverbsRDMAError):
        v.device.Context(name="no-such-device")
    with pytest.raises(v.error.PyverbsUserError):
        v.device.Context()


def test_gid_names_the_tcp_endpoint() -> None:
    from softverbs import soft

    gid = soft.gid_for_endpoint("10.1.2.3", 40001)
    assert gid == "0000:0000:0000:0000:9c41:ffff:0a01:0203"
    assert soft.endpoint_from_gid(gid) == ("10.1.2.3", 40001)
    assert soft.endpoint_from_gid("fe80:0000:0000:0000:0202:c9ff:fe00:0001") is None
    v = verbs.load("soft")
    with v.device.Context(name="softib0") as ctx:
        host, port = soft.endpoint_of(ctx)
        assert ctx.query_port(1).lid == port
        assert soft.endpoint_from_gid(str(ctx.query_gid(1, 0))) == (host, port)
