"""Checks of command-line options that `transportd demo` and `transportd bench e2e` share: the flag
combinations the daemons' config would refuse, refused first with the flags' own names."""

from __future__ import annotations

import click

from transportd.backends import RULES, config_problems

__all__ = ["check_signal_mode"]


def check_signal_mode(backend: str, signal_mode: str, adaptive_routing: bool = False) -> None:
    """Refuse, naming the flags, the --backend/--signal-mode/--adaptive-routing combinations the daemons'
    config would refuse (before anything starts). Which those are is the backend registry's to say
    (``transportd.backends.config_problems``, what the config loader asks too)."""
    problems = dict(config_problems(backend, signal_mode=signal_mode, decoupled=False, flags_publication="auto",
                                    adaptive_routing=adaptive_routing))
    if "signal.mode" not in problems:
        return
    if signal_mode == "write":  # write is every backend's mode: what refuses it is adaptive routing
        raise click.UsageError("--adaptive-routing needs --signal-mode atomic or fence (write signaling relies on "
                               "in-order placement, which adaptive routing breaks)")
    raise click.UsageError(f"--signal-mode {signal_mode} does not apply to --backend {backend} "
                           f"({RULES[backend].signal_modes_why}); leave --signal-mode out")
