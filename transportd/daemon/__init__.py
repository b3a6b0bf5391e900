"""The daemon's main process: its config, its process entry (``transportd run``), systemd notification,
and the :class:`~transportd.daemon.main.Daemon` that owns clients, jobs, peers and the rail workers."""
