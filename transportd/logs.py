"""Logging to stderr, one line per event (journald picks it up): JSON or plain text."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]


class JsonFormatter(logging.Formatter):
    def __init__(self, tag: str = "") -> None:
        super().__init__()
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        event = {"t": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        if self.tag:
            event["process"] = self.tag
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


def setup_logging(level: str = "info", fmt: str = "json", tag: str = "") -> None:
    """Configure the root logger once per process; ``tag`` names the process (``rail0``) in each line."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(tag))
    else:
        prefix = f"{tag} " if tag else ""
        formatter = logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
