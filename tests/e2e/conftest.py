"""Fixtures that start real daemons (``LocalCluster``) and the second uid the identity tests run clients as;
the rank helpers they use are in ``tests/support/cluster.py`` and ``tests/support/users.py``."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import started_clusters
from tests.support.users import GROUP, OTHER, OUTSIDER, ensure_user


@pytest.fixture
def cluster_factory() -> Iterator[Any]:
    with started_clusters() as make:
        yield make


@pytest.fixture(scope="module")
def users() -> dict[str, pwd.struct_passwd]:
    """A client group's member and a user outside it (created once; CI runs as root)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must run the identity tests as root: they create a second user")
        pytest.skip("needs root: creates a second user to run a client as another uid")
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.fail("useradd/groupadd are needed to create the second user (install the passwd package)")
    return {"other": ensure_user(OTHER, GROUP), "outsider": ensure_user(OUTSIDER, OUTSIDER)}


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A work directory other users may traverse (the control socket inside keeps its own mode and group)."""
    path = Path(tempfile.mkdtemp(prefix="tpd-identity-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
