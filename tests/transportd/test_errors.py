"""Error classes: who is at fault, stable text, survive pickling; ErrorCode is a stable ABI."""

from __future__ import annotations

import os
import pickle
import stat

import pytest

from transportd.control.curve import generate_keypair, load_public_key, load_secret_keypair
from transportd.errors import (
    ConfigError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    ErrorCode,
    LocalProtocolError,
    PeerDeadError,
    PeerError,
    ProtocolError,
    RemoteProtocolError,
    RequestError,
    TransportdError,
    error_code_c_enum,
)

SAMPLES = [
    ConfigError("/etc/t.toml", "proxy.batch_max", "must be in [1, 8], got 9"),
    LocalProtocolError("join: field 'rank': missing", code="bad_field", field="rank"),
    RemoteProtocolError("message too big", code="too_large"),
    RequestError("bad_state", "join a job first"),
    PeerError("node-b", "malformed peer_regions"),
    PeerDeadError("node-b", "no heartbeat for 5.0 s"),
    DaemonUnavailableError("ipc:///x.sock", "transportd is not running at ipc:///x.sock"),
    DaemonTimeoutError("ipc:///x.sock", "no reply"),
]


@pytest.mark.parametrize("err", SAMPLES, ids=lambda e: type(e).__name__)
def test_errors_share_a_base_and_pickle(err):
    assert isinstance(err, TransportdError)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err) and str(copy) == str(err) and copy.__dict__ == err.__dict__


def test_error_texts():
    assert str(SAMPLES[0]) == "/etc/t.toml: proxy.batch_max: must be in [1, 8], got 9"
    assert str(SAMPLES[3]) == "bad_state: join a job first"
    assert str(SAMPLES[4]) == "peer node-b: malformed peer_regions"
    assert isinstance(SAMPLES[1], ProtocolError) and isinstance(SAMPLES[5], PeerError)
    assert isinstance(SAMPLES[7], DaemonUnavailableError)


# The values are ABI shared with the CUDA header: changing one is a breaking change, so pin them here.
PINNED = {
    "OK": 0, "BAD_OPCODE": 1, "BAD_PEER": 2, "BAD_REGION": 3, "OUT_OF_BOUNDS": 4, "BAD_LENGTH": 5,
    "BAD_SLOT": 6, "CLIENT_GONE": 7, "PEER_LOST": 8, "REMOTE_ACCESS": 9, "TRANSPORT": 10,
    "BAD_ALIGNMENT": 11, "BAD_RECORD": 12, "NO_ACCESS": 13, "INTERNAL": 255,
}


def test_error_codes_are_pinned_and_documented():
    assert {c.name: int(c) for c in ErrorCode} == PINNED
    for code in ErrorCode:
        assert code.__doc__ and code.__doc__ != ErrorCode.__doc__, code.name
        assert 0 <= code < 1 << 16
    assert ErrorCode(4) is ErrorCode.OUT_OF_BOUNDS


def test_c_enum_text():
    text = error_code_c_enum()
    assert text.startswith("enum tpd_error_code {")
    for code in ErrorCode:
        assert f"TPD_ERR_{code.name} = {int(code)}," in text


def test_generated_keypair(tmp_path):
    public, secret = generate_keypair(tmp_path / "keys", "node")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pub, sec = load_secret_keypair(secret)
    assert load_public_key(public) == pub and len(pub) == len(sec) == 40
    with pytest.raises(ValueError, match="no secret key"):
        load_secret_keypair(public)
