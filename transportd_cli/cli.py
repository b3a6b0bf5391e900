"""The `transportd` command: run the daemon (``transportd.daemon.entry``), the demo and the benchmarks."""

from __future__ import annotations

import json
import sys

import click

from transportd.daemon.entry import EXIT_CONFIG, EXIT_SOFTWARE, run
from transportd_cli.cli_options import FiniteFloat, Program, harden
from transportd_cli.localcluster import localcluster

__all__ = ["EXIT_CONFIG", "EXIT_SOFTWARE", "main"]


@click.group(cls=Program, prefix="transportd")
@click.version_option(package_name="transportd")
def main() -> None:
    """Per-node RDMA transport daemon."""


main.add_command(run)
main.add_command(localcluster)


@main.command()
@click.option("--mib", default=256, show_default=True, type=click.IntRange(min=1),
              help="MiB each rank sends to the other")
@click.option("--chunk-kib", default=1024, show_default=True, type=click.IntRange(min=1),
              help="chunk size in KiB (a divisor of --mib's KiB)")
@click.option("--backend", type=click.Choice(["ib", "efa"]), default="ib", show_default=True)
@click.option("--signal-mode", type=click.Choice(["write", "atomic", "fence"]), default="write", show_default=True,
              help="ib only (efa: the receiving daemon publishes flags)")
def demo(mib: int, chunk_kib: int, backend: str, signal_mode: str) -> None:
    """Two nodes on this machine over softverbs: stream data both ways, verify every byte and flag."""
    from transportd.errors import TransportdError
    from transportd_cli.cli_options import available_memory, check_signal_mode
    from transportd_cli.demo import run_demo

    need, available = 4 * (mib << 20), available_memory()  # two ranks, each a send and a receive buffer
    if available is not None and need > available:
        raise click.BadParameter(f"{mib} MiB each way needs about {need >> 20} MiB of memory (two ranks, a send "
                                 f"and a receive buffer each), and {available >> 20} MiB is available",
                                 param_hint="--mib")
    if (mib << 10) % chunk_kib:
        raise click.BadParameter(f"{chunk_kib} KiB does not divide --mib {mib} ({mib << 10} KiB) into whole "
                                 "chunks", param_hint="--chunk-kib")
    check_signal_mode(backend, signal_mode)
    try:
        run_demo(total=mib << 20, chunk=chunk_kib << 10, backend=backend, signal_mode=signal_mode, echo=click.echo)
    except (RuntimeError, TimeoutError, TransportdError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.argument("name", default="transportd")
@click.option("--force", is_flag=True, help="replace key files that exist (every peer then needs the new public key)")
def keygen(directory: str, name: str, force: bool) -> None:
    """Write a CURVE keypair: DIRECTORY/NAME.key (public, for peers and clients) and NAME.key_secret (0600).

    Refuses to overwrite existing key files unless --force."""
    from transportd.control.curve import generate_keypair

    try:
        public, secret = generate_keypair(directory, name, force=force)
    except OSError as exc:
        raise click.ClickException(str(exc) if isinstance(exc, FileExistsError) else
                                   f"cannot write keys into {directory}: {exc.strerror or exc}") from None
    click.echo(f"wrote {public} (public: copy it into each peer's curve_authorized_keys_dir) and {secret} (secret)")


@main.command()
@click.argument("trace_file", metavar="FILE", type=click.Path(exists=True, dir_okay=False))
@click.option("--socket", "sockets", multiple=True, metavar="ENDPOINT",
              help="a running daemon's control socket (ipc); repeat for more nodes: the traced rank goes on the "
                   "first, the other ranks over the rest [default: $TRANSPORTD_SOCKET, else the system socket]")
@click.option("--pace", type=click.Choice(["recorded", "fast"]), default="recorded", show_default=True,
              help="keep the recorded gaps between passes, or push as fast as the rings take them")
@click.option("--timeout", default=60.0, show_default=True, type=FiniteFloat(min=0.1, max=86400),
              help="seconds any one step (joining, exchanging, completing) may take")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def replay(trace_file: str, sockets: tuple[str, ...], pace: str, timeout: float, as_json: bool) -> None:
    """Replay a trace (`transportctl trace start|stop`) into a fresh job and report what differed.

    Exit 1 when an outcome differed (a record's code, or how many were taken), 0 when none did."""
    from transportd.control.client import resolve_endpoint
    from transportd.errors import TransportdError
    from transportd_cli.errors import ReplayError
    from transportd_cli.replay import format_report, run_replay

    endpoints = [resolve_endpoint(s) for s in sockets] or [resolve_endpoint(None)]
    try:
        report = run_replay(trace_file, endpoints, pace=pace, timeout=timeout,
                            echo=(lambda _: None) if as_json else click.echo)
    except (ReplayError, TimeoutError, TransportdError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else format_report(report))
    if not report["same"]:
        sys.exit(1)


@main.group()
def bench() -> None:
    """Benchmarks: each prints a table and writes JSON with --json PATH."""


def _register_subcommands() -> None:
    # Subcommands live with the code they exercise; import them here so `main` sees them.
    from cmd_ring.bench import bench_ring

    bench.add_command(bench_ring)
    from softverbs.soft.bench import bench_softverbs
    bench.add_command(bench_softverbs)
    from transportd_cli.bench_proxy import bench_proxy, bench_signals
    bench.add_command(bench_proxy)
    bench.add_command(bench_signals)
    from transportd_cli.bench_e2e import bench_e2e
    bench.add_command(bench_e2e)
    from transportd_cli.bench_rails import bench_rails
    bench.add_command(bench_rails)


_register_subcommands()
harden(main)
