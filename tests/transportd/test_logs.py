"""Daemon and rail-worker logs: one event per line, JSON that parses, the worker named in each line."""

from __future__ import annotations

import json
import logging

import pytest

from transportd.logs import setup_logging


@pytest.fixture(autouse=True)
def restore_root_logger():
    # setup_logging replaces the root logger's handlers (as the daemon wants): put pytest's back after
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_parse_and_name_the_worker(capsys) -> None:
    setup_logging("info", "json", tag="rail1")
    logging.getLogger("transportd.dataplane.worker").warning("queue %s is %d deep", "a", 7)
    logging.getLogger("transportd.dataplane.worker").debug("not shown at info")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["level"] == "warning" and event["msg"] == "queue a is 7 deep" and event["process"] == "rail1"


def test_text_lines_carry_the_worker_prefix(capsys) -> None:
    setup_logging("info", "text", tag="rail0")
    logging.getLogger("transportd").info("ready")
    assert " rail0 INFO transportd: ready" in capsys.readouterr().err
