"""Imports run one way. Read from the source: every import, those inside functions included (an import
inside a function is still a dependency); only ``if TYPE_CHECKING:`` blocks, which never run, are left out.

- No two modules import each other, around a loop or directly.
- Packages stand in layers: ``cmd_ring`` (the contract between client and daemon: the record and ring, memfd
  plumbing and the flag file, errors and error codes, the control protocol and its codec) and ``softverbs``
  at the bottom, then ``transportd`` (the daemon, and the base it shares with tools: CUDA driver access,
  logging, the moved modules' old names), then the backends and IBGDA (``ib``, ``efa``, ``ibgda``), the
  client library ``gpuclient`` and the models (``transportd_models``: parts of the daemon and of efa written
  again in Python, which the tests hold the compiled parts to), and the command-line programs
  (``transportd_cli``) on top. A module imports only its own layer or those below.
- The models stand above what they model and nothing that runs in the daemon, a backend or a client imports
  them: of the packages, only the commands do (``transportd bench proxy`` times the engine's model as its
  baseline).
- Inside ``transportd`` the rooms stand in the same way (``ROOMS``): the shared base (logging, CUDA driver
  access, the old names of what moved into the contract), the backend interface and registry, the config (above the
  registry: each backend declares its own table), the control plane, the data plane, operations, and the
  daemon's main process on top. A package's ``__main__`` is an entry point and stands above them all.
- ``import gpuclient``, run, loads none of the daemon's rooms (``DAEMON_ROOMS``): a client stands on the
  contract, not on the daemon's config, backends, data plane or main process.
- The C and CUDA headers obey the same picture (``C_ROOTS``): the contract's include root includes only
  itself; the daemon's core (``transportd/core``) and the device API (``gpuclient/include``) include
  themselves and the contract, never each other; a backend's C (``ib/csrc``, ``efa/csrc``) includes itself,
  the contract and, of the core, only its poster interface and verbs ABI (``C_CORE_INTERFACE``), never the
  other backend; the core includes no backend; no include climbs out of its root with ``../``."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"cmd_ring": 0, "softverbs": 0, "transportd": 1, "ib": 2, "efa": 2, "ibgda": 2, "gpuclient": 3,
          "transportd_models": 3, "transportd_cli": 4}
# The packages that may import the models (transportd_models): the models themselves and the commands.
MODEL_USERS = {"transportd_models", "transportd_cli"}
PACKAGES = tuple(LAYERS)
# transportd's rooms, bottom to top: a module of a room imports only its own room or those below. The base is
# every transportd module outside the named rooms.
ROOMS = {"transportd": 0, "transportd.backends": 1, "transportd.config": 2, "transportd.control": 3,
         "transportd.dataplane": 4, "transportd.ops": 5, "transportd.daemon": 6, "transportd.__main__": 7}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, as dotted names (``from a import b`` gives ``a`` and ``a.b``), but for
    those under ``if TYPE_CHECKING:``, which never run."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in ast.walk(node)}
    here = _module_name(path).split(".")
    base_parts = here if path.name == "__init__.py" else here[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = base_parts[: len(base_parts) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for imp in _imports(path):
            while imp and imp not in modules:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other() -> None:
    assert _cycles(_graph()) == []


def test_packages_import_only_their_own_layer_or_lower() -> None:
    upward = {(module, dep.split(".")[0]) for module, deps in _graph().items() for dep in deps
              if LAYERS[dep.split(".")[0]] > LAYERS[module.split(".")[0]]}
    assert upward == set()


def test_within_a_layer_packages_do_not_import_each_other_back() -> None:
    graph = _graph()
    pkg = {p: {d.split(".")[0] for m, deps in graph.items() if m.split(".")[0] == p for d in deps} - {p}
           for p in PACKAGES}
    same_layer = {p: {d for d in deps if LAYERS[d] == LAYERS[p]} for p, deps in pkg.items()}
    assert _cycles(same_layer) == []


def test_only_the_commands_import_the_models() -> None:
    users = sorted(f"{module} -> {dep}" for module, deps in _graph().items() for dep in deps
                   if dep.split(".")[0] == "transportd_models" and module.split(".")[0] not in MODEL_USERS)
    assert users == []


def _room(module: str) -> str:
    """The longest ROOMS name that is ``module`` or a package above it."""
    parts = module.split(".")
    return next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in ROOMS)


def test_transportd_rooms_import_only_their_own_room_or_lower() -> None:
    upward = sorted(f"{module} -> {dep}" for module, deps in _graph().items() if module.split(".")[0] == "transportd"
                    for dep in deps if dep.split(".")[0] == "transportd" and ROOMS[_room(dep)] > ROOMS[_room(module)])
    assert upward == []


def test_every_transportd_subpackage_is_a_room() -> None:
    subpackages = {f"transportd.{p.parent.name}" for p in (ROOT / "transportd").glob("*/__init__.py")}
    assert subpackages <= set(ROOMS)


# --- what a client process loads ----------------------------------------------------------------------------
# The daemon's rooms a client must never load: each pulls in daemon-only state (the config's backend registry,
# the rail workers' data plane, the main process).
DAEMON_ROOMS = ("transportd.config", "transportd.backends", "transportd.dataplane", "transportd.daemon")


def _daemon_rooms_loaded(statement: str) -> list[str]:
    """The daemon-room modules in ``sys.modules`` after running ``statement`` in a fresh interpreter on this tree
    (what an import really loads, a module's own imports of its imports included)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return [m for m in out.stdout.split() if any(m == room or m.startswith(room + ".") for room in DAEMON_ROOMS)]


def test_importing_gpuclient_loads_no_daemon_room() -> None:
    assert _daemon_rooms_loaded("import gpuclient") == []


def test_the_daemon_room_check_sees_a_daemon_room() -> None:
    assert "transportd.config" in _daemon_rooms_loaded("import transportd.config")


# --- C and CUDA includes ------------------------------------------------------------------------------------
# Each include root and the roots its files may include from. The contract's root is below both sides; the
# device API's and the daemon core's stand beside each other and meet only in the contract. Each backend's C
# stands on the core, and of it sees only what a backend is built against (C_CORE_INTERFACE); the core sees
# no backend, and the backends do not see each other.
C_ROOTS = {"contract": Path("cmd_ring/include"), "client": Path("gpuclient/include"), "daemon": Path("transportd/core"),
           "ib": Path("ib/csrc"), "efa": Path("efa/csrc")}
C_MAY_INCLUDE = {"contract": {"contract"}, "client": {"client", "contract"}, "daemon": {"daemon", "contract"},
                 "ib": {"ib", "contract", "core interface"}, "efa": {"efa", "contract", "core interface"}}
# The core's headers a backend's C may include ("core interface" above): the poster interface and the verbs
# ABI. What they include in turn is the core's own business.
C_CORE_INTERFACE = {"poster.h", "verbs_abi.h"}
C_SUFFIXES = {".h", ".c", ".cuh", ".cu", ".cpp", ".hpp", ".pyx"}
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def _include_problems(root: Path, roots: dict[str, Path] = C_ROOTS) -> tuple[list[str], list[tuple[str, str]]]:
    """``(problems, edges)`` for every ``#include "..."`` and ``#include <...>`` under ``roots`` (paths relative
    to ``root``). An include resolves as a compiler would: a quoted name next to its file first, then each
    root; one found in no root is a system header and left alone. ``edges`` are the (from room, to room) pairs
    found, so a test can tell that the check saw something."""
    bases = {room: (root / rel).resolve() for room, rel in roots.items()}
    problems: list[str] = []
    edges: list[tuple[str, str]] = []
    for room, base in bases.items():
        for path in sorted(p for p in base.rglob("*") if p.suffix in C_SUFFIXES and p.is_file()):
            where = path.relative_to(root).as_posix()
            for quote, name in _INCLUDE.findall(path.read_text(errors="replace")):
                if ".." in Path(name).parts and base not in (path.parent / name).resolve().parents:
                    problems.append(f"{where}: #include {name!r} climbs out of {roots[room].as_posix()}")
                    continue
                candidates = ([path.parent / name] if quote == '"' else []) + [b / name for b in bases.values()]
                found = next((c.resolve() for c in candidates if c.is_file()), None)
                if found is None:
                    continue
                target = next(r for r, b in bases.items() if b in found.parents)
                edges.append((room, target))
                allowed = C_MAY_INCLUDE[room]
                if target == "daemon" and "core interface" in allowed:
                    if found.relative_to(bases[target]).as_posix() not in C_CORE_INTERFACE:
                        problems.append(f"{where}: #include {name!r} reaches the daemon ({roots[target].as_posix()}) "
                                        f"beyond its poster interface and verbs ABI")
                elif target not in allowed:
                    problems.append(f"{where}: #include {name!r} reaches the {target} ({roots[target].as_posix()})")
    return problems, edges


def test_c_includes_run_one_way() -> None:
    problems, edges = _include_problems(ROOT)
    assert problems == []
    assert {("daemon", "contract"), ("client", "contract")} <= set(edges), "both sides include the contract"
    assert {("ib", "daemon"), ("efa", "daemon")} <= set(edges), "each backend's C includes the core's poster interface"


@pytest.mark.parametrize(("where", "line", "message"), [
    ("cmd_ring/include/transportd/cmd_ring.h", '#include "../../../gpuclient/include/transportd/device.cuh"',
     "climbs out"),
    ("cmd_ring/include/transportd/errors.h", "#include <transportd/client.cuh>", "reaches the client"),
    ("transportd/core/validate.h", "#include <transportd/device.cuh>", "reaches the client"),
    ("gpuclient/include/transportd/device.cuh", '#include "../../../transportd/core/validate.h"', "climbs out"),
    ("ib/csrc/ib_post.c", '#include "trace.h"', "beyond its poster interface"),
    ("ib/csrc/ib_post.c", '#include "../../transportd/core/poster.h"', "climbs out"),
    ("ib/csrc/ib_post.c", "#include <transportd/device.cuh>", "reaches the client"),
    ("ib/csrc/ib_post.c", '#include "efa_arrivals.h"', "reaches the efa"),
    ("efa/csrc/efa_post.c", '#include "validate.h"', "beyond its poster interface"),
    ("transportd/core/engine.c", '#include "efa_arrivals.h"', "reaches the efa"),
    ("transportd/core/poster.h", '#include "../../efa/csrc/efa_arrivals.h"', "climbs out"),
])
def test_the_include_check_finds_a_planted_violation(tmp_path: Path, where: str, line: str, message: str) -> None:
    for rel in C_ROOTS.values():
        for path in (ROOT / rel).rglob("*"):
            if path.is_file() and path.suffix in C_SUFFIXES:
                (tmp_path / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / path.relative_to(ROOT)).write_text(path.read_text(errors="replace"))
    planted = tmp_path / where
    planted.write_text(planted.read_text() + line + "\n")
    problems, _ = _include_problems(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(where) and message in problems[0], problems
