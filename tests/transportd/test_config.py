"""Config loading: defaults from an empty file, every key settable, every kind of mistake named precisely."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest

from softverbs._device import DeviceOptions
from transportd.backends import config_problems
from transportd.config import (
    DEFAULT_SOCKET,
    KEYS,
    Config,
    RailConfig,
    default_config,
    describe_keys,
    load_config,
)
from transportd.control.curve import generate_keypair
from transportd.errors import ConfigError


@pytest.fixture
def write(tmp_path):
    def write(text: str, name: str = "transportd.toml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


def test_empty_file_gives_defaults(write):
    cfg = load_config(write(""), env={})
    assert cfg == Config()
    assert cfg.node.name == socket.gethostname()
    assert cfg.control.socket == DEFAULT_SOCKET
    assert cfg.control.mode == 0o660 and cfg.control.group is None
    assert cfg.peers.listen == "tcp://0.0.0.0:18515"
    assert cfg.proxy.batch_max == 8 and cfg.signal.mode == "write" and cfg.flags.placement == "host"
    assert cfg.metrics.listen == "" and not cfg.security.curve_enabled
    assert cfg.source.endswith("transportd.toml")


def test_none_path_gives_defaults():
    assert load_config(None, env={}) == default_config(env={}) == Config()


def test_full_file(write):
    path = write("""
        [node]
        name = "gpu-07"
        [control]
        socket = "ipc:///tmp/tpd/control.sock"
        mode = 0o600
        group = ""
        max_message_bytes = 65536
        client_timeout_s = 120
        [peers]
        listen = "tcp://*:19000"
        static = ["gpu-08:19000", "[fe80::1]:19000"]
        heartbeat_interval_s = 0.5
        heartbeat_timeout_s = 3
        [backend]
        kind = "ib"
        verbs = "soft"
        [[backend.rails]]
        device = "rdmap16s27"
        gpu = 0
        numa_node = 0
        [[backend.rails]]
        device = "rdmap32s27"
        [proxy]
        batch_max = 4
        poll_window_us = 0
        inflight_cap = 64
        ring_capacity = 1024
        [signal]
        mode = "fence"
        decoupled = true
        [flags]
        placement = "device"
        [efa]
        visibility_flush = false
        [logging]
        level = "DEBUG"
        format = "text"
        [metrics]
        listen = "127.0.0.1:9400"
    """)
    cfg = load_config(path, env={})
    assert cfg.node.name == "gpu-07"
    assert cfg.control.mode == 0o600 and cfg.control.group is None
    assert cfg.control.client_timeout_s == 120.0
    assert cfg.peers.static == ("gpu-08:19000", "[fe80::1]:19000")
    assert cfg.peers.heartbeat_timeout_s == 3.0 and isinstance(cfg.peers.heartbeat_timeout_s, float)
    assert cfg.backend.rails == (RailConfig("rdmap16s27", 0, 0), RailConfig("rdmap32s27"))
    assert cfg.logging.level == "debug"
    as_dict = cfg.to_dict()
    assert as_dict["backend"]["rails"][1] == {"device": "rdmap32s27", "gpu": -1, "numa_node": -1, "loop_cpu": -1}
    assert as_dict["signal"] == {"mode": "fence", "decoupled": True}
    assert set(as_dict) == {k.split(".")[0] for k in KEYS}


def test_the_nic_model_and_direct_copy_keys(write):
    cfg = load_config(write("[softverbs]\nnic_bandwidth = 50000000000\nnic_latency_s = 2e-6\n"
                            "nic_message_rate = 2e8\ndirect_copy = false\ndirect_copy_via = 'host'\n"
                            "io_spin_s = 0.001\n"), env={})
    sv = cfg.softverbs
    assert (sv.nic_bandwidth, sv.nic_latency_s, sv.nic_message_rate, sv.direct_copy) == (50e9, 2e-6, 2e8, False)
    assert sv.io_spin_s == 0.001 and Config().softverbs.io_spin_s == 0.0  # off unless asked for
    assert Config().softverbs.gil_switch_interval_s == 0.0  # Python's own unless asked for
    assert sv.nic_spin_s == Config().softverbs.nic_spin_s == DeviceOptions().nic_spin_s == 30e-6
    assert sv.direct_copy_via == "host"
    assert isinstance(sv.nic_bandwidth, float)  # an integer in TOML is still bytes/s
    defaults = Config().softverbs
    assert (defaults.nic_bandwidth, defaults.nic_latency_s, defaults.nic_message_rate) == (0.0, 0.0, 0.0)
    assert defaults.direct_copy  # on: the GPU suite runs with it
    assert defaults.direct_copy_via == "device"


def test_mode_as_octal_string(write):
    assert load_config(write('[control]\nmode = "0640"\n'), env={}).control.mode == 0o640


def test_env_overrides_socket(write):
    path = write('[control]\nsocket = "ipc:///tmp/a.sock"\n')
    assert load_config(path, env={"TRANSPORTD_SOCKET": "ipc:///tmp/b.sock"}).control.socket == "ipc:///tmp/b.sock"
    assert load_config(path, env={"TRANSPORTD_SOCKET": ""}).control.socket == "ipc:///tmp/a.sock"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={"TRANSPORTD_SOCKET": "/tmp/c.sock"})
    assert (info.value.file, info.value.key) == ("$TRANSPORTD_SOCKET", "control.socket")


BAD = [
    ("[nodes]\nname = 'x'\n", "nodes", "unknown section; known sections: node, control"),
    ("node = 3\n", "node", r"expected a \[node\] table, got integer"),
    ("[peers]\nlisten_on = 'tcp://x:1'\n", "peers.listen_on", "unknown key; known keys here: listen, static"),
    ("[proxy]\nbatch_max = '2'\n", "proxy.batch_max", "expected integer, got string '2'"),
    ("[proxy]\nbatch_max = true\n", "proxy.batch_max", "expected integer, got boolean"),
    ("[proxy]\nbatch_max = 2.0\n", "proxy.batch_max", "expected integer, got float"),
    ("[proxy]\nworkers = 2\n", "proxy.workers", r"removed \(it set nothing\): each rail .* delete this line"),
    ("[proxy]\ninflight_cap = 1\n", "proxy.inflight_cap", r"must be in \[2, 65536\], got 1"),
    ("[backend]\nkind = 'efa'\n[signal]\nmode = 'fence'\n", "signal.mode",
     "'fence' does not apply to backend.kind = \"efa\""),
    ("[backend]\nkind = 'efa'\n[signal]\nmode = 'atomic'\n", "signal.mode",
     "'atomic' does not apply to backend.kind = \"efa\""),
    ("[control]\nmode = 660\n", "control.mode", r"660 is a decimal number in TOML; an octal mode needs 0o660"),
    ("[proxy]\nbatch_max = 9\n", "proxy.batch_max", r"must be in \[1, 8\], got 9"),
    ("[proxy]\nbatch_max = 0\n", "proxy.batch_max", r"must be in \[1, 8\], got 0"),
    ("[proxy]\nring_capacity = 1000\n", "proxy.ring_capacity", "must be a power of two, got 1000"),
    ("[signal]\nmode = 'magic'\n", "signal.mode", "must be one of 'write', 'atomic', 'fence', got 'magic'"),
    ("[signal]\ndecoupled = 'yes'\n", "signal.decoupled", "expected boolean, got string"),
    ("[backend]\nkind = 'tcp'\n", "backend.kind", "must be one of 'ib', 'efa', 'soft'"),
    ("[backend]\nrails = 'mlx5_0'\n", "backend.rails", "expected an array, got string"),
    ("[[backend.rails]]\ngpu = 0\n", "backend.rails[0].device", "required key is missing"),
    ("[[backend.rails]]\ndevice = 'mlx5_0'\nnuma = 1\n", "backend.rails[0].numa", "unknown key"),
    ("[[backend.rails]]\ndevice = 'a'\n[[backend.rails]]\ndevice = 'a'\n", "backend.rails[1].device", "twice"),
    ("[[backend.rails]]\ndevice = 'a'\nloop_cpu = -2\n", "backend.rails[0].loop_cpu",
     r"must be in \[-1, 4095\], got -2"),
    ("[[backend.rails]]\ndevice = 'a'\nloop_cpu = '3'\n", "backend.rails[0].loop_cpu", "expected integer, got string"),
    ("[proxy]\nmax_take = 'all'\n", "proxy.max_take", "expected integer, got string"),
    ("[[backend.rails]]\ndevice = 'a'\ngpu = 64\n", "backend.rails[0].gpu", "must be in"),
    ("[peers]\nstatic = ['gpu-08']\n", "peers.static[0]", "expected 'host:port'"),
    ("[peers]\nstatic = ['gpu-08:0']\n", "peers.static[0]", "port must be 1..65535"),
    ("[peers]\nstatic = 'gpu-08:1'\n", "peers.static", "expected an array"),
    ("[peers]\nlisten = 'ipc:///tmp/x'\n", "peers.listen", "expected 'tcp://host:port'"),
    ("[peers]\nheartbeat_interval_s = 2.0\nheartbeat_timeout_s = 1.0\n", "peers.heartbeat_timeout_s",
     "must be more than peers.heartbeat_interval_s"),
    ("[peers]\nheartbeat_interval_s = nan\n", "peers.heartbeat_interval_s", "finite"),
    ("[control]\nsocket = '/run/x.sock'\n", "control.socket", "expected 'ipc:///path' or 'tcp://host:port'"),
    ("[control]\nsocket = 'ipc://relative.sock'\n", "control.socket", "absolute path"),
    ("[control]\nmode = 0o1777\n", "control.mode", "permission mode"),
    ("[control]\nmode = 'rw-rw----'\n", "control.mode", "octal mode"),
    ("[control]\nmode = 1.5\n", "control.mode", "expected integer or string, got float"),
    ("[control]\ngroup = 5\n", "control.group", "expected a string, got integer"),
    ("[control]\nmax_message_bytes = 10\n", "control.max_message_bytes", "must be in"),
    ("[control]\nclient_timeout_s = 0\n", "control.client_timeout_s", "must be in"),
    ("[control]\nclient_timeout_s = 'long'\n", "control.client_timeout_s", "expected"),
    ("[node]\nname = 'has space'\n", "node.name", "not a node name"),
    ("[logging]\nlevel = 'loud'\n", "logging.level", "must be one of debug, info"),
    ("[logging]\nformat = 'xml'\n", "logging.format", "must be one of 'json', 'text'"),
    ("[metrics]\nlisten = 'localhost'\n", "metrics.listen", "expected 'host:port'"),
    ("[efa]\nvisibility_flush = 1\n", "efa.visibility_flush", "expected boolean, got integer"),
    ("[softverbs]\nnic_bandwidth = -1.0\n", "softverbs.nic_bandwidth", r"must be in \[0.0, "),
    ("[softverbs]\nnic_bandwidth = nan\n", "softverbs.nic_bandwidth", "must be finite"),
    ("[softverbs]\nnic_latency_s = 2.0\n", "softverbs.nic_latency_s", r"must be in \[0.0, 1.0\], got 2.0"),
    ("[softverbs]\nio_spin_s = -0.001\n", "softverbs.io_spin_s", r"must be in \[0.0, 1.0\]"),
    ("[softverbs]\nio_spin_s = nan\n", "softverbs.io_spin_s", "must be finite"),
    ("[softverbs]\nnic_spin_s = 0.5\n", "softverbs.nic_spin_s", r"must be in \[0.0, 0.01\]"),
    ("[softverbs]\ngil_switch_interval_s = 1.0\n", "softverbs.gil_switch_interval_s", r"must be in \[0.0, 0.1\]"),
    ("[softverbs]\nnic_message_rate = 'fast'\n", "softverbs.nic_message_rate", "expected float, got string"),
    ("[softverbs]\ndirect_copy = 1\n", "softverbs.direct_copy", "expected boolean, got integer"),
    ("[softverbs]\nnic_streaming = 'off'\n", "softverbs.nic_streaming", "expected boolean, got string"),
    ("[softverbs]\ndirect_copy_via = 'pcie'\n", "softverbs.direct_copy_via",
     "must be one of 'device', 'host', got 'pcie'"),
    ("[softverbs]\nnic_bandwidh = 1e9\n", "softverbs.nic_bandwidh", "unknown key"),
    ("[security]\ncurve_public_key_file = 'pub.key'\n", "security.curve_secret_key_file", "required when"),
    ("[security]\ncurve_secret_key_file = 'missing.key_secret'\n", "security.curve_secret_key_file",
     "does not exist"),
    ("[proxy\nbatch_max = 1\n", "(syntax)", r"TOML syntax error: .*line 1"),
    ("[proxy]\nbatch_max = 1\nbatch_max = 2\n", "(syntax)", r"line 3"),
]


@pytest.mark.parametrize(("text", "key", "reason"), BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_bad_config_names_file_key_and_reason(write, text, key, reason):
    path = write(text)
    with pytest.raises(ConfigError, match=reason) as info:
        load_config(path, env={})
    err = info.value
    assert (err.file, err.key) == (str(path), key)
    assert str(err) == f"{path}: {key}: {err.reason}"


def test_unreadable_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read: No such file") as info:
        load_config(missing, env={})
    assert info.value.key == "(file)"
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe[node]\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary, env={})


@pytest.fixture
def keys(tmp_path):
    public, secret = generate_keypair(tmp_path / "keys", "node")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    return public, secret, authorized


def test_curve_keys_resolve_relative_to_the_file(write, keys, tmp_path):
    public, secret, authorized = keys
    path = write(f"""
        [security]
        curve_secret_key_file = "{secret.relative_to(tmp_path)}"
        curve_public_key_file = "{public}"
        curve_authorized_keys_dir = "authorized"
    """)
    sec = load_config(path, env={}).security
    assert sec.curve_enabled
    assert sec.curve_secret_key_file == str(secret) and sec.curve_authorized_keys_dir == str(authorized)


@pytest.mark.parametrize(
    ("lines", "key", "reason"),
    [
        (['curve_secret_key_file = "{public}"', 'curve_authorized_keys_dir = "{authorized}"'],
         "security.curve_secret_key_file", "holds no secret key"),
        (['curve_secret_key_file = "{garbage}"', 'curve_authorized_keys_dir = "{authorized}"'],
         "security.curve_secret_key_file", "not a zmq CURVE certificate"),
        (['curve_secret_key_file = "{secret}"'], "security.curve_authorized_keys_dir", "required with a secret key"),
        (['curve_secret_key_file = "{secret}"', 'curve_authorized_keys_dir = "{public}"'],
         "security.curve_authorized_keys_dir", "not a directory"),
        (['curve_secret_key_file = "{secret}"', 'curve_public_key_file = "{other}"',
          'curve_authorized_keys_dir = "{authorized}"'], "security.curve_public_key_file", "does not match"),
    ],
)
def test_bad_curve_settings(write, keys, tmp_path, lines, key, reason):
    public, secret, authorized = keys
    other, _ = generate_keypair(tmp_path / "other", "x")
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    names = {"public": public, "secret": secret, "authorized": authorized, "other": other, "garbage": garbage}
    body = "\n".join(line.format(**names) for line in lines)
    with pytest.raises(ConfigError, match=reason) as info:
        load_config(write(f"[security]\n{body}\n"), env={})
    assert info.value.key == key


def test_describe_keys_lists_every_key_with_its_default():
    table = describe_keys()
    lines = table.strip().splitlines()
    assert lines[0] == "| key | type | default | meaning |"
    assert len(lines) == 2 + len(KEYS)
    assert "| `proxy.batch_max` | int | `8` |" in table
    assert "| `control.socket` | str | `\"ipc:///run/transportd/control.sock\"` |" in table
    assert "`backend.rails[].device`" in table
    for key, info in KEYS.items():
        assert info.meaning, key


def test_every_documented_key_can_be_written_back(write):
    """to_dict() of the defaults is itself a valid config file (modulo None, which TOML cannot say)."""
    lines = []
    for section, values in Config().to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None or key == "rails":
                continue
            if isinstance(value, dict):  # a backend's own table, e.g. [backend.ib], as an inline table
                lines.append(f"{key} = {{{', '.join(f'{k} = {v!r}' for k, v in value.items())}}}")
            elif isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                lines.append(f'{key} = "{value}"')
            else:
                lines.append(f"{key} = {value!r}".replace("()", "[]").replace("[]", "[]"))
    cfg = load_config(write("\n".join(lines) + "\n"), env={})
    assert cfg == Config()
    assert os.fspath(cfg.source).endswith(".toml")


def test_decoupled_signaling_is_taken_on_efa(tmp_path) -> None:
    # decoupling keeps what every efa signal covers (test_flag_order_property, transportd_models.batching)
    path = tmp_path / "efa.toml"
    path.write_text('[backend]\nkind = "efa"\n[signal]\ndecoupled = true\n')
    cfg = load_config(path)
    assert cfg.backend.kind == "efa" and cfg.signal.decoupled


def test_the_docs_config_table_is_the_generated_one():
    page = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert describe_keys() in page, "regenerate docs/config.md's table: python -m transportd.ops.docs"


def test_each_backend_has_its_own_table(write):
    cfg = load_config(write("[backend.ib]\nport = 2\ngid_index = 3\n[backend.efa]\ngid_index = 1\n"), env={})
    assert (cfg.backend.ib.port, cfg.backend.ib.gid_index, cfg.backend.efa.gid_index) == (2, 3, 1)
    assert cfg.to_dict()["backend"]["ib"] == {"port": 2, "gid_index": 3}
    assert "| `backend.ib.gid_index` | int | `0` |" in describe_keys()


@pytest.mark.parametrize(("text", "key", "reason"), [
    ("[backend.ib]\nport = 0\n", "backend.ib.port", r"must be in \[1, 255\], got 0"),
    ("[backend.ib]\nsignal_mode = 'atomic'\n", "backend.ib.signal_mode", "unknown key; known keys here: port"),
    ("[backend.efa]\ngid_index = 'x'\n", "backend.efa.gid_index", "expected integer, got string"),
    ("[backend]\nib = 1\n", "backend.ib", "expected a table, got integer"),
    ("[[backend.rails]]\ndevice = 'a'\n" * 2 + "".join(f"[[backend.rails]]\ndevice = 'n{i}'\n" for i in range(15)),
     "backend.rails", "at most 16 items"),
])
def test_bad_backend_tables(write, text, key, reason):
    with pytest.raises(ConfigError, match=reason) as info:
        load_config(write(text), env={})
    assert info.value.key == key


def test_the_registry_says_what_each_backend_cannot_honour():
    # the config asks transportd.backends instead of branching on backend.kind
    ok = {"signal_mode": "write", "flags_publication": "auto", "adaptive_routing": False}
    for kind in ("ib", "soft", "efa"):
        assert config_problems(kind, **ok) == []
    assert [k for k, _ in config_problems("soft", **{**ok, "adaptive_routing": True})] == ["signal.mode"]
    assert config_problems("efa", **{**ok, "adaptive_routing": True}) == []  # SRD: the receiver publishes
    assert [k for k, _ in config_problems("ib", **{**ok, "flags_publication": "gdrcopy"})] == ["flags.publication"]
    assert config_problems("efa", **{**ok, "flags_publication": "gdrcopy"}) == []


def test_a_default_shown_as_off_means_off() -> None:
    """The docs table said flags.gdrcopy_library's empty default was "off"; empty looks libgdrapi up by name."""
    for name, info in KEYS.items():
        if "(off)" in info.default:
            assert "empty: off" in info.meaning, f"{name}: default {info.default}, but: {info.meaning}"
    assert "(off)" not in KEYS["flags.gdrcopy_library"].default
