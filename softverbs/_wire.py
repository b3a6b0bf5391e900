"""Frame layout between soft devices (TCP, little-endian).

A frame is a 16-byte header, `count` fixed-size descriptors, then the payload bytes of the descriptors that
carry data, concatenated in descriptor order. Requests (REQ) go from a requester QP's device to the
responder's device on the requester's connection; responses (RSP: acks, NAKs, read data, atomic results)
come back on the same connection. Many work requests share one frame, so a batch costs one syscall.

    header  | magic u16 | kind u8 | flags u8 | count u32 | payload_len u64 |
    REQ     | dst_qpn u32 | src_qpn u32 | seq u64 | op u8 | flags u8 | mtu u16 | imm u32 | rkey u32 |
            | qkey u32 | raddr u64 | length u32 | psn u32 | add u64 | swap u64 |                 (64 B)
    RSP     | qpn u32 | status u8 | op u8 | rsv u16 | seq u64 | length u32 | rsv u32 | value u64 |  (32 B)

`seq` names the request within its requester QP; RSP echoes it (an OP_ACK response acknowledges the
`length` consecutive requests starting at `seq`, so a batch of writes costs one response). `status` is
an ibv_wc_status value for the requester's completion. REQ `flags`: bit 0 adaptive routing (reorder
packets), bits 1-3 the requester's rnr_retry, bit 4 the requester is an SRD QP, bit 5 a direct write: no
payload follows, `add` names the source (an export id the responder has opened, see `softverbs._direct`)
and `swap` the offset of the bytes in it. An SRD direct write from a shaped device carries its modeled landing
in `psn` (`land_field`): it leaves as its first byte lands, and the responder reports it only once it has.

Control frames carry no descriptors (`count` is their argument) and are never batched with others:

    HELLO     requester -> responder, first on a connection: count = the sender device's LID (its port)
    IMPORT    requester -> responder: count = export id, payload = `softverbs._direct` import record
    IMPORTED  responder -> requester: count = export id, flags = 1 opened / 0 refused
    FORGET    requester -> responder: count = export id (its last MR is gone: close it)
"""

from __future__ import annotations

import struct

MAGIC = 0x5356
HDR = struct.Struct("<HBBIQ")
REQ = struct.Struct("<IIQBBHIIIQIIQQ")
RSP = struct.Struct("<IBBHQIIQ")
assert HDR.size == 16 and REQ.size == 64 and RSP.size == 32

KIND_REQ = 1
KIND_RSP = 2
KIND_HELLO = 3  # first frame on a connection: count = the sender device's LID (its TCP port)
KIND_IMPORT = 4
KIND_IMPORTED = 5
KIND_FORGET = 6
CONTROL_KINDS = frozenset((KIND_HELLO, KIND_IMPORT, KIND_IMPORTED, KIND_FORGET))
MAX_CONTROL_PAYLOAD = 4096

OP_ACK = 0  # RSP only: `length` consecutive requests from `seq` on completed successfully
OP_WRITE = 1
OP_WRITE_IMM = 2
OP_SEND = 3
OP_SEND_IMM = 4
OP_READ = 5
OP_FADD = 6
OP_CSWAP = 7

DATA_OPS = frozenset((OP_WRITE, OP_WRITE_IMM, OP_SEND, OP_SEND_IMM))
RECV_OPS = frozenset((OP_WRITE_IMM, OP_SEND, OP_SEND_IMM))  # consume a receive WR at the responder
RD_ATOMIC_OPS = frozenset((OP_READ, OP_FADD, OP_CSWAP))

F_AR = 1
F_SRD = 1 << 4
F_DIRECT = 1 << 5
RNR_SHIFT = 1

MAX_DESCS_PER_FRAME = 4096
#: the frame kind each role of a connection receives: requests on the responder's, responses on the requester's
KIND_RECEIVED = {"rsp": KIND_REQ, "req": KIND_RSP}


def frame_refusal(magic: int, kind: int, count: int, role: str) -> str | None:
    """Why a REQ/RSP frame header received on a connection of ``role`` breaks the framing, or None.

    A sender never puts more than MAX_DESCS_PER_FRAME descriptors in a frame, so a larger count is refused
    before anything is buffered for it.
    """
    if magic != MAGIC:
        return f"magic {magic:#06x}"
    if kind != KIND_RECEIVED[role]:
        return f"kind {kind} on a {role} connection"
    if count > MAX_DESCS_PER_FRAME:
        return f"{count} descriptors (at most {MAX_DESCS_PER_FRAME})"
    return None

#: a landing time as an SRD direct write's descriptor carries it in its psn field: µs of the host's monotonic
#: clock, modulo 2**32 (direct writes stay on one host, so both ends read the same clock)
_LAND_WRAP = 1 << 32


def land_field(land: float) -> int:
    return int(land * 1e6) % _LAND_WRAP or 1  # 0 says "no landing to wait for"


#: the furthest ahead of its arrival a peer's landing is believed: a request the link model queues longer than
#: this is a broken peer's field, and the responder would hold the completion (and what follows it) that long
LAND_AHEAD_MAX_S = 10.0


def land_from_field(field: int, now: float) -> float:
    """The landing time ``land_field`` encoded, read against ``now`` (within 35 minutes of it), at most
    ``LAND_AHEAD_MAX_S`` ahead of ``now``."""
    delta = (field - int(now * 1e6) + (_LAND_WRAP >> 1)) % _LAND_WRAP - (_LAND_WRAP >> 1)
    return now + min(delta / 1e6, LAND_AHEAD_MAX_S)


MASK64 = (1 << 64) - 1  # the u64 fields (add, swap, value) wrap as the hardware's 64-bit atomics do
