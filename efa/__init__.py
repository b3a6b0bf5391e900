"""AWS EFA SRD backend: write-with-immediate, flags published by the receiving daemon.

See :mod:`efa.wire` for the immediate and control-record layout, :mod:`efa.arrivals` for when a flag is
published, and :mod:`efa.backend` for the verbs side.
"""

from efa.arrivals import ArrivalTracker, FlagUpdate, SenderGroups

__all__ = ["ArrivalTracker", "FlagUpdate", "SenderGroups"]
