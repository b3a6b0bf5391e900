"""The daemon's process entry: ``transportd run --config FILE`` (what the systemd unit's ExecStart runs,
through the ``transportd`` command), and ``python -m transportd run`` (how tests and ``LocalCluster`` start
daemons). The rest of the ``transportd`` command (the demo, the benchmarks) lives in ``transportd_cli``.
"""

from __future__ import annotations

import sys

import click

__all__ = ["EXIT_CONFIG", "EXIT_SOFTWARE", "main", "run"]

EXIT_CONFIG = 78  # EX_CONFIG (sysexits.h): the configuration is wrong; restarting will not help
EXIT_SOFTWARE = 70  # EX_SOFTWARE: the daemon stopped itself (a rail worker died); a restart may help


@click.group()
@click.version_option(package_name="transportd")
def main() -> None:
    """Per-node RDMA transport daemon."""


@main.command()
@click.option("--config", "config_path", type=click.Path(), default=None,
              help="TOML config (default: built-in defaults); one that cannot be read exits 78, as a bad one does")
def run(config_path: str | None) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT (SIGHUP: start a fresh daemon and hand over to
    it once it is ready)."""
    import zmq

    from transportd.config import load_config
    from transportd.daemon.main import Daemon
    from transportd.daemon.succession import Predecessor
    from transportd.errors import ConfigError, TransportdError
    from transportd.logs import setup_logging

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        click.echo(f"transportd: bad config: {exc}", err=True)
        sys.exit(EXIT_CONFIG)  # distinct status: the unit's RestartPreventExitStatus stops retrying a bad file
    setup_logging(config.logging.level, config.logging.format)
    daemon = Daemon(config, predecessor=Predecessor.from_env())
    daemon.install_signal_handlers()
    try:
        daemon.start()
    except (TransportdError, OSError, zmq.ZMQError) as exc:  # ListenError names the config key
        click.echo(f"transportd: cannot start: {' '.join(str(exc).split())}", err=True)  # as every refusal reads
        sys.exit(1)
    try:
        daemon.run()
    finally:
        daemon.close()
    if daemon.failure:
        click.echo(f"transportd: {daemon.failure}", err=True)
        sys.exit(EXIT_SOFTWARE)
