"""Limits two parts depend on (cmd_ring/limits.py) agree: the config's proxy limits are the proxy's (a real
proxy accepts each bound and refuses one step past it, and the config refuses the same values at load, so a
worker never raises on a value the config took); the protocol's are those of the code serving it."""

from __future__ import annotations

import pytest

from ibgda.queue_memory import QueueMemory
from transportd.backends.null import NullBackend
from transportd.config import load_config
from transportd.control.protocol import Channel, Join
from transportd.dataplane.proxy import Proxy
from transportd.dataplane.tables import PeerTable
from transportd.errors import ConfigError, LocalProtocolError
from transportd.limits import (
    MAX_BATCH,
    MAX_CHANNEL_CAPACITY,
    MAX_IBGDA_WQES,
    MAX_INFLIGHT_CAP,
    MAX_TAKE,
    MAX_WORLD,
    MIN_BATCH,
    MIN_CHANNEL_CAPACITY,
    MIN_IBGDA_WQES,
    MIN_INFLIGHT_CAP,
    MIN_TAKE,
)


@pytest.mark.parametrize(("key", "good", "bad"), [
    ("batch_max", MIN_BATCH, MIN_BATCH - 1),
    ("batch_max", MAX_BATCH, MAX_BATCH + 1),
    ("inflight_cap", MIN_INFLIGHT_CAP, MIN_INFLIGHT_CAP - 1),
    ("max_take", MIN_TAKE, MIN_TAKE - 1),
    ("max_take", MAX_TAKE, MAX_TAKE + 1),
])
def test_the_proxy_and_the_config_agree_on_each_bound(tmp_path, key: str, good: int, bad: int) -> None:
    Proxy(NullBackend(), **{key: good})
    with pytest.raises(ValueError):
        Proxy(NullBackend(), **{key: bad})
    path = tmp_path / "t.toml"
    path.write_text(f"[proxy]\n{key} = {good}\n")
    assert getattr(load_config(path, env={}).proxy, key) == good
    path.write_text(f"[proxy]\n{key} = {bad}\n")
    with pytest.raises(ConfigError, match=f"proxy.{key}: must be in"):
        load_config(path, env={})


def test_the_largest_inflight_cap_the_config_takes_builds_a_proxy(tmp_path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(f"[proxy]\ninflight_cap = {MAX_INFLIGHT_CAP}\n")
    cfg = load_config(path, env={})
    assert Proxy(NullBackend(), inflight_cap=cfg.proxy.inflight_cap).inflight_cap == MAX_INFLIGHT_CAP


def test_the_protocol_and_the_proxy_tables_agree_on_the_world_size() -> None:
    # a join the protocol accepts is one the proxy's peer table can hold (a record names its peer as u16)
    Join("j", MAX_WORLD - 1, MAX_WORLD, 0)
    PeerTable().set_world(MAX_WORLD)
    with pytest.raises(LocalProtocolError, match="world"):
        Join("j", 0, MAX_WORLD + 1, 0)
    with pytest.raises(ValueError):
        PeerTable().set_world(MAX_WORLD + 1)


@pytest.mark.parametrize(("good", "bad"), [(MIN_IBGDA_WQES, MIN_IBGDA_WQES // 2), (MAX_IBGDA_WQES, MAX_IBGDA_WQES * 2)])
def test_the_protocol_and_the_ibgda_queue_agree_on_its_size(good: int, bad: int) -> None:
    Channel(good, "ibgda")
    assert QueueMemory(good, good).wqe_cnt == good  # an anonymous mapping, freed with the object
    with pytest.raises(LocalProtocolError, match="capacity"):
        Channel(bad, "ibgda")
    with pytest.raises(ValueError):
        QueueMemory(bad, bad)


@pytest.mark.parametrize(("good", "bad"), [(MIN_CHANNEL_CAPACITY, MIN_CHANNEL_CAPACITY // 2),
                                           (MAX_CHANNEL_CAPACITY, MAX_CHANNEL_CAPACITY * 2)])
def test_the_config_and_the_protocol_agree_on_the_ring_capacity(tmp_path, good: int, bad: int) -> None:
    path = tmp_path / "t.toml"
    path.write_text(f"[proxy]\nring_capacity = {good}\n")
    assert load_config(path, env={}).proxy.ring_capacity == good == Channel(good).capacity
    path.write_text(f"[proxy]\nring_capacity = {bad}\n")
    with pytest.raises(ConfigError, match="proxy.ring_capacity: must be in"):
        load_config(path, env={})
    with pytest.raises(LocalProtocolError, match="capacity"):
        Channel(bad)


def test_the_peer_the_device_api_writes_for_a_rank_that_does_not_fit_is_never_a_rank() -> None:
    """peer_field() (channel_device.cuh) and the Triton calls write 0xFFFF for a rank above it, and the proxy
    must refuse that: in a world of 65,536 it was rank 65,535, so a record meant for rank 70,000 went there."""
    assert MAX_WORLD - 1 < 0xFFFF
    with pytest.raises(LocalProtocolError, match="world"):
        Join("j", 0, 0xFFFF + 1, 0)
    with pytest.raises(LocalProtocolError, match="rank"):
        Join("j", 0xFFFF, MAX_WORLD, 0)
    with pytest.raises(ValueError):
        PeerTable().set_world(0xFFFF + 1)
