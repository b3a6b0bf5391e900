"""The PRM command encoding of ibgda.host_mlx5, on the CPU: big-endian bit numbering, fields inside
their structures and never overlapping, and a few fields pinned to the byte and bit the PRM gives."""

from __future__ import annotations

import random

import pytest

from ibgda import host_mlx5 as H

TABLES = {
    "create_cq_in": (H.CREATE_CQ_IN, H.CMD_BYTES * 8),
    "cqc": (H.CQC, 512),
    "create_qp_in": (H.CREATE_QP_IN, H.CMD_BYTES * 8),
    "modify_qp_in": (H.MODIFY_QP_IN, H.CMD_BYTES * 8),
    "qpc": (H.QPC, H.QPC_BITS),
    "out": (H.OUT, H.OUT_BYTES * 8),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_fields_fit_and_do_not_overlap(name: str) -> None:
    table, bits = TABLES[name]
    spans = sorted((bit, bit + width, field) for field, (bit, width) in table.items())
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        assert end <= start, f"{name}: {a} overlaps {b}"
    assert spans[-1][1] <= bits, f"{name}: {spans[-1][2]} runs past {bits} bits"


def test_contexts_sit_inside_their_commands() -> None:
    assert H.CQC_BIT + 512 <= H.CREATE_CQ_IN["cq_umem_offset"][0]
    assert H.QPC_BIT + H.QPC_BITS <= H.CREATE_QP_IN["wq_umem_offset"][0]
    assert H.QPC_BIT + H.QPC_BITS <= H.CMD_BYTES * 8


def test_set_get_round_trip() -> None:
    rng = random.Random(3)
    for _ in range(500):
        buf = bytearray(rng.randbytes(32))
        width = rng.randint(1, 64)
        bit = rng.randrange(0, 256 - width + 1)
        value = rng.getrandbits(width)
        before = bytearray(buf)
        H.prm_set(buf, bit, width, value)
        assert H.prm_get(buf, bit, width) == value
        mask = ((1 << width) - 1) << (256 - bit - width)
        assert int.from_bytes(buf, "big") & ~mask == int.from_bytes(before, "big") & ~mask, "neighbours untouched"
    with pytest.raises(ValueError):
        H.prm_set(bytearray(4), 0, 3, 8)


def test_fields_land_where_the_prm_puts_them() -> None:
    cmd = H.prm_encode(H.CMD_BYTES, {"opcode": H.OP_CREATE_QP, "log_sq_size": 8, "pd": 0xABCDEF, "cqn_snd": 0x123456,
                                     "rq_type": H.RQ_TYPE_ZERO_LEN, "wq_umem_valid": 1, "ads.rgid_rip": 1 << 127},
                       (0, H.CREATE_QP_IN), (H.QPC_BIT, H.QPC))
    assert len(cmd) == 272 and cmd[:2] == b"\x05\x00"
    qpc = cmd[24:24 + H.QPC_BITS // 8]
    assert qpc[5:8] == bytes.fromhex("abcdef"), "pd: qpc dword 1, low 24 bits"
    assert qpc[10] == 8 << 3, "log_sq_size: qpc dword 2, bits 14..11"
    assert qpc[125:128] == bytes.fromhex("123456"), "cqn_snd: qpc dword 31, low 24 bits"
    assert qpc[172] == 3, "rq_type: qpc dword 43, bits 26..24"
    assert qpc[40] == 0x80, "rgid_rip: the primary path's GID starts at qpc byte 40"
    assert cmd[268] == 0x80, "wq_umem_valid: dword 67, bit 31"
    cq = H.prm_encode(H.CMD_BYTES, {"opcode": H.OP_CREATE_CQ, "log_cq_size": 10, "uar_page": 0x77, "c_eqn": 5,
                                    "dbr_addr": 64, "cq_umem_valid": 1}, (0, H.CREATE_CQ_IN), (H.CQC_BIT, H.CQC))
    cqc = cq[16:80]
    assert cq[:2] == b"\x04\x00" and cqc[12] == 10 and cqc[13:16] == b"\x00\x00\x77" and cqc[23] == 5
    assert cqc[56:64] == (64).to_bytes(8, "big") and cq[92] == 0x80
    out = bytes.fromhex("00000000" "00000000" "00abcdef" "00000000")
    assert H._check_out("CREATE_QP", out) == 0xABCDEF
    with pytest.raises(H.Mlx5QueueError, match="syndrome 0x0000002a"):
        H._check_out("CREATE_QP", bytes.fromhex("05000000" "0000002a" "00000000" "00000000"))


def test_unknown_field_is_refused() -> None:
    with pytest.raises(KeyError, match="no_such"):
        H.prm_encode(16, {"no_such": 1}, (0, H.OUT))
