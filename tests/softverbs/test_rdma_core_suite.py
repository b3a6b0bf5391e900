"""rdma-core 59's own Python test suite, unmodified, against softverbs (see rdma_core_suite.py beside this file).

The suite comes from the rdma-core tree .ci/build_pyverbs.sh unpacks: ``TRANSPORTD_RDMA_CORE_TREE`` names it,
else it is found from ``TRANSPORTD_PYVERBS_PATH`` (``<tree>/build/python``), else in the build cache. Without
it the test is skipped, unless ``TRANSPORTD_REQUIRE_PYVERBS=1`` (CI) makes that a failure. The suite runs in
child processes (one per soft device); nothing it does reaches this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from tests.softverbs.rdma_core_suite import EXPECTED, compare, load_expected

SUITE = Path(__file__).with_name("rdma_core_suite.py")
REQUIRE = os.environ.get("TRANSPORTD_REQUIRE_PYVERBS", "") == "1"
RDMA_CORE_VERSION = "59.0"

# The two in-scope defects rdma-core's tests found: comp_vector >= num_comp_vectors must be EINVAL (CQ and
# CQEX), and an RC QP from QPInitAttrEx with IBV_QP_INIT_ATTR_CREATE_FLAGS (flags 0) must be created.
MUST_PASS = (
    "test_cq.CQAPITest.test_create_cq_bad_flow",
    "test_cqex.CQEXAPITest.test_create_cq_ex_bad_flow",
    "test_qp.QPTest.test_create_rc_qp_ex_no_attr",
    "test_qp.QPTest.test_create_rc_qp_ex_with_attr",
    "test_device.DeviceTest.test_query_device_ex",
    "test_qpex.QpExTestCase.test_qp_ex_rc_send",
    "test_efa_srd.QPSRDTestCase.test_qp_ex_srd_send",
)


def _tree() -> Path | None:
    candidates = []
    if os.environ.get("TRANSPORTD_RDMA_CORE_TREE"):
        candidates.append(Path(os.environ["TRANSPORTD_RDMA_CORE_TREE"]))
    if os.environ.get("TRANSPORTD_PYVERBS_PATH"):
        candidates.append(Path(os.environ["TRANSPORTD_PYVERBS_PATH"]).resolve().parent.parent)
    cache = Path(os.environ.get("TRANSPORTD_CACHE", "/var/cache/transportd"))
    pyver = sysconfig.get_python_version()
    candidates.append(cache / f"rdma-core-{RDMA_CORE_VERSION}-py{pyver}" / "rdma-core")
    for tree in candidates:
        if (tree / "tests" / "base.py").is_file():
            return tree
    return None


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tree = _tree()
    if tree is None:
        msg = ("no rdma-core tree with tests/ found (set TRANSPORTD_RDMA_CORE_TREE, or build it with "
               ".ci/build_pyverbs.sh and source the env.sh it prints)")
        if REQUIRE:
            pytest.fail(f"TRANSPORTD_REQUIRE_PYVERBS=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    out = tmp_path_factory.mktemp("rdma-core") / "report.json"
    proc = subprocess.run([sys.executable, str(SUITE), "check", "--tree", str(tree), "--report", str(out)],
                          capture_output=True, text=True, timeout=300)
    if not out.is_file():
        pytest.fail(f"the suite wrote no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}",
                    pytrace=False)
    doc = json.loads(out.read_text())
    doc["exit"], doc["output"] = proc.returncode, proc.stdout + proc.stderr
    return doc


@pytest.mark.slow
def test_outcomes_agree_with_the_expected_list(report: dict[str, Any]) -> None:
    assert report["counts"]["run"] > 0
    if report["problems"] or report["exit"] != 0:
        pytest.fail(f"{report['summary']}\n{len(report['problems'])} disagreement(s) with {EXPECTED.name}:\n  "
                    + "\n  ".join(report["problems"]) + f"\n{report['output'][-3000:]}", pytrace=False)
    print(report["summary"])


@pytest.mark.slow
def test_the_defects_rdma_core_found_stay_fixed(report: dict[str, Any]) -> None:
    tests = report["tests"]
    bad = {t: tests.get(t, {"outcome": "did not run"}) for t in MUST_PASS if tests.get(t, {}).get("outcome") != "pass"}
    assert not bad, f"expected to pass: {bad}"
    assert tests["test_cq.CQAPITest.test_create_cq_bad_flow"]["dev"] == "softib0"
    assert tests["test_efa_srd.QPSRDTestCase.test_qp_ex_srd_send"]["dev"] == "softefa0"


def test_expected_list_is_well_formed() -> None:
    expected = load_expected()
    assert not expected.problems
    assert set(expected.run) == {"softib0", "softefa0"}
    assert all(not m.startswith("test_mlx5") for m in expected.run["softib0"] + expected.run["softefa0"])
    assert expected.entries and all(reason for _, reason in expected.entries.values())


def test_compare_flags_every_kind_of_disagreement() -> None:
    expected = load_expected()
    listed_fail = next(t for t, (o, _) in expected.entries.items() if o == ("fail",))
    listed_skip = next(t for t, (o, _) in expected.entries.items() if o == ("skip",))
    tests = {t: {"outcome": "skip" if o[0] == "skip" else "error", "detail": ""}
             for t, (o, _) in expected.entries.items()}
    tests["test_x.X.test_passes"] = {"outcome": "pass", "detail": ""}
    assert compare(expected, tests) == []
    tests[listed_fail] = {"outcome": "pass", "detail": ""}            # passes but is listed
    tests[listed_skip] = {"outcome": "fail", "detail": "boom"}        # listed as skip, fails
    tests["test_x.X.test_new_failure"] = {"outcome": "error", "detail": "E"}  # fails, not listed
    tests["test_x.X.test_new_skip"] = {"outcome": "skip", "detail": "S"}     # skips, not listed
    gone = next(t for t in expected.entries if t not in (listed_fail, listed_skip))
    del tests[gone]                                                   # listed, did not run
    problems = compare(expected, tests)
    assert len(problems) == 5
    assert any(p.startswith(f"{listed_fail}: passes but is listed") for p in problems)
    assert any(p.startswith(f"{listed_skip}: fails but is listed as expected to skip") for p in problems)
    assert any(p.startswith("test_x.X.test_new_failure: fails but is not in") for p in problems)
    assert any(p.startswith("test_x.X.test_new_skip: skips but is not in") for p in problems)
    assert any(p.startswith(f"{gone}: listed in") for p in problems)


def test_rdma_stand_in_answers_link_show_only() -> None:
    shown = subprocess.run([sys.executable, str(SUITE), "rdma", "link", "show", "-j"], capture_output=True,
                           text=True, timeout=60, check=True)
    links = json.loads(shown.stdout)
    assert {(link["ifname"], link["port"], link["state"]) for link in links} >= {
        ("softib0", 1, "ACTIVE"), ("softefa0", 1, "ACTIVE")}
    assert all("netdev" not in link for link in links)  # no net interface is claimed
    for argv in (["dev", "show", "-j"], ["link", "show"], ["link", "set", "softib0", "down", "-j"]):
        refused = subprocess.run([sys.executable, str(SUITE), "rdma", *argv], capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 2 and "answers only" in refused.stderr, argv
