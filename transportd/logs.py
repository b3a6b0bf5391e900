"""Logging to stderr, one line per event (journald picks it up): JSON or plain text."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event = {"t": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Configure the root logger once for the daemon process."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
