"""The C header and the numpy dtype must agree byte for byte: compile a probe and compare. The header,
``<transportd/cmd_ring.h>``, sits in the contract's C root, ``cmd_ring/include``, which both the daemon's core and
the device API (``gpuclient.get_include_dirs()``) put on their include paths; the probe uses that root alone."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import cmd_ring
from cmd_ring import RECORD_DTYPE, Flag, Opcode
from cmd_ring import ring as ring_mod

CONTRACT_INCLUDE = str(Path(cmd_ring.__file__).parent / "include")

FIELDS = RECORD_DTYPE.names
CONTROL = {
    "MAGIC": ring_mod.OFF_MAGIC,
    "VERSION": ring_mod.OFF_VERSION,
    "RECORD_SIZE": ring_mod.OFF_RECORD_SIZE,
    "CAPACITY": ring_mod.OFF_CAPACITY,
    "TOTAL_SIZE": ring_mod.OFF_TOTAL_SIZE,
    "CONSUMER_POS": ring_mod.OFF_CONSUMER_POS,
    "PRODUCER_POS": ring_mod.OFF_PRODUCER_POS,
    "COMPLETION_POS": ring_mod.OFF_COMPLETION_POS,
    "ERROR_CODE": ring_mod.OFF_ERROR_CODE,
    "ERROR_COUNT": ring_mod.OFF_ERROR_COUNT,
    "ERROR_POS": ring_mod.OFF_ERROR_POS,
}


def probe_source() -> str:
    lines = [
        "#include <stdio.h>",
        "#include <transportd/cmd_ring.h>",
        "int main(void) {",
        '  printf("sizeof %zu\\n", sizeof(tpd_cmd_record));',
    ]
    for f in FIELDS:
        lines.append(f'  printf("offset.{f} %zu\\n", offsetof(tpd_cmd_record, {f}));')
        lines.append(f'  printf("size.{f} %zu\\n", sizeof(((tpd_cmd_record*)0)->{f}));')
    for op in Opcode:
        lines.append(f'  printf("op.{op.name} %d\\n", TPD_OP_{op.name});')
    for flag in (Flag.SIGNAL_SET, Flag.NO_BATCH):
        lines.append(f'  printf("flag.{flag.name} %d\\n", TPD_FLAG_{flag.name});')
    for name in CONTROL:
        lines.append(f'  printf("ctl.{name} %d\\n", (int)TPD_RING_OFF_{name});')
    lines += [
        '  printf("ctl.RECORDS %d\\n", (int)TPD_RING_RECORDS_OFFSET);',
        '  printf("magic %llu\\n", (unsigned long long)TPD_RING_MAGIC);',
        '  printf("version %u\\n", (unsigned)TPD_RING_VERSION);',
        "  return 0;",
        "}",
    ]
    return "\n".join(lines) + "\n"


def expected() -> dict[str, int]:
    out = {"sizeof": RECORD_DTYPE.itemsize}
    for f in FIELDS:
        dtype, offset = RECORD_DTYPE.fields[f][:2]
        out[f"offset.{f}"] = offset
        out[f"size.{f}"] = dtype.itemsize
    out.update({f"op.{op.name}": int(op) for op in Opcode})
    out.update({f"flag.{f.name}": int(f) for f in (Flag.SIGNAL_SET, Flag.NO_BATCH)})
    out.update({f"ctl.{k}": v for k, v in CONTROL.items()})
    out["ctl.RECORDS"] = ring_mod.CONTROL_BYTES
    out["magic"] = ring_mod.MAGIC
    out["version"] = ring_mod.VERSION
    return out


def parse(output: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^(\S+) (\d+)$", output, re.M)}


def test_c_probe_agrees_with_numpy(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is required for the layout test (CI installs build-essential)"
    src = tmp_path / "probe.c"
    src.write_text(probe_source())
    exe = tmp_path / "probe"
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", "-I", CONTRACT_INCLUDE, str(src), "-o", str(exe)],
                   check=True)
    assert parse(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout) == expected()


def test_header_compiles_as_cuda_with_nvcc(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc") or (Path("/usr/local/cuda/bin/nvcc") if Path("/usr/local/cuda/bin/nvcc").exists()
                                     else None)
    if not nvcc:
        pytest.skip("nvcc not found: the CUDA compile check runs where the CUDA toolkit is installed")
    src = tmp_path / "probe.cu"
    src.write_text(probe_source() + "__global__ void touch(tpd_cmd_record* r) { r->seq = TPD_OP_PUT; }\n")
    exe = tmp_path / "probe_cuda"
    subprocess.run([str(nvcc), "-arch=sm_90", "-I", CONTRACT_INCLUDE, str(src), "-o", str(exe)], check=True)
    # Host code compiled by nvcc's host pass must see the same layout.
    assert parse(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout) == expected()


def test_c_static_asserts_catch_a_drifted_layout(tmp_path: Path) -> None:
    # The header's own static_asserts must fire when a field moves: prove they are live.
    cc = shutil.which("cc") or shutil.which("gcc")
    header = (Path(CONTRACT_INCLUDE) / "transportd" / "cmd_ring.h").read_text()
    drifted = header.replace("    uint16_t peer;\n", "    uint16_t peer;\n    uint32_t extra;\n")
    assert drifted != header
    inc = tmp_path / "transportd"
    inc.mkdir()
    (inc / "cmd_ring.h").write_text(drifted)
    src = tmp_path / "t.c"
    src.write_text("#include <transportd/cmd_ring.h>\nint main(void){return 0;}\n")
    result = subprocess.run([cc, "-std=c99", "-I", str(tmp_path), str(src), "-o", str(tmp_path / "t")],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "48 bytes" in result.stderr
