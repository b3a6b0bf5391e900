"""cmd_ring: the contract between a client and the daemon — everything both sides must agree on, and nothing else.

- the 48-byte command record and the shared-memory ring that carries it (``record``, ``ring``; the ring knows
  nothing about RDMA: producers commit records, one consumer, a proxy worker, takes them);
- memfd plumbing (``shm``) and the flag file's layout (``flagfile``);
- errors and the channel error word's codes (``errors``: ``ErrorCode``, ``TransportdError`` and its family);
- the control protocol, sans-IO (``protocol``, with its ``schema`` mechanism and shared ``limits``), its
  msgpack ``codec``, and where a client finds the daemon (``endpoints``);
- the C include root ``cmd_ring/include``: ``<transportd/cmd_ring.h>`` (the record's C twin) and
  ``<transportd/errors.h>`` (generated from ``ErrorCode``: the one ``tpd_error_code`` enum). The daemon's core
  (setup.py) and the device API (``gpuclient.get_include_dirs()``) both put it on their include paths.

Why here and not a new package: the top level is fixed by the product's design card, and this package already
was the bottom layer both sides import, holding the record, the ring and the memfd plumbing; the rest of the
contract joined it. It imports nothing of ``transportd`` or ``gpuclient`` (tests/test_import_layers.py), so
``import gpuclient`` loads none of the daemon's rooms. The moved modules keep their old names
(``transportd.errors``, ``transportd.control.protocol``, ...) as aliases of the same module objects.
"""

from cmd_ring.errors import RingError, RingFullError, RingLayoutError, RingNotFoundError
from cmd_ring.record import (
    BODY_FIELDS,
    HEADER_FIELDS,
    RECORD_DTYPE,
    RECORD_SIZE,
    Command,
    Flag,
    Opcode,
    decode,
    encode,
    records_from_commands,
    seq_array,
    seq_for,
)
from cmd_ring.ring import RingConsumer, RingFile, RingProducer, ring_path

__all__ = [
    "BODY_FIELDS",
    "HEADER_FIELDS",
    "RECORD_DTYPE",
    "RECORD_SIZE",
    "Command",
    "Flag",
    "Opcode",
    "RingConsumer",
    "RingError",
    "RingFile",
    "RingFullError",
    "RingLayoutError",
    "RingNotFoundError",
    "RingProducer",
    "decode",
    "encode",
    "records_from_commands",
    "ring_path",
    "seq_array",
    "seq_for",
]
