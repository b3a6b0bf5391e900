"""Each rail's flag publication, chosen at start by what the node has, in the log and ``transportctl status``;
``session.flags()`` defaulting to what the daemon says (``flags.placement``); config forcing and its errors.

Real daemons over softverbs (efa): nodea has a "gdrdrv" (a file standing for the device node) and the
stand-in libgdrapi (tests/efa/gdr_standin.c), nodeb has no gdrdrv (loopback), nodec is forced to
host-mapped. No GPU is needed: what is checked is the choice, its reporting and the defaults.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpuclient
from tests.support.ctl import ctl
from transportd.config import load_config
from transportd.errors import ConfigError
from transportd_cli.localcluster import LocalCluster, free_port, render_toml

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

STANDIN_SOURCE = Path(__file__).resolve().parents[1] / "efa" / "gdr_standin.c"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("pub")
    library = tmp / "libgdrapi_standin.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(STANDIN_SOURCE)], check=True)
    (tmp / "gdrdrv").touch()
    absent = str(tmp / "no-gdrdrv")
    per_node = {
        "nodea": {"flags": {"placement": "device", "gdrdrv_device": str(tmp / "gdrdrv"),
                            "gdrcopy_library": str(library)}},
        "nodeb": {"flags": {"placement": "device", "gdrdrv_device": absent}},
        "nodec": {"flags": {"placement": "device", "publication": "host-mapped", "gdrdrv_device": absent}},
    }
    c = LocalCluster(3, backend="efa", per_node=per_node)
    try:
        yield c.start()
    finally:
        c.stop()


def _status(cluster: LocalCluster, node: str) -> dict:
    result = ctl("status", "--json", "--socket", cluster.socket(node))
    assert result.exit_code == 0, result.stderr
    return result.json()


@pytest.mark.parametrize(("node", "path"), [("nodea", "gdrcopy"), ("nodeb", "loopback"), ("nodec", "host-mapped")])
def test_each_rail_reports_its_flag_publication(cluster: LocalCluster, node: str, path: str) -> None:
    (rail,) = _status(cluster, node)["rails"]
    assert rail["flag_publication"] == path
    assert rail["flag_publication_detail"]["forced"] is (node == "nodec")
    human = ctl("status", "--socket", cluster.socket(node)).stdout
    assert f"flags by {path}" in human
    log = cluster.log(node)
    assert f"rail 0 flag publication: {path}" in log  # the worker says what it chose, and why
    assert "flag publication per rail: " + path in log


def test_the_log_says_why_without_gdrdrv(cluster: LocalCluster) -> None:
    assert "no-gdrdrv is absent (the gdrdrv kernel module is not loaded)" in cluster.log("nodeb")
    assert "libgdrapi_standin.so" in cluster.log("nodea")


@pytest.mark.parametrize(("node", "gpu_default"), [("nodea", "device"), ("nodeb", "device"), ("nodec", "host")])
def test_session_flags_defaults_to_the_daemons_placement(cluster: LocalCluster, node: str, gpu_default: str) -> None:
    with gpuclient.connect(cluster.socket(node)) as client:
        # a GPU client: flags.placement = "device", unless the node cannot publish into GPU memory
        gpu = client.join(f"job-{node}", rank=0, world=1, device=0)
        assert gpu.info["flags_placement"] == gpu_default == gpu.default_flags_placement
        flags = gpu.flags(4, where="host")  # an explicit where wins over the default
        assert type(flags) is gpuclient.FlagArray
        gpu.leave()
    with gpuclient.connect(cluster.socket(node)) as client:
        cpu = client.join(f"cpu-{node}", rank=0, world=1)  # no GPU: host, whatever the config says
        assert cpu.default_flags_placement == "host"
        flags = cpu.flags(4)  # the default: a host flag file
        assert type(flags) is gpuclient.FlagArray and len(flags) == 4
        with pytest.raises(ValueError, match="where"):
            cpu.flags(4, where="gpu")
        # an op's slots (the fused ops' check): inside the array it is kept, past its end refused
        cpu.flag_slots(1, 3, "SomeOp")
        assert cpu.flag_array is flags
        with pytest.raises(ValueError, match=r"SomeOp needs flag slots \[2, 6\); the session has 4"):
            cpu.flag_slots(2, 4, "SomeOp")
        cpu.leave()


def test_forcing_a_path_the_node_lacks_fails_at_start_and_says_why(tmp_path: Path) -> None:
    config = tmp_path / "t.toml"
    config.write_text(render_toml({
        "node": {"name": "forced"}, "control": {"socket": f"ipc://{tmp_path}/c.sock"},
        "peers": {"listen": f"tcp://127.0.0.1:{free_port()}"}, "backend": {"kind": "efa", "verbs": "soft"},
        "flags": {"publication": "gdrcopy", "gdrdrv_device": str(tmp_path / "gdrdrv")},
        "logging": {"format": "text"}}))
    proc = subprocess.run([sys.executable, "-m", "transportd", "run", "--config", str(config)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "flags.publication = \"gdrcopy\"" in proc.stderr and "gdrdrv is absent" in proc.stderr


@pytest.mark.parametrize(("flags", "backend", "match"), [
    ({"publication": "gpu"}, "efa", "flags.publication"),
    ({"publication": "loopback"}, "ib", "applies to backend.kind = \"efa\" only"),
    ({"placement": "gpu"}, "efa", "flags.placement"),
])
def test_bad_publication_settings_are_config_errors(tmp_path: Path, flags: dict, backend: str, match: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(render_toml({"backend": {"kind": backend}, "flags": flags}))
    with pytest.raises(ConfigError, match=match):
        load_config(path, env={})


def test_every_forceable_value_loads_on_efa(tmp_path: Path) -> None:
    for value in ("auto", "gdrcopy", "loopback", "host-mapped", "cuda-copy"):
        path = tmp_path / f"{value}.toml"
        path.write_text(render_toml({"backend": {"kind": "efa"}, "flags": {"publication": value}}))
        assert load_config(path, env={}).flags.publication == value
