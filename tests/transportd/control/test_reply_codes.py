"""Reply codes are stable: every refusal the daemon raises names a :class:`ReplyCode` member (never a free
string a client could not find in the enum or the docs), and the existing codes keep their wire values."""

from __future__ import annotations

import ast
from pathlib import Path

from transportd.control.protocol import ReplyCode

ROOT = Path(__file__).resolve().parents[3]
REFUSALS = ("RequestError", "SessionLostError")


def _refusals_with_free_codes() -> list[str]:
    """``file:line`` of every ``RequestError(...)`` in transportd whose code is a string literal (or missing),
    not ``ReplyCode.<member>`` nor a code carried through from elsewhere (a variable, ``exc.code``)."""
    bad = []
    for path in sorted((ROOT / "transportd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFUSALS):
                continue
            code = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "code"), None)
            member = (isinstance(code, ast.Attribute) and isinstance(code.value, ast.Name)
                      and code.value.id == "ReplyCode" and code.attr in ReplyCode.__members__)
            if node.func.id == "RequestError" and (code is None or isinstance(code, ast.Constant) or
                                                   (isinstance(code, ast.Attribute) and not member
                                                    and getattr(code.value, "id", "") == "ReplyCode")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return bad


def test_every_refusal_names_a_reply_code_member() -> None:
    assert _refusals_with_free_codes() == []


def test_codes_keep_their_wire_values() -> None:
    # a sample across the enum's history: renaming a value breaks every client that branches on it
    assert ReplyCode.BAD_MESSAGE == "bad_message"
    assert ReplyCode.INTERNAL == "internal"
    assert ReplyCode.RANK_TAKEN == "rank_taken"
    assert ReplyCode.UNREACHABLE == "unreachable"
    assert ReplyCode.BUSY == "busy"
    assert len({c.value for c in ReplyCode}) == len(ReplyCode)
