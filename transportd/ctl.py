"""The `transportctl` command: inspect a running daemon through its control socket."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="transportd")
def main() -> None:
    """Inspect a running transportd."""
