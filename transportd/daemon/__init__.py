"""The daemon's main process: its process entry (``transportd run``), systemd notification,
and the :class:`~transportd.daemon.main.Daemon` (its lifecycle and main loop), composed of one part per
concern over their shared resources (``state``): client sessions (``clients``), ranks' memory
(``memory``), IBGDA channels (``ibgda``), a job's wiring across nodes (``peering``), the self-test
(``selftest_jobs``) and reporting (``stats``)."""
