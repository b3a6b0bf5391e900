"""The config's proxy limits are the proxy's: a real proxy accepts each bound and refuses one step past it,
and the config refuses the same values at load (so a worker never raises on a value the config took)."""

from __future__ import annotations

import pytest

from transportd.backends.null import NullBackend
from transportd.daemon.config import load_config
from transportd.dataplane.proxy import Proxy
from transportd.errors import ConfigError
from transportd.limits import MAX_BATCH, MAX_INFLIGHT_CAP, MIN_BATCH, MIN_INFLIGHT_CAP


@pytest.mark.parametrize(("key", "good", "bad"), [
    ("batch_max", MIN_BATCH, MIN_BATCH - 1),
    ("batch_max", MAX_BATCH, MAX_BATCH + 1),
    ("inflight_cap", MIN_INFLIGHT_CAP, MIN_INFLIGHT_CAP - 1),
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
