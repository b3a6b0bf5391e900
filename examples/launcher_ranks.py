"""Ranks from the launcher: every process joins with ``client.join()`` and no job, rank or world.

On a cluster (one daemon per node), start it the way you start training::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node1:29500 \\
        examples/launcher_ranks.py
    srun -N 2 --ntasks-per-node 8 python examples/launcher_ranks.py

On one machine, against two daemons over softverbs (each local rank talks to "its node's" daemon)::

    python examples/launcher_ranks.py --local-cluster 2      # starts the daemons, then runs torchrun

(without torchrun, ``--local-cluster`` starts the N processes itself with ``TRANSPORTD_JOB``,
``TRANSPORTD_RANK``, ``TRANSPORTD_WORLD`` and ``TRANSPORTD_LOCAL_RANK`` set: the same script, another launcher).

Each rank sends a buffer of its own pattern to the next rank (a ring) with one ``put_signal``, waits for
its predecessor's flag and checks every byte, then prints one line and leaves. Exit status 0 when every
byte arrived.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpuclient  # noqa: E402
from gpuclient.errors import LauncherError  # noqa: E402
from gpuclient.launcher import from_environment  # noqa: E402
from transportd.errors import TransportdError  # noqa: E402

SEND, RECV = 0, 1  # every rank registers its buffers in this order, so region ids agree across ranks


def pattern(rank: int, nbytes: int) -> np.ndarray:
    """The bytes rank ``rank`` sends: distinct per rank, so a misrouted buffer shows."""
    return ((np.arange(nbytes, dtype=np.uint64) * 131 + rank * 7 + 1) % 251).astype(np.uint8)


def run_rank(socket: str | None, nbytes: int, timeout: float) -> str:
    """One rank: join from the environment, send to the next rank, check what the previous one sent."""
    client = gpuclient.connect(socket, timeout=timeout)
    session = client.join()  # job, rank, world (and device = local rank) from the launcher's variables
    rank, world = session.rank, session.world
    send, recv = gpuclient.host_array(nbytes), gpuclient.host_array(nbytes)
    send[:] = pattern(rank, nbytes)
    regions = session.register(send), session.register(recv)
    assert [r.id for r in regions] == [SEND, RECV]
    session.flags(max(world, 1))
    session.exchange(timeout=timeout)
    ch = session.channel()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    if world > 1:
        ch.put_signal(peer=nxt, dst_region=RECV, dst_off=0, src_region=SEND, src_off=0, nbytes=nbytes,
                      slot=rank, value=1)
        ch.quiet(timeout=timeout)
        session.wait(slot=prev, at_least=1, timeout=timeout)
        bad = int(np.count_nonzero(recv != pattern(prev, nbytes)))
    else:
        bad = 0
    info = from_environment()
    line = (f"rank {rank}/{world} (job {session.job}, {info.launcher}, local rank {info.local_rank}, "
            f"node {client.info['node']}): {nbytes} bytes from rank {prev}: "
            + ("OK" if bad == 0 else f"{bad} bytes wrong"))
    session.leave()
    client.close()
    if bad:
        raise SystemExit(line)
    return line


@click.command()
@click.option("--sockets", default=None, metavar="S1,S2,...",
              help="control sockets, one per simulated node: local rank i uses socket i mod N "
                   "(default: $TRANSPORTD_SOCKET, else the node's daemon)")
@click.option("--bytes", "nbytes", type=click.IntRange(1, 1 << 30), default=1 << 20, show_default=True)
@click.option("--timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True)
@click.option("--local-cluster", type=click.IntRange(1, 8), default=None, metavar="N",
              help="start N daemons on this machine (softverbs) and run N processes against them (with torchrun "
                   "where it is installed, else with the TRANSPORTD_* variables)")
def main(sockets: str | None, nbytes: int, timeout: float, local_cluster: int | None) -> None:
    try:
        _main(sockets, nbytes, timeout, local_cluster)
    except (TransportdError, LauncherError, TimeoutError, RuntimeError, OSError) as exc:
        # what a user's setup causes (no daemon, no launcher variables, a peer that never came): one line
        click.echo(f"{Path(__file__).name}: {' '.join(str(exc).split())}", err=True)
        sys.exit(1)


def _main(sockets: str | None, nbytes: int, timeout: float, local_cluster: int | None) -> None:
    if local_cluster is not None:
        run_local_cluster(local_cluster, nbytes, timeout)
        return
    socket = None
    if sockets:
        names = [s for s in sockets.split(",") if s]
        local = from_environment().local_rank or 0
        socket = names[local % len(names)]
    click.echo(run_rank(socket, nbytes, timeout))


def run_local_cluster(nodes: int, nbytes: int, timeout: float) -> None:
    """Two (N) daemons here, then ``torchrun --standalone --nproc-per-node N`` of this script; without
    torchrun, N processes of it with the ``TRANSPORTD_*`` variables (job, rank, world, local rank) set."""
    from transportd_cli.localcluster import LocalCluster

    torchrun = shutil.which("torchrun")
    with LocalCluster(nodes) as cluster:
        sockets = ",".join(cluster.socket(n) for n in cluster.names)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSPORTD_")}
        args = [__file__, "--sockets", sockets, "--bytes", str(nbytes), "--timeout", str(timeout)]
        if torchrun is not None:
            status = subprocess.run([torchrun, "--standalone", f"--nproc-per-node={nodes}", *args], env=env).returncode
        else:
            click.echo(f"torchrun is not on PATH: starting the {nodes} ranks with TRANSPORTD_JOB, TRANSPORTD_RANK "
                       "and TRANSPORTD_WORLD instead")
            ranks = [subprocess.Popen([sys.executable, *args], env=env | {
                "TRANSPORTD_JOB": f"local-{os.getpid()}", "TRANSPORTD_RANK": str(rank),
                "TRANSPORTD_WORLD": str(nodes), "TRANSPORTD_LOCAL_RANK": str(rank)}) for rank in range(nodes)]
            status = max(p.wait() for p in ranks)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
