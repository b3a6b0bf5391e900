"""A rail naming a soft device that does not exist yet gets one, through the verbs switch's soft options."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import msgspec
import pytest

from transportd.backends import DEVICE_KINDS, verbs
from transportd.config import Config


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    from softverbs.device import registry

    for name in names:
        registry().pop(name, None)


def _node_types(v: verbs.VerbsModules) -> dict[str, str]:
    nodes = v.libibverbs_enums.ibv_node_type
    by_value = {int(getattr(nodes, n)): n for n in ("IBV_NODE_CA", "IBV_NODE_UNSPECIFIED")}
    return {d.name.decode(): by_value.get(int(d.node_type), "?") for d in v.device.get_device_list()}


def test_devices_option_creates_missing_devices_of_the_given_kind(cleanup: list[str]) -> None:
    from softverbs import soft

    cleanup += ["softtest-ib1", "softtest-efa1", "softtest-ib2"]
    v = verbs.load("soft", soft_options={"host": "127.0.0.1", "reorder_seed": 9,
                                         "devices": {"softtest-ib1": "ib", "softtest-efa1": "efa"}})
    types = _node_types(v)
    assert types["softtest-ib1"] == "IBV_NODE_CA" and types["softtest-efa1"] == "IBV_NODE_UNSPECIFIED"
    assert soft.device_options("softtest-efa1").kind == "efa"
    assert soft.device_options("softtest-ib1").reorder_seed == 9  # the [softverbs] settings apply to them too
    # idempotent: asking again (every worker start does) neither fails nor replaces the device
    before = soft.device_options("softtest-ib1")
    verbs.configure_soft({"devices": {"softtest-ib1": "ib"}, "reorder_seed": -1})
    assert soft.device_options("softtest-ib1") is before and before.reorder_seed is None
    assert soft.device_options("softib0").reorder_seed is None  # the defaults were reset with it
    verbs.configure_soft({"devices": ["softtest-ib2"]})  # a list of names: ib devices
    assert soft.device_options("softtest-ib2").kind == "ib"


def test_the_nic_model_reaches_every_soft_device_and_zero_means_unshaped(cleanup: list[str]) -> None:
    from softverbs import soft

    cleanup.append("softtest-efa2")
    try:
        verbs.configure_soft({"devices": {"softtest-efa2": "efa"}, "nic_bandwidth": 25e9, "nic_latency_s": 15e-6,
                              "nic_message_rate": 0.0, "nic_spin_s": 0.0, "nic_streaming": False})
        for name in ("softib0", "softefa0", "softtest-efa2"):
            opts = soft.device_options(name)
            assert (opts.nic_bandwidth, opts.nic_latency_s, opts.nic_message_rate) == (25e9, 15e-6, None)
            assert opts.nic_spin_s == 0.0 and opts.nic_streaming is False
        verbs.configure_soft({"nic_bandwidth": 0.0, "nic_latency_s": 0.0})
        assert not soft.device_options("softefa0").shaped()
        assert soft.device_options("softefa0").nic_streaming is False  # a key left out is left as it is
    finally:
        verbs.configure_soft({"nic_bandwidth": 0.0, "nic_latency_s": 0.0, "nic_message_rate": 0.0,
                              "nic_spin_s": Config().softverbs.nic_spin_s,
                              "nic_streaming": Config().softverbs.nic_streaming})
    assert soft.device_options("softib0").nic_streaming is True  # the config's default


def test_the_gil_switch_interval_is_the_process_s_and_zero_leaves_it() -> None:
    before = sys.getswitchinterval()
    try:
        section = msgspec.structs.replace(Config().softverbs, gil_switch_interval_s=5e-5)
        verbs.configure_soft(section)  # the config section itself
        assert sys.getswitchinterval() == pytest.approx(5e-5)
        verbs.configure_soft({"gil_switch_interval_s": 0.0})  # 0: Python's own, left as it is
        assert sys.getswitchinterval() == pytest.approx(5e-5)
        verbs.configure_soft({"gil_switch_interval_s": 2e-4})  # the rail worker's way: the section as a mapping
        assert sys.getswitchinterval() == pytest.approx(2e-4)
    finally:
        sys.setswitchinterval(before)


def test_a_created_device_opens_like_the_defaults(cleanup: list[str]) -> None:
    from ib.backend import IbBackend

    cleanup.append("softtest-ib3")
    v = verbs.load("soft", soft_options={"devices": {"softtest-ib3": DEVICE_KINDS["ib"]}})
    backend = IbBackend("softtest-ib3", verbs=v)
    try:
        assert backend.local_address()["device"] == "softtest-ib3"
    finally:
        backend.close()


def test_backend_kinds_name_a_device_kind() -> None:
    assert DEVICE_KINDS == {"ib": "ib", "soft": "ib", "efa": "efa"}
