"""The imported-PD path on a real ConnectX (``-m hardware``): a client's DevX queue pair on a daemon's IBGDA
domain, the way ``session.channel(kind="ibgda")`` builds it, without the daemons around it.

    TPD_IBGDA_DEVICE=mlx5_0 pytest -m hardware tests/ibgda/test_import_hardware.py

The exporting side is ``ibgda.domain.ImportDomain`` (what a rail worker makes for a rank: a DevX context, a
PD, the rank's source region and a scratch page registered there); the importing side is
``ibgda.imported.ImportedDomain`` on a copy of the domain's command descriptor (``ibv_import_device``,
``ibv_import_pd`` through ``ibgda.devx``), whose queue pair (CQ, QP, UMEMs, UAR: DevX objects on the
imported context) connects in loopback to an ``Mlx5Queue`` on a context of its own holding the
destination and the flags. The device code compiled for the host posts put_signals from four threads and
rings the UAR; the destination, the flags and the QP state are checked. Both sides are in this process:
the import is the same call in another one.

Not run where this was written: that machine has no ConnectX. It skips, saying why, without pyverbs' mlx5
provider or a ConnectX.
"""

from __future__ import annotations

import numpy as np
import pytest

from ibgda.channel_tables import HostAlloc, build_channel
from ibgda.device_handle import QP_STATE_DTYPE, SignalMode
from tests.ibgda.test_host_mlx5 import mlx5_device
from tests.support.ibgda_link import NFLAGS, view

pytestmark = pytest.mark.hardware

BYTES = 1 << 20


@pytest.mark.parametrize("mode", [SignalMode.ATOMIC, SignalMode.WRITE])
def test_a_queue_pair_on_an_imported_domain_delivers(host_lib, mode: SignalMode) -> None:
    from ibgda.domain import ImportDomain
    from ibgda.host_mlx5 import Mlx5Queue
    from ibgda.imported import ImportedDomain
    from transportd.backends.verbs import load

    dev = mlx5_device()
    v = load("pyverbs")
    src = np.random.default_rng(2).integers(0, 256, BYTES, dtype=np.uint8)
    dst = np.zeros(BYTES, dtype=np.uint8)
    flags = np.zeros(NFLAGS, dtype=np.uint64)
    own = np.zeros(NFLAGS, dtype=np.uint64)
    domain = ImportDomain(v, dev)  # the daemon's side
    far = Mlx5Queue(dev, wqe_cnt=64, map_to_gpu=False)  # the peer's responder, on a context of its own
    imported = queue = None
    try:
        key = domain.register("src", int(src.ctypes.data), src.nbytes)
        grant = domain.grant()
        assert grant["nic"] == "mlx5" and grant["pd_handle"] == domain.pd.handle
        imported = ImportedDomain(grant, domain.command_fd())  # the client's side
        assert imported.devx.pdn > 0
        queue = imported.queue(64)
        assert queue.pd is None and queue.devx is imported.devx  # nothing of its own but its queue objects
        acc = 1 | 2 | 4 | 8  # LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC
        mr_dst = far.register(int(dst.ctypes.data), dst.nbytes, acc)
        mr_flags = far.register(int(flags.ctypes.data), flags.nbytes, acc)
        queue.connect(far.endpoint())
        far.connect(queue.endpoint())
        scratch, scratch_lkey = imported.scratch_slot()
        tables = build_channel(
            rank=0, world=2, alloc=HostAlloc(), signal_mode=mode, flags=int(own.ctypes.data), flag_count=NFLAGS,
            queue_pairs={1: queue.queue_pair(scratch, scratch_lkey, for_gpu=False)},
            local_regions=[(key["addr"], key["length"], key["lkey"])],
            remote_regions={1: [(int(dst.ctypes.data), dst.nbytes, mr_dst.rkey)]},
            remote_flags={1: (int(flags.ctypes.data), flags.nbytes, mr_flags.rkey)})
        ch = tables.record.ctypes.data
        host_lib.tpd_test_stress(ch, 1, 4, 64, 4096, 4)  # 4 threads x 64 put_signal + signal, 64-slot SQ
        assert host_lib.tpd_test_status(ch) == 0
        state = view(tables.qp_states[1], QP_STATE_DTYPE, 1)[0]
        assert int(state["posted"]) == int(state["done"]) and int(state["error"]) == 0
        assert [int(f) for f in flags[:5]] == [64] * 4 + [256]
        assert np.array_equal(dst[:4 * 64 * 4096], src[:4 * 64 * 4096])
    finally:
        if queue is not None:
            queue.close()
        if imported is not None:
            imported.close()
        far.close()
        domain.close()
