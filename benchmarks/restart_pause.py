"""The pause a streaming client sees when a daemon restarts under it (docs/restart.md).

Two daemons on this machine over softverbs (``LocalCluster``), one rank on each, each streaming PUT_SIGNALs
(ADD) to the other. Node b is restarted ``--rounds`` times each way:

- ``request``: a restart request (``transportctl restart``, SIGHUP, the unit's reload): the daemon starts
  its successor and hands over once it is ready;
- ``graceful``: SIGTERM, then the same config started again (``systemctl restart``, without systemd's
  RestartSec): the start is in the pause;
- ``crash``: SIGKILL, then started again at once.

For each, the pause is what a client measures on its own ring: the
time from the last rise of its completion position before the restart to the first rise after it, taken
as the longest gap between rises from the restart on. It is reported for the client on the restarted node
(which re-attaches) and for its peer (whose records to it were held), with the re-attach time the client
library measured (the daemon's end closing to the last ring adopted) and the daemon's own stop and start.

::

    python benchmarks/restart_pause.py --backend ib --backend efa --rounds 3 --json benchmarks/results/x.json

Prints a table and writes JSON (``summary``: the median pause per backend and kind). It uses the streaming
helper of the restart tests (``tests/support/streams.py``), so it runs from a development checkout.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.cluster import Rank, close_ranks, join_ranks  # noqa: E402
from tests.support.streams import CHUNK, SLOTS, Stream  # noqa: E402
from transportd.control.client import ControlConnection  # noqa: E402
from transportd.control.protocol import Restart  # noqa: E402
from transportd_cli.localcluster import LocalCluster  # noqa: E402

GRACE_S = 120.0  # long enough for any start on a loaded machine: the pause is measured, not bounded
STEP_TIMEOUT_S = 180.0


def _until(cond: Any, what: str, timeout: float = STEP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _flowing(stream: Stream, beyond: int) -> bool:
    done = stream.src.channel.ring.completion_pos
    return stream.committed > beyond and any(p < done for p in stream.positions[beyond:])


def _round(cluster: LocalCluster, kind: str, b: Rank, streams: list[Stream]) -> dict[str, float]:
    _until(lambda: all(_flowing(s, s.committed - 20) for s in streams), "the streams to flow")
    committed = [s.committed for s in streams]
    count = b.session.reattach.count
    t0 = time.monotonic()
    if kind == "request":
        with ControlConnection(cluster.socket("nodeb")) as conn:
            conn.request(Restart())
        cluster.follow("nodeb")
        stopped = started = time.monotonic()
    else:
        if kind == "graceful":
            status = cluster.terminate("nodeb")
            assert status == 0, cluster.log("nodeb")
        else:
            cluster.kill("nodeb")
        stopped = time.monotonic()
        cluster.restart("nodeb")
        started = time.monotonic()
    _until(lambda: b.session.reattach.count > count, "nodeb's client to re-attach")
    back = [s.committed for s in streams]  # records committed once the client is back
    for s, before, since in zip(streams, committed, back, strict=True):
        _until(lambda s=s, before=before: _flowing(s, before + 20), "the streams to flow again")
        # and the stream thread saw it: a rise of its completion position past a record committed after the
        # restart (one the old daemon's drain could not have taken)
        _until(lambda s=s, since=since: len(s.positions) > since and s.completions[-1][1] > s.positions[since],
               "the stream to see it")
    ab, ba = streams
    if os.environ.get("RESTART_PAUSE_DEBUG"):
        for name, s in (("ab", ab), ("ba", ba)):
            near = [(round(t - t0, 3), p) for t, p in s.completions if t > t0 - 0.2]
            print(kind, name, near[:6], "...", [x for x in near if x[0] > 0][:8], file=sys.stderr)
    return {"restarted_node_client_s": ba.pause_s(t0), "peer_client_s": ab.pause_s(t0),
            "reattach_s": b.session.reattach.pauses[-1], "daemon_stop_s": stopped - t0,
            "daemon_start_s": started - stopped}


def run(backend: str, rounds: int) -> dict[str, list[dict[str, float]]]:
    cluster = LocalCluster(2, backend=backend, overrides={"peers": {"restart_grace_s": GRACE_S}})
    cluster.start()
    try:
        a, b = join_ranks(cluster, job="pause", nbytes=SLOTS * CHUNK, seed=1)
        streams = [Stream(a, b, peer=1).start(), Stream(b, a, peer=0).start()]
        try:
            out = {kind: [_round(cluster, kind, b, streams) for _ in range(rounds)]
                   for kind in ("request", "graceful", "crash")}
        finally:
            for s in streams:
                s.stop()
        close_ranks([a, b])
        return out
    finally:
        cluster.stop()


@click.command()
@click.option("--backend", "backends", multiple=True, type=click.Choice(["ib", "efa"]), default=("ib", "efa"))
@click.option("--rounds", default=3, show_default=True, help="restarts of each kind per backend")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write results here")
def main(backends: tuple[str, ...], rounds: int, json_path: str | None) -> None:
    results = {backend: run(backend, rounds) for backend in backends}
    rows = []
    summary: dict[str, Any] = {}
    for backend, kinds in results.items():
        for kind, samples in kinds.items():
            own = [s["restarted_node_client_s"] for s in samples]
            peer = [s["peer_client_s"] for s in samples]
            summary[f"{backend}_{kind}_pause_s"] = statistics.median(own)
            summary[f"{backend}_{kind}_peer_pause_s"] = statistics.median(peer)
            rows.append((backend, kind, statistics.median(own), max(own), statistics.median(peer), max(peer),
                         statistics.median(s["reattach_s"] for s in samples),
                         statistics.median(s["daemon_start_s"] for s in samples)))
    header = ("backend", "restart", "pause p50 s", "max s", "peer p50 s", "max s", "re-attach s", "start s")
    click.echo("  ".join(f"{h:>11}" for h in header))
    for row in rows:
        click.echo("  ".join(f"{v:>11}" if isinstance(v, str) else f"{v:>11.3f}" for v in row))
    if json_path:
        doc = {"benchmark": "restart_pause", "command": " ".join(["python", *sys.argv]),
               "host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": rounds, "results": results, "summary": summary}
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
        click.echo(f"wrote {json_path}")


if __name__ == "__main__":
    main()
