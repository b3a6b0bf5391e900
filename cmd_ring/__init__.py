"""cmd_ring: the 48-byte command record and the shared-memory ring that carries it.

The ring knows nothing about RDMA: producers (GPU kernels, CPU clients) commit records, one consumer
(a proxy worker) takes them. See ``record`` for the layout and ``ring`` for the commit protocol. The C
twin of the layout, ``<transportd/cmd_ring.h>``, lives with every other device header under
``gpuclient.get_include()`` (gpuclient/include/transportd/cmd_ring.h).
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
