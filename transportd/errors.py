"""Moved to :mod:`cmd_ring.errors`, the contract the client and the daemon both stand on; this name stays
so the code that imports it here keeps working. The two names are one module object (not a copy of its
names), so a monkeypatch or a private helper reached through either is the same."""

import sys

import cmd_ring.errors as _contract

sys.modules[__name__] = _contract
