"""ibgda: the GPU-initiated backend — the GPU builds mlx5 WQEs and rings the NIC's doorbell itself.

* ``<transportd/ibgda/*.cuh>`` — the device side, in the device API's include root ``gpuclient.get_include()``
  (gpuclient/include/transportd/ibgda/): WQE builders, doorbells, CQ polling, multi-warp posting, and
  ``tpd::IbgdaChannel`` with the same calls as the proxy path.
* :mod:`ibgda.mlx5_layout` — the mlx5 segments and CQE64 as numpy dtypes; a strict WQE decoder.
* :mod:`ibgda.device_handle` — numpy twins of the device handles (QueuePair, QpState, Region, channel).
* :mod:`ibgda.soft_mlx5` — softverbs as an mlx5 device: executes those WQEs on the soft wire.
* :mod:`ibgda.host_mlx5` — QP, CQ and UAR for a real ConnectX through pyverbs' mlx5 provider (DevX).
* :mod:`ibgda.errors` — what ibgda raises (a WQE the NIC would refuse, a queue that failed) and the syndromes.
"""

from __future__ import annotations

__all__: list[str] = []
