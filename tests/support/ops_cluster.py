"""The operations tests' shared two-node cluster (the ``ops_cluster`` fixture): what traffic it carries, so
every counter a test reads has a known lower bound, and the handle the tests get."""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass

from tests.support.cluster import Rank
from transportd_cli.localcluster import LocalCluster

JOB = "ops"
CHUNK = 4096
PUTS = 16  # PUT_SIGNAL a -> b, each adds 1 to b's flag 0
SET_VALUE = 99  # then a FENCE and a SIGNAL SET of b's flag 1
BACK = 3  # PUT_SIGNAL b -> a, each adds 1 to a's flag 2
INFLIGHT_CAP = 8  # small, so a stalled peer fills the cap after four PUT_SIGNALs


def control_group() -> str:
    """A group nodeb gives its socket, rings and flag files to: not our own when we may (root), else ours."""
    if os.geteuid() == 0:
        for name in ("nogroup", "nobody", "users"):
            try:
                return grp.getgrnam(name).gr_name
            except KeyError:
                pass
    return grp.getgrgid(os.getegid()).gr_name


@dataclass
class OpsCluster:
    cluster: LocalCluster
    a: Rank  # rank 0 on nodea
    b: Rank  # rank 1 on nodeb
    metrics: dict[str, str]  # node -> host:port
    group: str  # nodeb's control.group

    def socket(self, node: str) -> str:
        return self.cluster.socket(node)
