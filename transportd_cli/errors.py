"""Errors the command-line programs raise themselves (the daemon's and the library's are in their packages)."""

from __future__ import annotations

import click

__all__ = ["ProgramError", "ReplayError", "Stopped"]


class ProgramError(click.ClickException):
    """A command's refusal as ``transportd`` and ``transportctl`` print every one: ``<program>: message`` on one
    line of stderr (click's own is ``Error: message``); the exit status of the error it stands for."""

    def __init__(self, program: str, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.program = program
        self.exit_code = exit_code

    def show(self, file: object = None) -> None:
        click.echo(f"{self.program}: {' '.join(self.format_message().split())}", err=True)


class ReplayError(RuntimeError):
    """The replay could not be set up or did not finish (not: the outcomes differed)."""


class Stopped(Exception):
    """SIGTERM to a command that runs until Ctrl-C (``transportd localcluster``): stop as Ctrl-C does."""
