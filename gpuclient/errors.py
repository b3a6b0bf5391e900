"""The errors of gpuclient: one module for every exception the client library defines.

All but the buffer, launcher and chunk plan checks are TransportdErrors; ``CompileError`` is a ``CudaError``
(``transportd.errors``), which gpuclient also hands out as ``gpuclient.CudaError``.
"""

from __future__ import annotations

from cmd_ring.errors import CudaError, ErrorCode, TransportdError

__all__ = ["ChannelError", "CompileError", "HostBufferError", "LauncherError", "PlanError"]


class HostBufferError(ValueError):
    """The buffer is not in memory the daemon can map."""


class LauncherError(ValueError):
    """No launcher's variables are set, or they are inconsistent (the message names the variables)."""


class PlanError(ValueError):
    """A chunk plan the device could not use (overlaps, gaps, sizes, slots); ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.field, self.message))


class ChannelError(TransportdError):
    """The daemon reported an error for this channel or session (see ``code``, an ErrorCode)."""

    def __init__(self, code: int, count: int = 0, position: int = 0) -> None:
        """``count`` commands failed, the first at ring ``position`` (a channel's error word); ``count`` 0:
        the session's status word, which says what happened to the session, not to a command."""
        self.code = code
        self.count = count
        self.position = position
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"code {code}"
        if count and code == ErrorCode.UNKNOWN_OUTCOME:
            what = (f"{count} command(s) may or may not have executed (a daemon restarted or crashed between "
                    f"their post and their completion), the first at ring position {position}: re-send what "
                    "must arrive")
        elif count:
            what = f"{count} command(s) failed, the first at ring position {position}"
        else:
            what = _SESSION_STATUS.get(code, "the daemon set this session's status word")
        super().__init__(f"{name}: {what}")


#: What a session's status word means to the person reading the exception, and what to do.
_SESSION_STATUS = {
    int(ErrorCode.PEER_LOST): "a node of this job was lost (its daemon stopped, restarted or stopped answering), "
                              "so the job cannot go on; leave and join again once that node is back",
    int(ErrorCode.CLIENT_GONE): "this session is over (it left, the daemon reclaimed it, or the daemon stopped "
                                "and no new one came back within its restart grace period); connect and join "
                                "again",
}


class CompileError(CudaError):
    """NVRTC refused the source; ``log`` holds the compiler's messages."""

    def __init__(self, name: str, log: str) -> None:
        self.log = log
        super().__init__(f"nvrtcCompileProgram({name})", "NVRTC_ERROR_COMPILATION\n" + log)
