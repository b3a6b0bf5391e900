"""What the test folders share; a conftest.py holds only fixtures and hooks, and imports its helpers from here.

- ``waiting``: ``wait_until``, the one bounded wait every test uses (poll a condition, fail instead of hang).
- ``cuda``: why GPU tests skip here (no CUDA device, no cuda-python).
- ``nvrtc``: the NVRTC module, or a skip saying what to install.
- ``mps``: the run's private CUDA MPS daemon, as pytest hooks the GPU folders' conftests re-export.
- ``soft_backend``: the softverbs namespace fixture the ib and efa backend tests share.
- ``node_process``: a test node in its own process, spoken to in JSON lines (the multi-process tests).
"""
