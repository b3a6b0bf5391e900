"""cmd_ring: the 48-byte command record and the shared-memory ring that carries it.

The ring knows nothing about RDMA: producers (GPU kernels, CPU clients) commit records, one consumer
(a proxy worker) takes them. See ``record`` for the layout and ``ring`` for the commit protocol.
"""

from pathlib import Path

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
    "get_include",
    "records_from_commands",
    "ring_path",
    "seq_array",
    "seq_for",
]


def get_include() -> str:
    """The directory to add to the include path for ``transportd/cmd_ring.h``."""
    return str(Path(__file__).parent / "include")
