"""Error classes: who is at fault, stable text, survive pickling; ErrorCode is a stable ABI; each package defines
its exception classes in its errors module and nowhere else."""

from __future__ import annotations

import ast
import os
import pickle
import stat
from pathlib import Path

import pytest

from transportd.control.curve import generate_keypair, load_public_key, load_secret_keypair
from transportd.errors import (
    BackendError,
    ConfigError,
    CudaError,
    CudaUnavailableError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    DeviceNotFoundError,
    ErrorCode,
    GdrCopyError,
    Invalid,
    LocalProtocolError,
    PeerDeadError,
    PeerError,
    ProtocolError,
    RemoteProtocolError,
    RequestError,
    SendQueueFullError,
    SocketGroupError,
    TraceFormatError,
    TransportdError,
    VerbsError,
    VerbsUnavailableError,
    WorkerError,
    error_code_c_enum,
)

ROOT = Path(__file__).resolve().parents[2]

SAMPLES = [
    ConfigError("/etc/t.toml", "proxy.batch_max", "must be in [1, 8], got 9"),
    LocalProtocolError("join: field 'rank': missing", code="bad_field", field="rank"),
    RemoteProtocolError("message too big", code="too_large"),
    RequestError("bad_state", "join a job first"),
    PeerError("node-b", "malformed peer_regions"),
    PeerDeadError("node-b", "no heartbeat for 5.0 s"),
    DaemonUnavailableError("ipc:///x.sock", "transportd is not running at ipc:///x.sock"),
    DaemonTimeoutError("ipc:///x.sock", "no reply"),
]


@pytest.mark.parametrize("err", SAMPLES, ids=lambda e: type(e).__name__)
def test_errors_share_a_base_and_pickle(err):
    assert isinstance(err, TransportdError)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err) and str(copy) == str(err) and copy.__dict__ == err.__dict__


def test_error_texts():
    assert str(SAMPLES[0]) == "/etc/t.toml: proxy.batch_max: must be in [1, 8], got 9"
    assert str(SAMPLES[3]) == "bad_state: join a job first"
    assert str(SAMPLES[4]) == "peer node-b: malformed peer_regions"
    assert isinstance(SAMPLES[1], ProtocolError) and isinstance(SAMPLES[5], PeerError)
    assert isinstance(SAMPLES[7], DaemonUnavailableError)


# The values are ABI shared with the CUDA header: changing one is a breaking change, so pin them here.
PINNED = {
    "OK": 0, "BAD_OPCODE": 1, "BAD_PEER": 2, "BAD_REGION": 3, "OUT_OF_BOUNDS": 4, "BAD_LENGTH": 5,
    "BAD_SLOT": 6, "CLIENT_GONE": 7, "PEER_LOST": 8, "REMOTE_ACCESS": 9, "TRANSPORT": 10,
    "BAD_ALIGNMENT": 11, "BAD_RECORD": 12, "NO_ACCESS": 13, "UNKNOWN_OUTCOME": 14, "CHANNEL_LOST": 15,
    "INTERNAL": 255,
}


def test_error_codes_are_pinned_and_documented():
    assert {c.name: int(c) for c in ErrorCode} == PINNED
    for code in ErrorCode:
        assert code.__doc__ and code.__doc__ != ErrorCode.__doc__, code.name
        assert 0 <= code < 1 << 16
    assert ErrorCode(4) is ErrorCode.OUT_OF_BOUNDS


def test_c_enum_text():
    text = error_code_c_enum()
    assert text.startswith("enum tpd_error_code {")
    for code in ErrorCode:
        assert f"TPD_ERR_{code.name} = {int(code)}," in text


def test_generated_keypair(tmp_path):
    public, secret = generate_keypair(tmp_path / "keys", "node")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pub, sec = load_secret_keypair(secret)
    assert load_public_key(public) == pub and len(pub) == len(sec) == 40
    with pytest.raises(ValueError, match="no secret key"):
        load_secret_keypair(public)


@pytest.mark.parametrize(("cls", "base"), [
    (SocketGroupError, TransportdError), (CudaError, TransportdError), (CudaUnavailableError, CudaError),
    (VerbsUnavailableError, TransportdError), (BackendError, TransportdError), (DeviceNotFoundError, BackendError),
    (VerbsError, BackendError), (SendQueueFullError, BackendError), (WorkerError, TransportdError),
    # not TransportdErrors: callers catch them as the builtin they are
    (GdrCopyError, OSError), (TraceFormatError, ValueError), (Invalid, Exception),
], ids=lambda c: c.__name__)
def test_error_bases(cls, base):
    # defined in the contract's errors module, reached here through transportd.errors, the same module
    assert cls.__bases__ == (base,) and cls.__module__ == "cmd_ring.errors"


def test_error_attributes():
    err = VerbsError("ibv_post_send: no memory", 12)
    assert err.errno == 12 and pickle.loads(pickle.dumps(err)).errno == 12
    assert (CudaError("cuMemAlloc", "CUDA_ERROR_OUT_OF_MEMORY").result, str(CudaError("f", "R"))) == (
        "CUDA_ERROR_OUT_OF_MEMORY", "f failed: R")
    inner = Invalid(("gid",), "too long", reason="invalid").within(("rails", 0))
    assert (inner.path, str(inner)) == (("rails", 0, "gid"), "rails[0].gid: too long")


# --- one errors module per package -------------------------------------------------------------------------
# softverbs is left out: it mirrors pyverbs' module layout, so its errors live in pyverbs_error.py as pyverbs'
# do.
PACKAGES = ("cmd_ring", "transportd", "ib", "efa", "ibgda", "gpuclient", "transportd_cli")
SUFFIXES = ("Error", "Exception")


def _base_names(node: ast.ClassDef) -> list[str]:
    """The last dotted part of each base (``verbs.error.PyverbsError`` gives ``PyverbsError``)."""
    return [ast.unparse(b).rpartition(".")[2] for b in node.bases]


def _exception_classes(trees: dict[str, ast.Module], known: set[str]) -> dict[str, list[str]]:
    """Module name -> the classes it defines whose bases end in Error or Exception, or are in ``known`` or
    another class found here (to a fixed point, so a chain of subclasses is followed)."""
    classes = [(name, node) for name, tree in trees.items() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)]
    found: dict[str, list[str]] = {}
    names = set(known)
    changed = True
    while changed:
        changed = False
        for module, node in classes:
            if node.name in found.get(module, ()):
                continue
            if any(b.endswith(SUFFIXES) or b in names for b in _base_names(node)):
                found.setdefault(module, []).append(node.name)
                names.add(node.name)
                changed = True
    return found


def _package_trees(package: str) -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / package).rglob("*.py"))}


def _stray_exception_classes(package: str) -> dict[str, list[str]]:
    """Exception classes ``package`` defines outside ``<package>/errors.py`` (every one, if it has none)."""
    trees = _package_trees(package)
    errors = f"{package}/errors.py"
    known = set(_exception_classes({errors: trees.pop(errors)}, set()).get(errors, ())) if errors in trees else set()
    return _exception_classes(trees, known)


def test_the_check_finds_what_it_should():
    trees = {"m.py": ast.parse("class A(Exception): pass\nclass B(A): pass\nclass C(mod.FooError): pass\n"
                               "class D(Known): pass\nclass E(B): pass\nclass F: pass\nclass G(int): pass\n")}
    assert sorted(_exception_classes(trees, {"Known"})["m.py"]) == ["A", "B", "C", "D", "E"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exception_class_is_in_its_packages_errors_module(package):
    assert _stray_exception_classes(package) == {}, f"move these into {package}/errors.py"


@pytest.mark.parametrize(("path", "own"), [("transportd/errors.py", ("cmd_ring.errors",)), ("cmd_ring/errors.py", ())])
def test_transportd_errors_imports_nothing_of_transportd(path, own):
    """Every transportd and cmd_ring module may import the errors module, so it stands on nothing of either
    package (transportd/errors.py is the contract's module under its old name, and imports only that)."""
    tree = ast.parse((ROOT / path).read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += ["." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert [name for name in imported if name.startswith((".", "transportd", "cmd_ring")) and name not in own] == []
