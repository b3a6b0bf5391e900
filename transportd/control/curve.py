"""CURVE keys and authentication for zmq sockets that cross the machine boundary.

Peer daemons (and control clients reaching a daemon over tcp) authenticate with CURVE: each side has a
keypair in zmq's certificate format; a server accepts only clients whose public key sits in the configured
authorized-keys directory, checked by a ZAP authenticator thread. An unauthorised client gets no reply at
all (zmq drops the handshake), so it sees a timeout rather than an error message.

ZAP is per zmq context: run one :func:`start_authenticator` per context that has CURVE server sockets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from cmd_ring.errors import ConfigError

if TYPE_CHECKING:  # an annotation only: a client loading this module never loads the daemon's config
    from transportd.config import SecurityConfig

__all__ = [
    "CurveClientKeys",
    "CurveServerKeys",
    "configure_client",
    "configure_server",
    "generate_keypair",
    "load_public_key",
    "load_secret_keypair",
    "start_authenticator",
]


def generate_keypair(directory: str | os.PathLike[str], name: str = "transportd", *,
                     force: bool = False) -> tuple[Path, Path]:
    """Write ``<name>.key`` (public) and ``<name>.key_secret`` (mode 0600) into ``directory``.

    Returns ``(public_file, secret_file)``. Copy the public file into every peer's authorized-keys dir.
    Existing key files are refused (``FileExistsError``: a node's identity replaced by accident locks it
    out of every peer that trusts the old key) unless ``force``.
    """
    if not force:
        existing = [str(p) for p in (Path(directory) / f"{name}.key", Path(directory) / f"{name}.key_secret")
                    if p.exists()]
        if existing:
            raise FileExistsError(f"{' and '.join(existing)} exist already: keep them, or replace them on purpose "
                                  "(force; `transportd keygen --force`) and give every peer the new public key")
    os.makedirs(directory, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The Z85 public key from a certificate file (public or secret)."""
    public, _secret = zmq.auth.load_certificate(path)
    return public


def load_secret_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` from a secret certificate file; refuses a public-only file."""
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (it is a public certificate)")
    return public, secret


@dataclass(frozen=True)
class CurveServerKeys:
    """A server's keypair and the directory of client public keys it accepts."""

    public: bytes
    secret: bytes
    authorized_keys_dir: str

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], authorized_keys_dir: str | os.PathLike[str]
                   ) -> CurveServerKeys:
        """Load the server keypair from its secret certificate file."""
        public, secret = load_secret_keypair(secret_file)
        return cls(public, secret, os.fspath(authorized_keys_dir))

    @classmethod
    def from_config(cls, security: SecurityConfig, source: str = "<config>") -> CurveServerKeys | None:
        """The keys named in ``[security]``, or None when CURVE is not configured."""
        if not security.curve_enabled:
            return None
        assert security.curve_secret_key_file is not None
        if security.curve_authorized_keys_dir is None:
            raise ConfigError(source, "security.curve_authorized_keys_dir", "required with a secret key")
        try:
            return cls.from_files(security.curve_secret_key_file, security.curve_authorized_keys_dir)
        except (OSError, ValueError) as exc:
            raise ConfigError(source, "security.curve_secret_key_file", str(exc)) from exc


@dataclass(frozen=True)
class CurveClientKeys:
    """A client's keypair and the public key of the server it expects to reach."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def from_files(cls, secret_file: str | os.PathLike[str], server_public_file: str | os.PathLike[str]
                   ) -> CurveClientKeys:
        """Load the client keypair and the server's public key from certificate files."""
        public, secret = load_secret_keypair(secret_file)
        return cls(public, secret, load_public_key(server_public_file))


def configure_server(sock: zmq.Socket, keys: CurveServerKeys) -> None:
    """Make ``sock`` a CURVE server (call before bind)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def configure_client(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server with ``keys.server_public`` (call before connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def start_authenticator(context: zmq.Context, authorized_keys_dir: str | os.PathLike[str]) -> ThreadAuthenticator:
    """Start a ZAP thread on ``context`` accepting only the public keys in ``authorized_keys_dir``.

    The caller owns the result and calls ``stop()`` on shutdown. Key files added later are seen after
    another ``configure_curve`` call (the directory is read once).
    """
    directory = os.fspath(authorized_keys_dir)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"authorized keys directory {directory} does not exist")
    auth = ThreadAuthenticator(context)
    auth.start()
    try:
        auth.configure_curve(domain="*", location=directory)
    except BaseException:
        auth.stop()
        raise
    return auth
