"""The `transportd` command: run the daemon, the demo and the benchmarks."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="transportd")
def main() -> None:
    """Per-node RDMA transport daemon."""


@main.group()
def bench() -> None:
    """Benchmarks: each prints a table and writes JSON with --json PATH."""


def _register_subcommands() -> None:
    # Subcommands live with the code they exercise; import them here so `main` sees them.
    from cmd_ring.bench import bench_ring

    bench.add_command(bench_ring)


_register_subcommands()
