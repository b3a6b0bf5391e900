"""transportd_cli: the command-line programs, on top of the daemon and the client library.

``transportd`` (:mod:`transportd_cli.cli`: ``run`` from :mod:`transportd.daemon.entry`, the demo, the
benchmarks) and ``transportctl`` (:mod:`transportd_cli.ctl`: inspect a daemon, ``selftest``). The demo,
``bench e2e``/``bench rails`` and the self-test's near side drive daemons through ``gpuclient``, so they
live here rather than in the daemon's package.
"""
