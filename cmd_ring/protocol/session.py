"""The client session's state machine: the only place that says which op may follow which (the client
checks before sending, the server before dispatching)."""

from __future__ import annotations

from enum import Enum

from cmd_ring.errors import LocalProtocolError
from cmd_ring.protocol.client_messages import REQUESTS
from cmd_ring.protocol.wire import ReplyCode

__all__ = [
    "SessionRules",
    "SessionState",
    "TRANSITIONS",
    "next_state",
]


class SessionState(Enum):
    """Where a client session stands."""

    NEW = "new"  #: connected, not greeted
    READY = "ready"  #: greeted, not in a job
    JOINED = "joined"  #: attached to (job, rank); may use memory, flags and channels


_ANY = ("heartbeat",)
#: state -> {op: next state}. An op missing from a state's row is refused with ``bad_state``.
TRANSITIONS: dict[SessionState, dict[str, SessionState]] = {
    SessionState.NEW: {"hello": SessionState.READY},
    SessionState.READY: {
        "hello": SessionState.READY,
        "join": SessionState.JOINED,
        "stats": SessionState.READY,
        "inspect": SessionState.READY,
        "selftest": SessionState.READY,
        "trace_start": SessionState.READY,
        "trace_stop": SessionState.READY,
        "restart": SessionState.READY,
    },
    SessionState.JOINED: {
        "register": SessionState.JOINED,
        "flags": SessionState.JOINED,
        "channel": SessionState.JOINED,
        "channel_info": SessionState.JOINED,
        "channel_connect": SessionState.JOINED,
        "channel_close": SessionState.JOINED,
        "exchange": SessionState.JOINED,
        "stats": SessionState.JOINED,
        "inspect": SessionState.JOINED,
        "selftest": SessionState.JOINED,
        "trace_start": SessionState.JOINED,
        "trace_stop": SessionState.JOINED,
        "restart": SessionState.JOINED,
        "leave": SessionState.READY,
    },
}
for _row_state, _row in TRANSITIONS.items():
    for _op in _ANY:
        _row[_op] = _row_state
assert all(op in REQUESTS for row in TRANSITIONS.values() for op in row)


def next_state(state: SessionState, op: str) -> SessionState | None:
    """The state after a successful ``op`` in ``state``, or None when ``op`` is not allowed there."""
    return TRANSITIONS[state].get(op)


def _state_problem(state: SessionState, op: str) -> str:
    allowed = ", ".join(sorted(TRANSITIONS[state]))
    hint = {SessionState.NEW: " (send hello first)", SessionState.READY: " (join a job first)"}.get(state, "")
    return f"op '{op}' is not allowed in session state '{state.value}'{hint}; allowed: {allowed}"


class SessionRules:
    """Which ops one client session may send now (its state); the client checks before sending, the server
    before dispatching."""

    def __init__(self, state: SessionState = SessionState.NEW) -> None:
        self.state = state

    def check(self, op: str) -> None:
        """Raise :class:`LocalProtocolError` (code ``bad_state``) when ``op`` may not be sent now."""
        if next_state(self.state, op) is None:
            raise LocalProtocolError(_state_problem(self.state, op), code=ReplyCode.BAD_STATE, field="op")

    def refuse_reason(self, op: str) -> str | None:
        """The server's view: why ``op`` is refused now, or None when it is allowed."""
        return None if next_state(self.state, op) is not None else _state_problem(self.state, op)

    def advance(self, op: str) -> None:
        """Record that ``op`` succeeded."""
        new = next_state(self.state, op)
        if new is None:
            raise LocalProtocolError(_state_problem(self.state, op), code=ReplyCode.BAD_STATE, field="op")
        self.state = new

    def __repr__(self) -> str:
        return f"SessionRules({self.state.value})"
