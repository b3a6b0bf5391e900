"""What the test folders share. A conftest.py holds only fixtures and hooks; the helpers they and the tests
import live here, one module per kind of thing:

- ``waiting``: ``wait_until``, the one bounded wait every test uses (poll a condition, fail instead of hang).
- ``cluster``: real daemons (``LocalCluster``) and the ranks that join them; a killable client script.
- ``users``: the second uid the identity tests run clients as.
- ``ctl``: ``transportctl`` in this process or as the installed script.
- ``ops_cluster``: the operations tests' shared two-node cluster: its known traffic and handle.
- ``peer_planes``: peer planes over real zmq sockets with their events logged, and a pump.
- ``ib_link``, ``efa_link``: two backend "nodes" in one process over soft devices (tests/ib, tests/efa).
- ``ibgda_link``: soft mlx5 queues driven from the host through the device header (tests/ibgda).
- ``verbs_resources``: rdma-core-style verbs resources (RC and SRD pairs, polling, errno checks) for
  the conformance and softverbs tests, against softverbs or a real NIC.
- ``soft_backend``: the softverbs namespace fixture the ib, efa and ibgda conftests re-export.
- ``node_process``: a test node in its own process, spoken to in JSON lines (the multi-process tests).
- ``rank_process``: a GPU rank in its own process, driven a JSON step at a time (tests/gpu).
- ``cuda``: why GPU tests skip here (no CUDA device, no cuda-python).
- ``nvrtc``: the NVRTC module, or a skip saying what to install.
- ``mps``: the run's private CUDA MPS daemon, as pytest hooks the GPU folders' conftests re-export.
"""
