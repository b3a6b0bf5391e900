"""Checks of command-line options that `transportd demo` and `transportd bench e2e` share: the flag
combinations the daemons' config would refuse, refused first with the flags' own names."""

from __future__ import annotations

import click

__all__ = ["check_signal_mode"]


def check_signal_mode(backend: str, signal_mode: str, adaptive_routing: bool = False) -> None:
    """Refuse, naming the flags, the --backend/--signal-mode/--adaptive-routing combinations the daemons'
    config would refuse (before anything starts)."""
    if backend == "efa" and signal_mode != "write":
        raise click.UsageError(f"--signal-mode {signal_mode} does not apply to --backend efa (the receiving "
                               "daemon publishes each flag once its data has arrived); leave --signal-mode out")
    if adaptive_routing and backend == "ib" and signal_mode == "write":
        raise click.UsageError("--adaptive-routing needs --signal-mode atomic or fence (write signaling relies on "
                               "in-order placement, which adaptive routing breaks)")
