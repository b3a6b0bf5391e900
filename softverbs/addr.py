"""Addressing (pyverbs.addr): GIDs, global routes, address-handle attributes and address handles.

A soft GID names a device's TCP endpoint: bytes 12-15 hold the IPv4 address, bytes 10-11 are ffff (the
IPv4-mapped form) and bytes 8-9 the TCP port, e.g. `0000:0000:0000:0000:9c41:ffff:7f00:0001` for
127.0.0.1:40001. The LID is the port too, so an RC peer can be reached by GID or, on the same host, by LID.
"""

from __future__ import annotations

import errno
import ipaddress
from typing import Any

from ._base import SoftCM, SoftObject
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

__all__ = ["AH", "AHAttr", "GID", "GlobalRoute"]


def _gid_bytes(val: str) -> bytes:
    parts = val.split(":")
    if len(parts) != 8 or any(len(p) != 4 for p in parts):
        raise PyverbsUserError(f"Invalid GID value ({parts})")
    try:
        return bytes.fromhex("".join(parts))
    except ValueError as exc:
        raise PyverbsUserError(f"Invalid GID value ({parts})") from exc


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def gid_for_endpoint(host: str, port: int) -> str:
    """The soft GID string of a device listening on host:port (IPv4)."""
    ip = ipaddress.IPv4Address(host).packed
    return _gid_str(bytes(8) + port.to_bytes(2, "big") + b"\xff\xff" + ip)


def endpoint_from_gid(gid: str | bytes) -> tuple[str, int] | None:
    """(host, port) named by a soft GID, or None if the GID is not one."""
    raw = _gid_bytes(gid) if isinstance(gid, str) else gid
    if len(raw) != 16 or raw[10:12] != b"\xff\xff" or any(raw[:8]):
        return None
    port = int.from_bytes(raw[8:10], "big")
    return str(ipaddress.IPv4Address(raw[12:16])), port


class GID(SoftObject):
    """A 16-byte GID; `gid` reads and sets it as 'xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx'."""

    __slots__ = ("_raw",)

    def __init__(self, val: str | None = None) -> None:
        super().__init__()
        self._raw = bytes(16) if val is None else _gid_bytes(val)

    @property
    def gid(self) -> str:
        return _gid_str(self._raw)

    @gid.setter
    def gid(self, val: str) -> None:
        self._raw = _gid_bytes(val)

    def __str__(self) -> str:
        return _gid_str(self._raw)


class GlobalRoute(SoftObject):
    """ibv_global_route: the GRH fields of an address (dgid is kept as raw bytes)."""

    __slots__ = ("_dgid", "flow_label", "sgid_index", "hop_limit", "traffic_class")

    def __init__(self, dgid: GID | None = None, flow_label: int = 0, sgid_index: int = 0, hop_limit: int = 1,
                 traffic_class: int = 0) -> None:
        super().__init__()
        if dgid is None:
            raise PyverbsUserError("GlobalRoute needs a dgid")  # pyverbs dereferences it unconditionally
        self._dgid = dgid._raw
        self.flow_label = flow_label
        self.sgid_index = sgid_index
        self.hop_limit = hop_limit
        self.traffic_class = traffic_class

    @property
    def dgid(self) -> str:
        return _gid_str(self._dgid)

    @dgid.setter
    def dgid(self, val: str) -> None:
        self._dgid = _gid_bytes(val)


class AHAttr(SoftObject):
    """ibv_ah_attr. GRH fields read as None unless is_global, as in pyverbs."""

    __slots__ = ("port_num", "sl", "src_path_bits", "dlid", "static_rate", "is_global", "_dgid", "_flow_label",
                 "_sgid_index", "_hop_limit", "_traffic_class")

    def __init__(self, dlid: int = 0, sl: int = 0, src_path_bits: int = 0, static_rate: int = 0,
                 is_global: int = 0, port_num: int = 1, gr: GlobalRoute | None = None) -> None:
        super().__init__()
        self.port_num, self.sl, self.src_path_bits = port_num, sl, src_path_bits
        self.dlid, self.static_rate, self.is_global = dlid, static_rate, is_global
        self._dgid, self._flow_label, self._sgid_index, self._hop_limit, self._traffic_class = bytes(16), 0, 0, 0, 0
        if is_global:
            if gr is None:
                raise PyverbsUserError("Global AH Attr is created but gr parameter is None")
            self._dgid, self._flow_label, self._sgid_index = gr._dgid, gr.flow_label, gr.sgid_index
            self._hop_limit, self._traffic_class = gr.hop_limit, gr.traffic_class

    def _g(self, val: Any) -> Any:
        return val if self.is_global else None

    @property
    def dgid(self) -> str | None:
        return _gid_str(self._dgid) if self.is_global else None

    @dgid.setter
    def dgid(self, val: str) -> None:
        if self.is_global:
            self._dgid = _gid_bytes(val)

    @property
    def flow_label(self) -> int | None:
        return self._g(self._flow_label)

    @flow_label.setter
    def flow_label(self, val: int) -> None:
        self._flow_label = val

    @property
    def sgid_index(self) -> int | None:
        return self._g(self._sgid_index)

    @sgid_index.setter
    def sgid_index(self, val: int) -> None:
        self._sgid_index = val

    @property
    def hop_limit(self) -> int | None:
        return self._g(self._hop_limit)

    @hop_limit.setter
    def hop_limit(self, val: int) -> None:
        self._hop_limit = val

    @property
    def traffic_class(self) -> int | None:
        return self._g(self._traffic_class)

    @traffic_class.setter
    def traffic_class(self, val: int) -> None:
        self._traffic_class = val

    def _copy(self) -> AHAttr:
        c = AHAttr(self.dlid, self.sl, self.src_path_bits, self.static_rate, 0, self.port_num)
        c.is_global = self.is_global
        c._dgid, c._flow_label, c._sgid_index = self._dgid, self._flow_label, self._sgid_index
        c._hop_limit, c._traffic_class = self._hop_limit, self._traffic_class
        return c


def resolve_endpoint(attr: AHAttr, local_host: str) -> tuple[str, int] | None:
    """Where an address points: the GID's endpoint, else (this host, dlid) when a LID is given."""
    if attr.is_global:
        ep = endpoint_from_gid(attr._dgid)
        if ep is not None and ep[1]:
            return ep
        if ep is not None and attr.dlid:
            return ep[0], attr.dlid
        return None
    if attr.dlid:
        return local_host, attr.dlid
    return None


class AH(SoftCM):
    """An address handle (created from AHAttr); SRD work requests name their destination with one."""

    __slots__ = ("_pd", "_endpoint", "_attr")

    def __init__(self, pd: Any, **kwargs: Any) -> None:
        super().__init__()
        attr = kwargs.get("attr")
        if attr is None:
            raise PyverbsRDMAError("softverbs creates AHs from an AHAttr only", errno.EOPNOTSUPP)
        dev = pd._dev
        if dev.is_efa and not attr.is_global:
            raise PyverbsRDMAError("Failed to create AH", errno.EINVAL)  # EFA addresses are GIDs
        self._endpoint = resolve_endpoint(attr, dev.advertise)
        if self._endpoint is None:
            raise PyverbsRDMAError("Failed to create AH", errno.EINVAL)
        self._attr = attr._copy()
        self._pd = pd
        pd._children.add(self)

    def close(self) -> None:
        self._pd = None
