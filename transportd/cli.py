"""The `transportd` command: run the daemon, the demo and the benchmarks."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="transportd")
def main() -> None:
    """Per-node RDMA transport daemon."""


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config (default: built-in defaults)")
def run(config_path: str | None) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    from transportd.config import load_config
    from transportd.daemon import Daemon
    from transportd.errors import ConfigError, TransportdError
    from transportd.logs import setup_logging

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(f"bad config: {exc}") from None
    setup_logging(config.logging.level, config.logging.format)
    daemon = Daemon(config)
    daemon.install_signal_handlers()
    try:
        daemon.start()
    except (TransportdError, OSError) as exc:
        raise click.ClickException(f"cannot start: {exc}") from None
    try:
        daemon.run()
    finally:
        daemon.close()


@main.group()
def bench() -> None:
    """Benchmarks: each prints a table and writes JSON with --json PATH."""


def _register_subcommands() -> None:
    # Subcommands live with the code they exercise; import them here so `main` sees them.
    from cmd_ring.bench import bench_ring

    bench.add_command(bench_ring)


_register_subcommands()
