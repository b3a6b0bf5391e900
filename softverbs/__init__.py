"""softverbs: a software RDMA provider with the pyverbs subset transportd's backends use.

The modules mirror pyverbs' layout (`softverbs.device`, `.pd`, `.mr`, `.cq`, `.qp`, `.wr`, `.addr`,
`.libibverbs_enums`, `.pyverbs_error`, `.providers.efa.efadv`) with pyverbs' names and semantics, so a
backend runs unchanged on either. Soft devices in different processes talk over TCP. The provider keeps
the hardware's rules (ordering, EFA validation, keys and access flags, queue depths) so a backend that would
misbehave on a ConnectX-7 or an EFA device fails here too. Soft-only knobs live in `softverbs.soft`.

Behind the mirrored classes, the engine keeps one role per private module, imported one way: `_wire`
(frames), `_ibv` (verbs values), `_memory` (host views, accessors), `_direct` (direct placement between
processes on one host: the copier, exports and imports) and `_link` (the NIC model's schedule) at the
bottom, then `_mr`, `_cq`, `_requester` and `_responder` (the two halves of a QP and the device's frame
handlers), `_qp` (a QP: both halves and the error state), and `_device` (sockets, the I/O thread, QP and
MR tables, the departure queue).
"""

__all__: list[str] = []
