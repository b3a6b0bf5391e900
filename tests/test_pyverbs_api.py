"""API agreement: everything softverbs hands out exists in real pyverbs (rdma-core 59) with the same meaning.

Driven by softverbs itself, not by a hand list: every public softverbs module (``softverbs.soft`` and
``_private`` modules aside) must exist at the same path under ``pyverbs``, and for every name in its
``__all__`` (``soft_*`` names aside):

- the name exists in the pyverbs module;
- ints (enum members included) have the same value, enum members belong to an enum of the same name;
- enum classes: the same kind (pyverbs' Cython enums are ``IntFlag``), every member with the same value;
- classes: every public attribute softverbs defines on the class or its softverbs bases (methods,
  properties, ``__slots__`` fields, ``self.x = ...`` assignments, class constants) exists on the pyverbs
  class, a method as something callable and a field as a data descriptor; exceptions stay exceptions, and
  a subclass relation between mirrored classes holds in pyverbs too;
- functions, methods and constructors: code written against softverbs' signature must run on pyverbs',
  i.e. the same positional order, no softverbs-only parameter, no parameter optional in softverbs that
  pyverbs requires, and equal defaults. pyverbs' constructors are Cython ``__init__`` slots without a
  signature, so theirs are read from the ``.pyx`` sources that sit beside an rdma-core build.

It also checks that ``transportd.backends.verbs.load("pyverbs")`` hands out the real modules.

pyverbs must import (rdma-core 59's libraries included); without it the tests are skipped, unless
``TRANSPORTD_REQUIRE_PYVERBS=1`` (CI) makes that a failure. Build it with ``.ci/build_pyverbs.sh``, then
either source the ``env.sh`` it names or set ``TRANSPORTD_PYVERBS_PATH`` to its ``build/python``.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import textwrap
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

softverbs = pytest.importorskip("softverbs", reason="softverbs is not importable")

REQUIRE = os.environ.get("TRANSPORTD_REQUIRE_PYVERBS", "") == "1"
BUILD_HINT = ("build it with .ci/build_pyverbs.sh and source the env.sh it prints, or set "
              "TRANSPORTD_PYVERBS_PATH to its build/python")
UNKNOWN = object()  # a default we could not evaluate


def _is_public(name: str) -> bool:
    return not name.startswith("_") and not name.startswith("soft_")


# --- which softverbs modules mirror pyverbs --------------------------------------------------------------

def _mirrored_module_paths() -> list[str]:
    """Dotted paths under softverbs (e.g. "qp", "providers.efa.efadv") that must exist under pyverbs."""
    paths = []
    for info in pkgutil.walk_packages(softverbs.__path__, prefix="softverbs."):
        rel = info.name.removeprefix("softverbs.")
        parts = rel.split(".")
        if parts[0] == "soft" or not all(_is_public(p) for p in parts):
            continue
        paths.append(rel)
    return sorted(paths)


MODULE_PATHS = _mirrored_module_paths()

# The layout the project promises (docs/design.md, "softverbs mirrors pyverbs"); the generic walk above finds
# anything added later.
PROMISED_MODULES = ("device", "pd", "mr", "cq", "qp", "wr", "addr", "libibverbs_enums", "pyverbs_error",
                    "providers.efa.efadv")


# --- importing pyverbs --------------------------------------------------------------------------------

def _try_import_pyverbs() -> str | None:
    """None when pyverbs (with its libraries) imports, else why not."""
    def attempt() -> str | None:
        try:
            importlib.import_module("pyverbs.device")
            importlib.import_module("pyverbs.libibverbs_enums")
        except ImportError as exc:  # a missing libibverbs 59 symbol is an ImportError too
            return f"{type(exc).__name__}: {exc}"
        return None

    why = attempt()
    extra = os.environ.get("TRANSPORTD_PYVERBS_PATH", "")
    if why is not None and extra and extra not in sys.path:
        sys.path.insert(0, extra)
        for name in [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]:
            del sys.modules[name]
        why = attempt()
    return why


@pytest.fixture(scope="module")
def pyverbs() -> ModuleType:
    why = _try_import_pyverbs()
    if why is not None:
        msg = f"real pyverbs is not importable ({why}); {BUILD_HINT}"
        if REQUIRE:
            pytest.fail(f"TRANSPORTD_REQUIRE_PYVERBS=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    return importlib.import_module("pyverbs")


# --- describing objects ---------------------------------------------------------------------------------

def _int_of(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return int(value)


def _fmt(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}={int(value)}" if isinstance(value, int) else repr(value)
    return repr(value)


def _same_value(a: Any, b: Any) -> bool:
    ia, ib = _int_of(a), _int_of(b)
    if ia is not None or ib is not None:
        return ia == ib
    try:
        return bool(a == b)
    except Exception:  # an object without a sensible ==; nothing to compare
        return True


def _raw_attr(cls: type, name: str) -> Any:
    """The attribute as stored on the class (or a base), without running descriptors."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return getattr(cls, name)


def _kind(raw: Any) -> str:
    if isinstance(raw, (staticmethod, classmethod)):
        return "method"
    if isinstance(raw, type):
        return "class"
    if inspect.isdatadescriptor(raw):
        return "field"
    if callable(raw) or inspect.ismethoddescriptor(raw):
        return "method"
    return "constant"


def _self_assignments(cls: type) -> set[str]:
    """Public names a softverbs class assigns as ``self.<name> = ...`` in its own methods."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            for t in elts:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and _is_public(t.attr)):
                    names.add(t.attr)
    return names


def _softverbs_members(cls: type) -> dict[str, Any]:
    """Public attributes softverbs itself defines on ``cls`` and its softverbs bases (first one in MRO wins)."""
    members: dict[str, Any] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("softverbs"):
            continue
        for name, raw in vars(klass).items():
            if _is_public(name) and name not in members:
                members[name] = raw
        for name in _self_assignments(klass):
            members.setdefault(name, _INSTANCE_FIELD)
    return members


_INSTANCE_FIELD = property(lambda self: None)  # stands for a plain instance attribute


# --- signatures -----------------------------------------------------------------------------------------

class _Param:
    __slots__ = ("name", "kind", "default")

    def __init__(self, name: str, kind: inspect._ParameterKind, default: Any) -> None:
        self.name, self.kind, self.default = name, kind, default

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty and self.kind not in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _params_of(func: Any, drop_self: bool) -> list[_Param] | None:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    params = [_Param(p.name, p.kind, p.default) for p in sig.parameters.values()]
    return params[1:] if drop_self and params else params


def _split_top_level(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


@cache
def _pyx_source(module_name: str) -> tuple[str, dict[str, Any]] | None:
    """The .pyx text of a pyverbs module and a namespace to evaluate its defaults in."""
    mod = sys.modules.get(module_name) or importlib.import_module(module_name)
    pkg_dir = Path(importlib.import_module("pyverbs").__file__).resolve().parent  # build/python links here
    rel = module_name.split(".")[1:]
    pyx = pkg_dir.joinpath(*rel).with_suffix(".pyx")
    if not pyx.is_file():
        return None
    text = pyx.read_text()
    ns: dict[str, Any] = dict(vars(mod))
    for target, alias in re.findall(r"^\s*c?import\s+([\w.]+)\s+as\s+(\w+)", text, re.M):
        try:
            ns[alias] = importlib.import_module(target)
        except ImportError:
            pass
    return text, ns


def _pyx_init_params(cls: type) -> list[_Param] | None:
    """Constructor parameters of a Cython class from its .pyx (``__init__``, else ``__cinit__``)."""
    for klass in cls.__mro__:
        if klass is object:
            return []
        src = _pyx_source(klass.__module__)
        if src is None:
            return None
        text, ns = src
        m = re.search(rf"^(?:cdef\s+)?class\s+{klass.__name__}\b.*?:\s*$", text, re.M)
        if m is None:
            return None
        body_end = re.compile(r"^\S", re.M).search(text, m.end())
        body = text[m.end(): body_end.start() if body_end else len(text)]
        for method in ("__init__", "__cinit__"):
            d = re.search(rf"^    def {method}\(", body, re.M)
            if d is None:
                continue
            depth, i = 1, d.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(body[i], 0)
                i += 1
            return _parse_pyx_params(body[d.end(): i - 1], ns)[1:]
    return None


def _parse_pyx_params(text: str, ns: dict[str, Any]) -> list[_Param]:
    params = []
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for piece in _split_top_level(text):
        decl, _, default_text = piece.partition("=")
        decl = re.sub(r"\bnot\s+None\b|\bor\s+None\b", "", decl).strip()
        if decl == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name = re.findall(r"\**\w+", decl)[-1]
        if name.startswith("**"):
            params.append(_Param(name[2:], inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
            continue
        if name.startswith("*"):
            params.append(_Param(name[1:], inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        default: Any = inspect.Parameter.empty
        if default_text.strip():
            try:
                default = eval(default_text.strip(), dict(ns))  # pyverbs' own source text
            except Exception:
                default = UNKNOWN
        params.append(_Param(name, kind, default))
    return params


def _constructor_params(cls: type, is_softverbs: bool) -> list[_Param] | None:
    if is_softverbs:
        return _params_of(cls.__init__, drop_self=True)
    for klass in cls.__mro__:  # a Python class of pyverbs (pyverbs_error) with an inherited __init__
        init = vars(klass).get("__init__")
        if inspect.isfunction(init):
            return _params_of(init, drop_self=True)
        if klass.__module__.startswith("pyverbs"):
            break
    return _pyx_init_params(cls)


def _compare_params(where: str, sv: list[_Param], pv: list[_Param]) -> list[str]:
    problems = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    pv_pos = [p.name for p in pv if p.kind in positional]
    pv_by_name = {p.name: p for p in pv if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                         inspect.Parameter.VAR_KEYWORD)}
    pv_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in pv)
    for i, sp in enumerate(sv):
        if sp.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if not _is_public(sp.name):
            if sp.required:
                problems.append(f"{where}: softverbs-only parameter {sp.name!r} is required")
            continue
        pp = pv_by_name.get(sp.name)
        if pp is None:
            if not pv_varkw:
                problems.append(f"{where}: parameter {sp.name!r} does not exist in pyverbs "
                                f"(pyverbs: ({', '.join(p.name for p in pv)}))")
            continue
        if sp.kind in positional and (i >= len(pv_pos) or pv_pos[i] != sp.name):
            j = pv_pos.index(sp.name) if sp.name in pv_pos else None
            problems.append(f"{where}: parameter {sp.name!r} is positional #{i} in softverbs but "
                            f"{'keyword-only' if j is None else f'#{j}'} in pyverbs")
        if not sp.required and pp.required:
            problems.append(f"{where}: parameter {sp.name!r} has a default in softverbs but pyverbs requires it")
        elif (not sp.required and pp.default not in (inspect.Parameter.empty, UNKNOWN)
              and not _same_value(sp.default, pp.default)):
            problems.append(f"{where}: default of {sp.name!r} is {_fmt(sp.default)} in softverbs, "
                            f"{_fmt(pp.default)} in pyverbs")
    sv_names = {p.name for p in sv}
    for pp in pv:
        if pp.required and pp.name not in sv_names:
            problems.append(f"{where}: pyverbs requires parameter {pp.name!r}, which softverbs does not take")
    return problems


def _compare_callable(where: str, s_func: Any, p_func: Any, drop_self: bool) -> list[str]:
    sv = _params_of(s_func, drop_self)
    pv = _params_of(p_func, drop_self)
    if sv is None or pv is None:
        return []
    return _compare_params(where, sv, pv)


# --- comparing objects ----------------------------------------------------------------------------------

@cache
def _counterparts() -> dict[int, tuple[str, Any]]:
    """id(softverbs class) -> (its dotted name, the pyverbs class of the same path), for all exported classes."""
    out = {}
    for path in MODULE_PATHS:
        smod = importlib.import_module(f"softverbs.{path}")
        try:
            pmod = importlib.import_module(f"pyverbs.{path}")
        except ImportError:
            continue
        for name in getattr(smod, "__all__", ()):
            obj = getattr(smod, name, None)
            if isinstance(obj, type) and hasattr(pmod, name):
                out.setdefault(id(obj), (f"softverbs.{path}.{name}", getattr(pmod, name)))
    return out


def _compare_enum(where: str, s: type[enum.Enum], p: Any) -> list[str]:
    if not (isinstance(p, type) and issubclass(p, enum.Enum)):
        return [f"{where}: is an enum in softverbs, {p!r} in pyverbs"]
    problems = []
    if issubclass(s, enum.Flag) != issubclass(p, enum.Flag):
        problems.append(f"{where}: enum kind differs: softverbs {s.__mro__[1].__name__}, "
                        f"pyverbs {p.__mro__[1].__name__}")
    for name, member in s.__members__.items():
        if not hasattr(p, name):
            problems.append(f"{where}.{name}: missing in pyverbs")
        elif not _same_value(member.value, getattr(p, name)):
            problems.append(f"{where}.{name}: value {_fmt(member.value)} in softverbs, "
                            f"{_fmt(getattr(p, name))} in pyverbs")
    return problems


def _compare_class(where: str, s: type, p: Any) -> list[str]:
    if not isinstance(p, type):
        return [f"{where}: is a class in softverbs, {p!r} in pyverbs"]
    problems = []
    if issubclass(s, BaseException) != issubclass(p, BaseException):
        problems.append(f"{where}: exception in one provider only")
    for base in s.__mro__[1:]:
        counterpart = _counterparts().get(id(base))
        if counterpart is not None and not issubclass(p, counterpart[1]):
            problems.append(f"{where}: subclasses {counterpart[0]} in softverbs, but the pyverbs class "
                            f"does not subclass {counterpart[1].__module__}.{counterpart[1].__name__}")
    s_init, p_init = _constructor_params(s, True), _constructor_params(p, False)
    if s_init is not None and p_init is not None:
        problems += _compare_params(f"{where}()", s_init, p_init)
    for name, raw in sorted(_softverbs_members(s).items()):
        member = f"{where}.{name}"
        if not hasattr(p, name):
            problems.append(f"{member}: missing in pyverbs ({p.__module__}.{p.__name__} has no {name!r})")
            continue
        p_raw = _raw_attr(p, name)
        s_kind, p_kind = _kind(raw), _kind(p_raw)
        if s_kind != p_kind and not (s_kind == "constant" and p_kind == "field"):
            problems.append(f"{member}: a {s_kind} in softverbs but a {p_kind} in pyverbs")
            continue
        if s_kind == "method":
            s_func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            p_func = p_raw.__func__ if isinstance(p_raw, (staticmethod, classmethod)) else p_raw
            drop = not isinstance(raw, staticmethod)
            problems += _compare_callable(f"{member}()", s_func, p_func, drop)
        elif s_kind == "constant" and p_kind == "constant" and not _same_value(raw, p_raw):
            problems.append(f"{member}: {_fmt(raw)} in softverbs, {_fmt(p_raw)} in pyverbs")
        elif s_kind == "class":
            problems += _compare_object(member, raw, p_raw)
    return problems


def _compare_object(where: str, s: Any, p: Any) -> list[str]:
    if isinstance(s, type) and issubclass(s, enum.Enum):
        return _compare_enum(where, s, p)
    if isinstance(s, type):
        return _compare_class(where, s, p)
    if _int_of(s) is not None:
        problems = []
        if _int_of(p) is None or int(s) != int(p):
            problems.append(f"{where}: {_fmt(s)} in softverbs, {_fmt(p)} in pyverbs")
        if isinstance(s, enum.Enum) and type(s).__name__ != type(p).__name__:
            problems.append(f"{where}: member of {type(s).__name__} in softverbs, of {type(p).__name__} "
                            f"in pyverbs")
        return problems
    if isinstance(s, ModuleType):
        return []
    if callable(s):
        if not callable(p):
            return [f"{where}: callable in softverbs, {p!r} in pyverbs"]
        return _compare_callable(f"{where}()", s, p, drop_self=False)
    if isinstance(s, (str, bytes, float)) and not _same_value(s, p):
        return [f"{where}: {s!r} in softverbs, {p!r} in pyverbs"]
    return []


# --- tests ----------------------------------------------------------------------------------------------

def test_softverbs_has_the_promised_layout() -> None:
    missing = [p for p in PROMISED_MODULES if p not in MODULE_PATHS]
    assert not missing, f"softverbs lacks modules {', '.join('softverbs.' + p for p in missing)}"


@pytest.mark.parametrize("path", MODULE_PATHS)
def test_module_agrees_with_pyverbs(pyverbs: ModuleType, path: str) -> None:
    smod = importlib.import_module(f"softverbs.{path}")
    try:
        pmod = importlib.import_module(f"pyverbs.{path}")
    except ImportError as exc:
        pytest.fail(f"softverbs.{path}: pyverbs has no module pyverbs.{path} ({exc})", pytrace=False)
    is_package = hasattr(smod, "__path__")
    if not hasattr(smod, "__all__"):
        if is_package:
            return  # a package only groups modules; they are checked on their own
        pytest.fail(f"softverbs.{path} has no __all__ (the mirrored names must be listed)", pytrace=False)
    problems = []
    for name in smod.__all__:
        if not _is_public(name):
            continue
        where = f"softverbs.{path}.{name}"
        if not hasattr(smod, name):
            problems.append(f"{where}: listed in __all__ but not defined")
        elif not hasattr(pmod, name):
            problems.append(f"{where}: missing in pyverbs (pyverbs.{path} has no {name!r})")
        else:
            problems += _compare_object(where, getattr(smod, name), getattr(pmod, name))
    if problems:
        pytest.fail(f"{len(problems)} disagreement(s) with pyverbs:\n  " + "\n  ".join(problems), pytrace=False)


def test_load_pyverbs_returns_the_real_modules(pyverbs: ModuleType) -> None:
    from transportd.backends import verbs

    real = verbs.load("pyverbs")
    soft = verbs.load("soft")
    problems = []
    for name in sorted(n for n in dir(soft) if _is_public(n)):
        s_val = getattr(soft, name)
        p_val = getattr(real, name, None)
        if not isinstance(s_val, ModuleType) or s_val.__name__ == "softverbs.soft":
            continue
        expected = importlib.import_module(s_val.__name__.replace("softverbs", "pyverbs", 1))
        if p_val is not expected:
            problems.append(f"load('pyverbs').{name} is {p_val!r}, expected {expected!r}")
    for name in sorted(n for n in dir(real) if _is_public(n)):
        val = getattr(real, name)
        if isinstance(val, ModuleType) and not val.__name__.startswith("pyverbs"):
            problems.append(f"load('pyverbs').{name} is {val.__name__}, not a pyverbs module")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


# --- the other direction: what the backends use exists in both providers ---------------------------------

BACKEND_SOURCES = ("ib", "efa", "ibgda", "transportd/backends/verbs_common.py")
REPO = Path(__file__).resolve().parent.parent
# VerbsModules' attribute names -> the module path under softverbs / pyverbs
VERBS_MODULES = {"device": "device", "pd": "pd", "mr": "mr", "cq": "cq", "qp": "qp", "wr": "wr", "addr": "addr",
                 "libibverbs_enums": "libibverbs_enums", "enums": "libibverbs_enums",
                 "pyverbs_error": "pyverbs_error", "error": "pyverbs_error", "efadv": "providers.efa.efadv",
                 "efa_enums": "providers.efa.efa_enums"}


def _backend_files() -> list[Path]:
    files: list[Path] = []
    for rel in BACKEND_SOURCES:
        path = REPO / rel
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _is_verbs_namespace(node: ast.expr) -> bool:
    """``v``, ``self.v``, ``rail.v``, ``verbs``: the namespace transportd.backends.verbs.load() returns."""
    if isinstance(node, ast.Name):
        return node.id in ("v", "verbs")
    return isinstance(node, ast.Attribute) and node.attr == "v"


@cache
def _backend_usage() -> tuple[dict[tuple[str, str], list[str]], dict[str, list[str]]]:
    """(module path, name) -> where the backends reference ``v.<module>.<name>`` (aliases such as
    ``e = v.libibverbs_enums`` followed), and attribute name -> where it is read on any object (less the
    names the backends assign on their own objects, such as ``self.cq``: reads of those are theirs)."""
    names: dict[tuple[str, str], list[str]] = {}
    attrs: dict[str, list[str]] = {}
    own: set[str] = set()  # attribute names the backends assign on their own objects (self.cq = ...)
    for path in _backend_files():
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(REPO)
        aliases: dict[str, str] = {}  # local name -> module path
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
                    and node.value.attr in VERBS_MODULES and _is_verbs_namespace(node.value.value)):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        aliases[target.id] = VERBS_MODULES[node.value.attr]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            where = f"{rel}:{node.lineno}"
            if isinstance(node.ctx, ast.Load):
                attrs.setdefault(node.attr, []).append(where)
            else:
                own.add(node.attr)
            base = node.value
            module = None
            if isinstance(base, ast.Attribute) and base.attr in VERBS_MODULES and _is_verbs_namespace(base.value):
                module = VERBS_MODULES[base.attr]
            elif isinstance(base, ast.Name) and base.id in aliases:
                module = aliases[base.id]
            if module is not None and not node.attr.startswith("_"):
                names.setdefault((module, node.attr), []).append(where)
    return names, {a: w for a, w in attrs.items() if a not in own}


def test_backends_reference_the_verbs_namespace() -> None:
    names, _ = _backend_usage()
    used = {f"{m}.{n}" for m, n in names}
    # a sample the backends certainly use: if these vanish, the walk above no longer sees the backends
    assert {"qp.QPEx", "wr.SGE", "providers.efa.efadv.SRDQPEx", "device.Context"} <= used, sorted(used)


def test_names_the_backends_use_exist_in_both(pyverbs: ModuleType) -> None:
    names, _ = _backend_usage()
    problems = []
    for (module, name), where in sorted(names.items()):
        smod = importlib.import_module(f"softverbs.{module}")
        pmod = importlib.import_module(f"pyverbs.{module}")
        for provider, mod in (("softverbs", smod), ("pyverbs", pmod)):
            if not hasattr(mod, name):
                problems.append(f"{provider}.{module}.{name}: missing, used at {', '.join(where[:3])}")
        if hasattr(smod, name) and name not in getattr(smod, "__all__", ()):
            problems.append(f"softverbs.{module}.{name}: used by the backends but not in __all__, so the "
                            f"agreement test above does not compare it")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@cache
def _pxd_fields(cls: type) -> frozenset[str]:
    """The C-level fields a pyverbs class declares in its .pxd (``cdef v.ibv_cq *cq``): its internals, which
    Cython may expose as attributes but which are no API to mirror."""
    fields: set[str] = set()
    pkg_dir = Path(importlib.import_module("pyverbs").__file__).resolve().parent
    for klass in cls.__mro__:
        if not klass.__module__.startswith("pyverbs"):
            continue
        pxd = pkg_dir.joinpath(*klass.__module__.split(".")[1:]).with_suffix(".pxd")
        if not pxd.is_file():
            continue
        text = pxd.read_text()
        m = re.search(rf"^cdef class {klass.__name__}\b.*:\s*$", text, re.M)
        if m is None:
            continue
        end = re.compile(r"^\S", re.M).search(text, m.end())
        for decl in re.findall(r"^\s+cdef\s+(?!class)(.+)$", text[m.end(): end.start() if end else len(text)], re.M):
            if "(" not in decl:  # a field, not a cdef method
                fields.update(n.strip(" *") for n in decl.split()[-1].split(","))
                fields.update(n.strip(" *") for n in decl.split(",")[1:])
        pyx = pxd.with_suffix(".pyx")
        body = re.search(rf"^cdef class {klass.__name__}\b.*?:\s*$(.*?)(?=^\S)", pyx.read_text() + "\nEND",
                         re.M | re.S) if pyx.is_file() else None
        if body is not None:  # a field with a property of the same name in the .pyx (QPEx.ind_table) is API
            fields -= set(re.findall(r"^    def (\w+)\(self\)", body.group(1), re.M))
    return frozenset(f for f in fields if f.isidentifier())


def test_members_the_backends_use_exist_in_both(pyverbs: ModuleType) -> None:
    """For every mirrored class: each attribute the backends read (on any object) that the pyverbs class has,
    softverbs' class has too, as the same kind (method or field). With the agreement test above (softverbs'
    members exist in pyverbs) this covers the classes and methods the backends use, in both directions."""
    _, attrs = _backend_usage()
    problems = []
    for s_cls_id, (where_s, p_cls) in sorted(_counterparts().items(), key=lambda kv: kv[1][0]):
        s_cls = next(obj for path in MODULE_PATHS for obj in vars(importlib.import_module(f"softverbs.{path}")).values()
                     if id(obj) == s_cls_id)
        if issubclass(s_cls, enum.Enum) or issubclass(s_cls, BaseException):
            continue  # enum members and exceptions are compared by the agreement test
        s_members = set(_softverbs_members(s_cls)) | {n for n in dir(s_cls) if _is_public(n)}
        for name in sorted(attrs):
            if not _is_public(name) or not hasattr(p_cls, name) or name in _pxd_fields(p_cls):
                continue
            if name not in s_members:
                problems.append(f"{where_s}.{name}: pyverbs has it and the backends read .{name} "
                                f"({', '.join(attrs[name][:2])}), softverbs does not have it")
                continue
            s_kind, p_kind = _kind(_raw_attr(s_cls, name)) if hasattr(s_cls, name) else "field", \
                _kind(_raw_attr(p_cls, name))
            if (s_kind == "method") != (p_kind == "method"):
                problems.append(f"{where_s}.{name}: a {s_kind} in softverbs but a {p_kind} in pyverbs")
    if problems:
        pytest.fail(f"{len(problems)} gap(s):\n  " + "\n  ".join(problems), pytrace=False)


# The import calls (ibv_import_device, ibv_import_pd, ibv_import_mr) go through constructor keywords that no
# signature shows on either side (``**kwargs``): the IBGDA import path passes these, so both must read them.
IMPORT_KEYWORDS = {("device", "Context"): "cmd_fd", ("pd", "PD"): "handle", ("mr", "MR"): "handle"}
IMPORT_MEMBERS = {("device", "Context"): ("cmd_fd",), ("pd", "PD"): ("handle", "unimport"),
                  ("mr", "MR"): ("handle", "unimport")}


def test_the_import_calls_are_mirrored(pyverbs: ModuleType) -> None:
    pkg_dir = Path(importlib.import_module("pyverbs").__file__).resolve().parent
    problems = []
    for (module, cls), key in IMPORT_KEYWORDS.items():
        read = re.compile(rf"kwargs\.get\(\s*['\"]{key}['\"]")
        soft_src = inspect.getsource(getattr(importlib.import_module(f"softverbs.{module}"), cls))
        pyx_src = (pkg_dir / f"{module}.pyx").read_text()
        for provider, text in (("softverbs", soft_src), ("pyverbs", pyx_src)):
            if not read.search(text):
                problems.append(f"{provider}.{module}.{cls}: its constructor does not read {key}=")
        for member in IMPORT_MEMBERS[(module, cls)]:
            for provider in ("softverbs", "pyverbs"):
                if not hasattr(getattr(importlib.import_module(f"{provider}.{module}"), cls), member):
                    problems.append(f"{provider}.{module}.{cls}.{member}: missing")
    assert not problems, "\n".join(problems)
