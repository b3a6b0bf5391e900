"""Run rdma-core's own Python test suite, unmodified, against softverbs (in a child process of its own).

    python tests/softverbs/rdma_core_suite.py check --tree RDMA_CORE [--report report.json]
    python tests/softverbs/rdma_core_suite.py run --tree RDMA_CORE --dev softib0 --out results.json MODULE...
    python tests/softverbs/rdma_core_suite.py rdma link show -j

``check`` runs the modules that ``rdma_core_expected.toml`` (beside this file) names for each device, one
child process per device, and compares every outcome with that list: a test that does not pass must be listed
with its outcome and a reason, and a listed test must not pass. It prints the counts (run / pass / expected
skip / expected fail) and each disagreement, and exits 1 on any.

``run`` imports the named modules of ``RDMA_CORE/tests`` (``test_cq``, ``test_qp``, ...) with every
``pyverbs`` import resolved to softverbs: ``pyverbs.X`` is a module holding ``softverbs.X``'s names. What
softverbs does not mirror (a whole module such as ``pyverbs.srq``, or one name such as an enum it lacks)
resolves to an *absent* placeholder that imports fine but raises :class:`NotMirroredError` when used, so a
test of a feature outside softverbs' subset fails with a message naming it instead of breaking the import of
its whole module. Nothing is turned into a skip here: skips are rdma-core's own decisions.

The tests run on the device given by ``--dev`` (rdma-core's ``--dev`` option), and each one's outcome
(``pass``, ``skip``, ``fail`` or ``error``, with a one-line detail) is written to ``--out`` as JSON.

rdma-core's traffic set-up lists the links with ``rdma link show -j``. ``run`` puts a directory first on its
own PATH whose ``rdma`` runs this file's ``rdma`` command, which answers exactly that query from softverbs'
device list (the soft devices, port 1, no netdev) and refuses anything else. Nothing outside this process
tree sees it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
import types
import unittest
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXPECTED", "Expected", "NotMirroredError", "check", "compare", "load_expected", "main"]

PREFIX = "pyverbs"
TARGET = "softverbs"
EXPECTED = Path(__file__).with_name("rdma_core_expected.toml")
OUTCOMES = ("pass", "skip", "fail")
RUN_TIMEOUT_S = 240.0


class NotMirroredError(NotImplementedError):
    """A pyverbs name that softverbs does not mirror was used."""


# --- placeholders for what softverbs does not mirror ----------------------------------------------------

class _AbsentMeta(type):
    """The type of an absent name: importable, subclassable, attribute access yields more absent names;
    calling it (or comparing it with anything but itself) raises NotMirroredError."""

    _qualname: str

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return absent(f"{cls._qualname}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.__dict__.get("_absent_root", False):
            raise NotMirroredError(f"softverbs does not mirror {cls._qualname}")
        return super().__call__(*args, **kwargs)  # a real subclass defined by a test module

    def _refuse(cls, *args: Any) -> Any:
        raise NotMirroredError(f"softverbs does not mirror {cls._qualname}")

    __or__ = __ror__ = __and__ = __rand__ = __xor__ = __invert__ = _refuse
    __int__ = __index__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse

    def __eq__(cls, other: object) -> bool:
        return cls is other

    def __hash__(cls) -> int:
        return id(cls)

    def __bool__(cls) -> bool:
        return True


def absent(qualname: str) -> type:
    """A placeholder class standing for the pyverbs name ``qualname``."""
    cls = _AbsentMeta(qualname.rpartition(".")[2], (), {"_absent_root": True, "__module__": PREFIX})
    cls._qualname = qualname
    return cls


def _instance_init(self: Any, *args: Any, **kwargs: Any) -> None:
    raise NotMirroredError(f"softverbs does not mirror a base class of {type(self).__name__}")


def _mirror_module(name: str) -> types.ModuleType:
    """``pyverbs.X`` as a module holding ``softverbs.X``'s names, absent placeholders for the rest."""
    target = TARGET + name[len(PREFIX):]
    mod = types.ModuleType(name)
    source: types.ModuleType | None = None
    try:
        if importlib.util.find_spec(target) is not None:
            source = importlib.import_module(target)
    except ImportError:
        source = None
    if source is not None:
        mod.__dict__.update({k: v for k, v in vars(source).items() if not k.startswith("__")})
        mod.__doc__ = source.__doc__
        if hasattr(source, "__path__"):
            mod.__path__ = []  # a package: its submodules come through the finder too
    else:
        mod.__path__ = []  # an absent module may still have absent submodules
    mod.__dict__["_softverbs_source"] = source

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = absent(f"{name}.{attr}")
        setattr(mod, attr, value)
        return value

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _mirror_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class PyverbsToSoftverbs(importlib.abc.MetaPathFinder):
    """Resolves ``pyverbs`` and ``pyverbs.*`` to softverbs (first on sys.meta_path: real pyverbs never loads)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)


def install_finder() -> None:
    for name in [m for m in sys.modules if m == PREFIX or m.startswith(PREFIX + ".")]:
        del sys.modules[name]
    sys.meta_path.insert(0, PyverbsToSoftverbs())


# --- the `rdma link show -j` answer -------------------------------------------------------------------

def rdma_command(argv: Sequence[str]) -> int:
    """``rdma link show -j`` for softverbs' devices; any other rdma command is refused."""
    words = [a for a in argv if a not in ("-j", "-json", "--json")]
    if list(words) not in (["link", "show"], ["link"], ["l", "show"], ["link", "s"]) or len(words) == len(argv):
        print(f"softverbs' rdma stand-in answers only 'rdma link show -j' (got: rdma {shlex.join(argv)})",
              file=sys.stderr)
        return 2
    from softverbs import device as d
    from softverbs import libibverbs_enums as e

    links = []
    for dev in d.get_device_list():
        name = dev.name.decode()
        with d.Context(name=name) as ctx:
            port = ctx.query_port(1)
        active = port.state == e.IBV_PORT_ACTIVE
        links.append({"ifindex": dev.index, "ifname": name, "port": 1,
                      "state": "ACTIVE" if active else "DOWN",
                      "physical_state": "LINK_UP" if port.phys_state == 5 else "DISABLED"})
    print(json.dumps(links))
    return 0


def _rdma_stand_in(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    script = bin_dir / "rdma"
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))}"
                      f" rdma \"$@\"\n")
    script.chmod(0o755)
    return bin_dir


# --- running the suite -------------------------------------------------------------------------------

def _one_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= limit else last[: limit - 3] + "..."


class _Recorder(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._t0 = 0.0

    def _put(self, test: unittest.TestCase, outcome: str, detail: str) -> None:
        tid = test.id().removeprefix("tests.")
        prev = self.outcomes.get(tid)
        if prev is not None and prev["outcome"] in ("fail", "error"):
            return  # a tearDown error after a failure: keep the first cause
        self.outcomes[tid] = {"outcome": outcome, "detail": detail,
                              "seconds": round(time.monotonic() - self._t0, 3)}

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._t0 = time.monotonic()

    def addSuccess(self, test: unittest.TestCase) -> None:
        self._put(test, "pass", "")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._put(test, "skip", _one_line(str(reason)))

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._put(test, "fail", _one_line("".join(traceback.format_exception_only(err[0], err[1]))))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._put(test, "error", _one_line("".join(traceback.format_exception_only(err[0], err[1]))))

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._put(test, "pass", "expected failure (rdma-core's own marking)")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self._put(test, "fail", "unexpected success")

    def addSubTest(self, test: unittest.TestCase, subtest: unittest.TestCase, err: Any) -> None:
        if err is not None:
            kind = "fail" if issubclass(err[0], test.failureException) else "error"
            self._put(test, kind, _one_line("".join(traceback.format_exception_only(err[0], err[1]))))


def run(tree: Path, dev: str, modules: Sequence[str], out: Path) -> int:
    tests_dir = tree / "tests"
    if not (tests_dir / "base.py").is_file():
        print(f"{tests_dir} holds no rdma-core test suite (no base.py)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="rdma-core-suite-"))
    os.environ["PATH"] = f"{_rdma_stand_in(tmp)}{os.pathsep}{os.environ.get('PATH', '')}"
    install_finder()
    sys.path.insert(0, str(tests_dir))  # rdma-core's modules import `args_parser` at top level
    # The `tests` package without its __init__, which imports every module (mlx5's included) up front.
    pkg = types.ModuleType("tests")
    pkg.__path__ = [str(tests_dir)]
    sys.modules["tests"] = pkg
    from args_parser import parser  # rdma-core's own option parser

    saved, sys.argv = sys.argv, [str(tests_dir / "run_tests.py"), "--dev", dev]
    try:
        parser.parse_args()
    finally:
        sys.argv = saved

    result = _Recorder()
    loader = unittest.TestLoader()
    # tests.utils and tests.efa_base import each other; entered through utils (as rdma-core's own package
    # import does, test_addr first) the cycle resolves.
    importlib.import_module("tests.utils")
    for name in modules:
        try:
            mod = importlib.import_module(f"tests.{name}")
        except Exception as exc:  # a module that does not even import: one entry for the module
            result.outcomes[f"{name}"] = {"outcome": "error", "seconds": 0.0,
                                          "detail": f"import: {_one_line(traceback.format_exception_only(exc)[-1])}"}
            continue
        loader.loadTestsFromModule(mod).run(result)
    foreign = sorted(m for m, mod in sys.modules.items()
                     if (m == PREFIX or m.startswith(PREFIX + ".")) and "_softverbs_source" not in vars(mod))
    doc = {"dev": dev, "tree": str(tree), "modules": list(modules), "tests": result.outcomes,
           "foreign_pyverbs": foreign}
    out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    return 0


# --- checking the outcomes against the expected list ----------------------------------------------------

class Expected:
    """rdma_core_expected.toml: the modules to run per device, and each non-passing test's outcome(s) and why."""

    def __init__(self, path: Path = EXPECTED) -> None:
        doc = tomllib.loads(path.read_text())
        self.path = path
        self.run: dict[str, list[str]] = {dev: list(mods) for dev, mods in doc["run"].items()}
        self.entries: dict[str, tuple[tuple[str, ...], str]] = {}
        self.problems: list[str] = []
        for i, group in enumerate(doc.get("expected", [])):
            outcome = group.get("outcome")
            outcomes = tuple(outcome) if isinstance(outcome, list) else (outcome,)
            reason = str(group.get("reason", "")).strip()
            if not reason:
                self.problems.append(f"{path.name}: expected group #{i + 1} has no reason")
            if not outcomes or any(o not in ("skip", "fail") for o in outcomes):
                self.problems.append(f"{path.name}: expected group #{i + 1} ({reason!r}): outcome must be "
                                     f"'skip', 'fail' or a list of them, not {outcome!r}")
            for test in group.get("tests", []):
                if test in self.entries:
                    self.problems.append(f"{path.name}: {test} is listed twice")
                self.entries[test] = (outcomes, reason)


def load_expected(path: Path = EXPECTED) -> Expected:
    return Expected(path)


def _outcome(raw: str) -> str:
    return "fail" if raw == "error" else raw  # an error is a failure here


def compare(expected: Expected, tests: dict[str, dict[str, Any]]) -> list[str]:
    """Every disagreement between the outcomes and the expected list (empty: they agree)."""
    problems = list(expected.problems)
    for test, result in sorted(tests.items()):
        got = _outcome(result["outcome"])
        entry = expected.entries.get(test)
        detail = f" ({result['detail']})" if result.get("detail") else ""
        if entry is None:
            if got != "pass":
                problems.append(f"{test}: {got}s but is not in {expected.path.name}{detail}")
            continue
        outcomes, reason = entry
        if got == "pass":
            problems.append(f"{test}: passes but is listed as expected to {'/'.join(outcomes)} "
                            f"({reason}): take it off the list")
        elif got not in outcomes:
            problems.append(f"{test}: {got}s but is listed as expected to {'/'.join(outcomes)}{detail}")
    for test in sorted(set(expected.entries) - set(tests)):
        problems.append(f"{test}: listed in {expected.path.name} but did not run")
    return problems


def counts(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    c = {"run": len(tests), **dict.fromkeys(OUTCOMES, 0)}
    for result in tests.values():
        c[_outcome(result["outcome"])] += 1
    return c


def check(tree: Path, expected: Expected, report: Path | None = None) -> int:
    """Run every device's modules in a child process each (concurrently), then compare; 0 when all agree."""
    tmp = Path(tempfile.mkdtemp(prefix="rdma-core-check-"))
    env = dict(os.environ)
    children = {}
    t0 = time.monotonic()
    for dev, modules in expected.run.items():
        out = tmp / f"{dev}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "run", "--tree", str(tree), "--dev", dev,
               "--out", str(out), *modules]
        log = (tmp / f"{dev}.log").open("w")
        children[dev] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp), out, log)
    tests: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    foreign: list[str] = []
    for dev, (proc, out, log) in children.items():
        try:
            rc = proc.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        log.close()
        tail = (tmp / f"{dev}.log").read_text()[-2000:]
        if rc != 0 or not out.is_file():
            why = f"timed out after {RUN_TIMEOUT_S:.0f} s" if rc is None else f"exited with {rc}"
            problems.append(f"the {dev} run {why}; its output ends:\n{tail}")
            continue
        doc = json.loads(out.read_text())
        foreign += doc["foreign_pyverbs"]
        for test, result in doc["tests"].items():
            tests[test] = {**result, "dev": dev}
    if foreign:
        problems.append(f"real pyverbs modules were loaded instead of softverbs: {', '.join(foreign)}")
    problems += compare(expected, tests) if not problems else []
    c = counts(tests)
    summary = (f"rdma-core suite on softverbs: run {c['run']} / pass {c['pass']} / expected skip {c['skip']} / "
               f"expected fail {c['fail']} ({time.monotonic() - t0:.1f} s)")
    print(summary)
    for p in problems:
        print(f"  {p}")
    if report is not None:
        report.write_text(json.dumps({"counts": c, "problems": problems, "tests": tests, "summary": summary},
                                     indent=1, sort_keys=True))
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rdma"]:
        return rdma_command(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run rdma-core test modules against softverbs")
    r.add_argument("--tree", type=Path, required=True, help="the rdma-core source tree (holding tests/)")
    r.add_argument("--dev", required=True, help="soft device to run on (softib0, softefa0)")
    r.add_argument("--out", type=Path, required=True, help="where to write the outcomes (JSON)")
    r.add_argument("modules", nargs="+", help="rdma-core test modules, e.g. test_cq")
    c = sub.add_parser("check", help="run the expected list's modules and compare with it")
    c.add_argument("--tree", type=Path, required=True, help="the rdma-core source tree (holding tests/)")
    c.add_argument("--expected", type=Path, default=EXPECTED, help="the expected list (TOML)")
    c.add_argument("--report", type=Path, help="write the counts, problems and outcomes here (JSON)")
    a = p.parse_args(argv)
    if a.cmd == "check":
        return check(a.tree, load_expected(a.expected), a.report)
    return run(a.tree, a.dev, a.modules, a.out)


if __name__ == "__main__":
    sys.exit(main())
