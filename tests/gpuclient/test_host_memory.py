"""host_array's registry of memfds: a mapping collected while the registry is in use is still released."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# An array that only the cycle collector frees, collected while this thread holds the registry (as an
# allocation inside resolve_host_buffer's or host_array's locked section can make it happen): its
# finalizer must neither wait for the lock this thread holds nor be lost.
COLLECTED_INSIDE = """
    import gc, os
    from gpuclient import host_memory as hm

    def memfds():
        out = 0
        for name in os.listdir("/proc/self/fd"):
            try:
                out += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:")
            except OSError:
                pass  # the listing's own descriptor
        return out

    keep = hm.host_array(4096)
    baseline = memfds()
    for _ in range(3):
        a = hm.host_array(4096)
        cycle = [a]
        cycle.append(cycle)
        del a, cycle
        with hm._registry():
            gc.collect()
    print(len(hm._mappings), memfds() - baseline, hm.resolve_host_buffer(keep).nbytes)
"""


def test_a_mapping_collected_inside_the_registry_neither_deadlocks_nor_leaks() -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(COLLECTED_INSIDE)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # the deadlock this guards against would hang forever
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "4096"]  # only `keep` is left, and no descriptor of the others
