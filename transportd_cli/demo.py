"""`transportd demo`: two nodes on this machine over softverbs, one client each, data and flags verified.

Rank 0 (node a) and rank 1 (node b) each stream ``total`` bytes to the other in ``chunk``-sized
PUT_SIGNALs; every chunk adds 1 to the receiver's flag 0. The receiver checks each chunk as soon as the
flag says it has arrived — so a flag seen before its data would fail the demo — and finally every
byte. No NIC, no GPU and no root needed.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import gpuclient
from transportd.backends import TRAITS
from transportd_cli.localcluster import LocalCluster

__all__ = ["run_demo"]


def _counters(stats: dict[str, Any]) -> dict[str, int]:
    keys = ("commands", "bytes", "signals", "batches_full", "batches_partial")
    rails = [r for r in stats["rails"] if "error" not in r]
    return {k: sum(int(r.get(k, 0)) for r in rails) for k in keys}


def run_demo(total: int = 256 << 20, chunk: int = 1 << 20, backend: str = "ib", signal_mode: str = "write",
             echo: Any = print) -> dict[str, Any]:
    """Run the demo; returns the report (raises AssertionError if any byte or flag is wrong)."""
    if total < 1 or chunk < 1 or total % chunk:
        raise ValueError(f"total ({total}) and chunk ({chunk}) must be positive, total a multiple of chunk")
    chunks = total // chunk
    overrides = {"signal": {"mode": signal_mode}}
    with LocalCluster(2, backend=backend, overrides=overrides) as cluster:
        how = ("flags published by the receiving daemon" if TRAITS[backend].publishes_flags
               else f"signal mode {signal_mode}")
        echo(f"started 2 daemons ({backend} over softverbs, {how}) in {cluster.workdir}")
        clients = [gpuclient.connect(cluster.socket(n)) for n in cluster.names]
        sessions = [c.join("demo", rank=i, world=2) for i, c in enumerate(clients)]
        rng = np.random.default_rng(2024)
        send = [gpuclient.host_array(total) for _ in sessions]
        recv = [gpuclient.host_array(total) for _ in sessions]
        for buf in send:
            buf[:] = rng.integers(0, 256, total, dtype=np.uint8)
        src = [s.register(b) for s, b in zip(sessions, send, strict=True)]
        dst = [s.register(b) for s, b in zip(sessions, recv, strict=True)]
        for s in sessions:
            s.flags(16)
        gpuclient.exchange_all(sessions)
        channels = [s.channel(capacity=1024) for s in sessions]
        t0 = time.perf_counter()
        sent = [0, 0]
        seen = [0, 0]
        window = 64
        while min(seen) < chunks:
            for me in (0, 1):
                peer = 1 - me
                while sent[me] < chunks and sent[me] - seen[peer] < window:
                    off = sent[me] * chunk
                    channels[me].put_signal(peer=peer, dst_region=dst[peer].id, dst_off=off,
                                            src_region=src[me].id, src_off=off, nbytes=chunk, slot=0, value=1)
                    sent[me] += 1
            for me in (0, 1):
                peer = 1 - me
                flag = sessions[me].flag_array[0]
                while seen[me] < flag:
                    off = seen[me] * chunk
                    if not np.array_equal(recv[me][off : off + chunk], send[peer][off : off + chunk]):
                        bad = np.flatnonzero(recv[me][off : off + chunk] != send[peer][off : off + chunk])
                        time.sleep(0.5)
                        late = np.array_equal(recv[me][off : off + chunk], send[peer][off : off + chunk])
                        raise AssertionError(f"rank {me}: chunk {seen[me]} differs although its flag arrived "
                                             f"(flag {flag}, {bad.size} bytes from {bad[0]} to {bad[-1]}, "
                                             f"complete 0.5 s later: {late})")
                    seen[me] += 1
                if seen[me] < chunks and sent[peer] == chunks:
                    sessions[me].wait(slot=0, at_least=seen[me] + 1, timeout=30)
        elapsed = time.perf_counter() - t0
        for ch in channels:
            ch.quiet(timeout=30)
        for me in (0, 1):
            assert np.array_equal(recv[me], send[1 - me]), f"rank {me}: received data differs"
            assert sessions[me].flag_array[0] == chunks, f"rank {me}: flag is {sessions[me].flag_array[0]}"
        totals = [_counters(c.stats()) for c in clients]
        report = {
            "bytes": 2 * total,
            "chunks": 2 * chunks,
            "elapsed_s": elapsed,
            "gbytes_per_s": 2 * total / elapsed / 1e9,
            "commands": sum(t["commands"] for t in totals),
            "batches": sum(t["batches_full"] + t["batches_partial"] for t in totals),
            "signals": sum(t["signals"] for t in totals),
        }
        for s in sessions:
            s.leave()
        for c in clients:
            c.close()
    echo(f"moved {report['bytes'] / 2**20:.0f} MiB in {report['chunks']} chunks, both ways, every byte and "
         f"flag verified")
    echo(f"commands {report['commands']}, batches {report['batches']}, signals {report['signals']}, "
         f"elapsed {elapsed:.2f} s ({report['gbytes_per_s']:.2f} GB/s)")
    return report
