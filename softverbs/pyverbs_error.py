"""Exceptions with pyverbs' names and meaning, so backends catch the same classes on both providers."""

from __future__ import annotations

import os

__all__ = ["PyverbsError", "PyverbsRDMAError", "PyverbsUserError"]


class PyverbsError(Exception):
    """Base class: anything the verbs layer refuses."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        if error_code != -1:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)


class PyverbsRDMAError(PyverbsError):
    """A verb failed; `error_code` is the errno the provider returned (ENOMEM, EINVAL, ...)."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        super().__init__(msg, error_code)
        self._error_code = error_code

    @property
    def error_code(self) -> int:
        return self._error_code


class PyverbsUserError(PyverbsError):
    """The caller passed something the library itself rejects (bad name, missing SGE, ...)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
