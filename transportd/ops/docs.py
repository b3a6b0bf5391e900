"""The generated parts of ``docs/``: the config keys (``transportd.config.describe_keys``) and the control/peer
protocol's messages (from ``transportd.control.protocol``'s registries: each field's type and the limits its
annotation states, through ``transportd.schema.type_doc``).

``python -m transportd.ops.docs`` rewrites every block between ``<!-- generated: NAME -->`` and
``<!-- end generated -->`` in ``docs/*.md``; ``tests/test_docs.py`` fails when a block is stale.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from transportd.config import describe_keys
from transportd.control import protocol
from transportd.schema import type_doc

__all__ = ["GENERATORS", "render_blocks", "stale_blocks"]

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def _messages(registry: dict[str, type[protocol.Message]]) -> str:
    lines = ["| op | fields | what it does |", "|---|---|---|"]
    for op, cls in sorted(registry.items()):
        fields = []
        for f in msgspec.structs.fields(cls):
            default = "" if f.required else f" = {f.default!r}"
            fields.append(f"`{f.name}: {type_doc(f.type)}{default}`".replace("|", "\\|"))
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()).replace("|", "\\|")
        lines.append(f"| `{op}` | {', '.join(fields) or '—'} | {doc} |")
    return "\n".join(lines) + "\n"


_ROLE = re.compile(r":[a-z]+:(?=`)")  # Sphinx roles (:data:`V`) read as plain code in Markdown
_CODE_LINE = re.compile(r'^\s+[A-Z_]+ = "(?P<code>[a-z_]+)"\s+#: (?P<doc>.*)$', re.M)


def _reply_codes() -> str:
    """Every :class:`~transportd.control.protocol.ReplyCode`, with the ``#:`` comment beside it."""
    docs = {m.group("code"): m.group("doc") for m in _CODE_LINE.finditer(inspect.getsource(protocol.ReplyCode))}
    lines = ["| code | when |", "|---|---|"]
    lines += [f"| `{code.value}` | {_ROLE.sub('', docs.get(code.value, '')).replace('``', '`')} |"
              for code in protocol.ReplyCode]
    return "\n".join(lines) + "\n"


#: block name -> the function that renders it
GENERATORS: dict[str, Callable[[], str]] = {
    "config_keys": describe_keys,
    "control_requests": lambda: _messages(protocol.REQUESTS),
    "reply_codes": _reply_codes,
    "side_messages": lambda: _messages(protocol.SIDE_MESSAGES),
    "peer_messages": lambda: _messages(protocol.PEER_MESSAGES),
}


def render_blocks(text: str) -> str:
    """``text`` with every generated block rendered afresh (an unknown block name raises KeyError)."""
    return _BLOCK.sub(lambda m: m.group(1) + GENERATORS[m.group("name")]() + m.group(4), text)


def stale_blocks(docs: Path = DOCS) -> list[str]:
    """``file: block`` for every generated block that differs from what its generator renders now."""
    stale = []
    for path in sorted(docs.glob("*.md")):
        for m in _BLOCK.finditer(path.read_text()):
            if m.group("body") != GENERATORS[m.group("name")]():
                stale.append(f"{path.name}: {m.group('name')}")
    return stale


def main(argv: list[str] | None = None) -> int:
    for path in sorted(DOCS.glob("*.md")):
        text = path.read_text()
        fresh = render_blocks(text)
        if fresh != text:
            path.write_text(fresh)
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
