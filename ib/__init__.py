"""ConnectX-7 / InfiniBand RC backend: one RC QP per connection, flags written by the NIC.

See :mod:`ib.backend` for the signal modes and what each needs from the fabric.
"""

from ib.backend import SIGNAL_MODES, IbBackend

__all__ = ["SIGNAL_MODES", "IbBackend"]
