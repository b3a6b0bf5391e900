"""Checks of command-line options the `transportd` and `transportctl` commands share: the flag combinations
the daemons' config would refuse (refused first with the flags' own names), numbers that must be finite, and
output files that must be writable before any work starts; and the soft fabric's timing options the
benchmarks share (`io_spin_us_option`, `nic_spin_us_option`, `nic_streaming_option`, `gil_switch_us_option`)."""

from __future__ import annotations

import math
import os
from typing import Any

import click

from transportd.backends import RULES, config_problems
from transportd_cli.errors import ProgramError

__all__ = ["FiniteFloat", "Program", "available_memory", "check_signal_mode", "gil_switch_us_option", "harden",
           "io_spin_us_option", "nic_spin_us_option", "nic_streaming_option", "writable_output", "writable_problem"]


class Program(click.Group):
    """A program's top command group: an error a command raises (``click.ClickException``) prints as
    ``<prefix>: message`` on one line, as transportctl's own refusals do, so every command of both programs
    reads alike; usage errors keep click's form (a Usage line, exit 2)."""

    def __init__(self, *args: Any, prefix: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.UsageError, ProgramError):
            raise
        except click.ClickException as exc:
            raise ProgramError(self.prefix, exc.format_message(), exc.exit_code) from None


def check_signal_mode(backend: str, signal_mode: str, adaptive_routing: bool = False) -> None:
    """Refuse, naming the flags, the --backend/--signal-mode/--adaptive-routing combinations the daemons'
    config would refuse (before anything starts). Which those are is the backend registry's to say
    (``transportd.backends.config_problems``, what the config loader asks too)."""
    problems = dict(config_problems(backend, signal_mode=signal_mode, flags_publication="auto",
                                    adaptive_routing=adaptive_routing))
    if "signal.mode" not in problems:
        return
    if signal_mode == "write":  # write is every backend's mode: what refuses it is adaptive routing
        raise click.UsageError("--adaptive-routing needs --signal-mode atomic or fence (write signaling relies on "
                               "in-order placement, which adaptive routing breaks)")
    raise click.UsageError(f"--signal-mode {signal_mode} does not apply to --backend {backend} "
                           f"({RULES[backend].signal_modes_why}); leave --signal-mode out")


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``); None where it does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class FiniteFloat(click.FloatRange):
    """A float option's type that refuses NaN and the infinities (``float("nan")`` passes every range check:
    a NaN timeout hangs, an infinite interval overflows ``time.sleep``), with an optional range."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


#: ``--io-spin-us`` (``softverbs.io_spin_s`` in µs), as ``fabric_bench.py`` and ``fused_bench.py`` take it
io_spin_us_option = click.option(
    "--io-spin-us", default=0.0, show_default=True, type=FiniteFloat(min=0, max=1e6),
    help="softverbs.io_spin_s in µs: the soft devices' I/O threads stay awake this long after their last event "
         "instead of sleeping at once (a core each while traffic flows)")

#: ``--nic-spin-us`` (``softverbs.nic_spin_s`` in µs; None: the config's), as the benchmarks take it
nic_spin_us_option = click.option(
    "--nic-spin-us", default=None, type=FiniteFloat(min=0, max=1e4),
    help="softverbs.nic_spin_s in µs (default: the config's): how long before a shaped request lands a soft "
         "device waits for it awake (sent from the posting thread when it lands that soon, else the I/O thread "
         "wakes that early); 0: the I/O thread sleeps until each landing")

#: ``--nic-streaming/--no-nic-streaming`` (``softverbs.nic_streaming``), as the benchmarks take it
nic_streaming_option = click.option(
    "--nic-streaming/--no-nic-streaming", default=True, show_default=True,
    help="softverbs.nic_streaming: a shaped GPU write leaves as its first byte lands and is copied while the "
         "modeled link carries the rest, as a NIC places packets; --no-nic-streaming: store and forward, it "
         "leaves once its last byte has landed (its copy added to every landing), to compare the two")

#: ``--gil-switch-us`` (``softverbs.gil_switch_interval_s`` in µs; 0: Python's own), as the benchmarks take it
gil_switch_us_option = click.option(
    "--gil-switch-us", default=0.0, show_default=True, type=FiniteFloat(min=0, max=1e5),
    help="softverbs.gil_switch_interval_s in µs: the rail workers' Python switch interval, how long a soft "
         "device's I/O thread waits for the GIL while the worker posts or polls before it gets it; 0: Python's "
         "5 ms")


def writable_problem(path: str) -> str | None:
    """Why ``path`` cannot be written (one line), or None when it can. Leaves no file behind: one that did
    not exist is removed again."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return f"cannot write {path}: it is a directory"
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    if not existed:
        os.unlink(path)
    return None


def writable_output(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A click callback: an output path option (``--json PATH``) checked writable before the command runs,
    so a typo fails now and not after the work."""
    if value is not None and (problem := writable_problem(os.fspath(value))):
        raise click.BadParameter(problem, ctx=ctx, param=param)
    return value


def _float_type(param: click.Parameter) -> bool:
    return isinstance(param.type, click.types.FloatParamType) and not isinstance(param.type, FiniteFloat)


def harden(command: click.Command) -> None:
    """Through ``command`` and every subcommand: each float option refuses NaN and the infinities (keeping its
    range), and each ``--json PATH`` output is checked writable before the command runs. Done here once for
    all, the benchmarks of ``cmd_ring`` and ``softverbs`` (which sit below this package) included."""
    for param in command.params:
        if _float_type(param):
            r = param.type
            param.type = (FiniteFloat(r.min, r.max, min_open=r.min_open, max_open=r.max_open, clamp=r.clamp)
                          if isinstance(r, click.FloatRange) else FiniteFloat())
        if param.name == "json_path" and param.callback is None:
            param.callback = writable_output
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            harden(sub)
