"""AWS EFA SRD backend: write-with-immediate, flags published by the receiving daemon.

See :mod:`efa.wire` for the immediate and control-record layout and :mod:`efa.backend` for the verbs side;
when a flag may be published is the counting scheme's (``efa/csrc/efa_arrivals.c``, whose rules the model
:mod:`transportd_models.arrivals` states and the tests hold it to).
"""
