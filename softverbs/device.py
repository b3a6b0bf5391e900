"""Devices and contexts (pyverbs.device): list the soft devices, open one, query it.

Every process sees the soft devices named in its registry (by default `softib0`, ConnectX-like RC, and
`softefa0`, EFA-like SRD; `softverbs.soft.add_device` adds more). Opening a Context on a device starts its
TCP listener; the device's LID is that TCP port and its GID is `::PPPP:ffff:a.b.c.d` (the IPv4-mapped
address with the port in the 16 bits before `ffff`), so a peer exchange of GID/LID/QPN is all it takes.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import threading
import weakref
import zlib
from typing import Any

from . import libibverbs_enums as e
from ._base import SoftObject
from ._device import DeviceOptions, SoftDevice
from ._dropped import SoftResource
from .addr import GID, gid_for_endpoint
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

__all__ = ["CQModerationCaps", "Context", "Device", "DeviceAttr", "DeviceAttrEx", "ODPCaps", "PCIAtomicCaps",
           "PacketPacingCaps", "PortAttr", "RSSCaps", "TMCaps", "TSOCaps", "get_device_list", "phys_state_to_str",
           "speed_to_str", "translate_link_layer", "translate_mtu", "width_to_str"]

_lock = threading.Lock()
_registry: dict[str, SoftDevice] = {}
_defaults_added = False


def _env_listen() -> tuple[str, int]:
    spec = os.environ.get("SOFTVERBS_LISTEN", "")
    if not spec:
        return "127.0.0.1", 0
    host, _, port = spec.rpartition(":") if spec.count(":") == 1 else (spec, "", "0")
    return host or "127.0.0.1", int(port or 0)


def _ensure_defaults() -> None:
    global _defaults_added
    if _defaults_added:
        return
    _defaults_added = True
    host, port = _env_listen()
    ar = os.environ.get("SOFTVERBS_ADAPTIVE_ROUTING", "") not in ("", "0")
    for name, kind in (("softib0", "ib"), ("softefa0", "efa")):
        if name not in _registry:
            _registry[name] = SoftDevice(name, DeviceOptions(kind=kind, host=host, port=port,
                                                              adaptive_routing=ar))


def registry() -> dict[str, SoftDevice]:
    """The process's soft devices by name (used by softverbs.soft)."""
    with _lock:
        _ensure_defaults()
        return _registry


def _lookup(name: str) -> SoftDevice | None:
    return registry().get(name)


class Device(SoftObject):
    """One entry of get_device_list(): name (bytes, as pyverbs returns it) and types."""

    __slots__ = ("_name", "_guid", "_node_type", "_transport_type", "_index")

    def __init__(self, name: bytes, guid: int, node_type: int, transport_type: int, index: int) -> None:
        super().__init__()
        self._name, self._guid = name, guid
        self._node_type, self._transport_type, self._index = node_type, transport_type, index

    @property
    def name(self) -> bytes:
        return self._name

    @property
    def node_type(self) -> int:
        return self._node_type

    @property
    def transport_type(self) -> int:
        return self._transport_type

    @property
    def guid(self) -> int:
        return self._guid

    @property
    def index(self) -> int:
        return self._index

    def __str__(self) -> str:
        return f"Device {self._name.decode()}, node type {self._node_type}, transport {self._transport_type}"


def _guid(dev: SoftDevice) -> int:
    return (0x5F0F << 48) | zlib.crc32(dev.name.encode()) << 8 | (1 if dev.is_efa else 0)


def get_device_list() -> list[Device]:
    """The soft devices (pyverbs raises PyverbsRDMAError instead of returning [] when there are none)."""
    devices = []
    for i, (name, dev) in enumerate(sorted(registry().items())):
        if dev.is_efa:
            node, transport = e.IBV_NODE_UNSPECIFIED, 4  # IBV_TRANSPORT_UNSPECIFIED (not named by pyverbs)
        else:
            node, transport = e.IBV_NODE_CA, e.IBV_TRANSPORT_IB
        devices.append(Device(name.encode(), _guid(dev), int(node), int(transport), i))
    if not devices:
        raise PyverbsRDMAError("Failed to get devices list")
    return devices


# Port attribute values as text (pyverbs.device's helpers); a value outside the IB spec's reads "Invalid ...".
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
_PHYS_STATES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining", 5: "LinkUp",
                6: "LinkErrorRecovery", 7: "PhyTest"}
_WIDTHS = {1: "1X", 2: "4X", 4: "8X", 8: "12X", 16: "2X"}
_SPEEDS_GBPS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.0, 16: 14.0, 32: 25.0, 64: 50.0, 128: 100.0, 256: 200.0}


def translate_mtu(mtu: int) -> str:
    """An ibv_mtu value as bytes, e.g. '4096 (5)'."""
    return f"{_MTU_BYTES[mtu]} ({mtu})" if mtu in _MTU_BYTES else f"Invalid MTU ({mtu})"


def translate_link_layer(ll: int) -> str:
    return _LINK_LAYERS.get(ll, f"Invalid link layer ({ll})")


def phys_state_to_str(phys: int) -> str:
    return f"{_PHYS_STATES[phys]} ({phys})" if phys in _PHYS_STATES else f"Invalid physical state ({phys})"


def width_to_str(width: int) -> str:
    return f"{_WIDTHS[width]} ({width})" if width in _WIDTHS else f"Invalid width ({width})"


def speed_to_str(active_speed: int, active_speed_ex: int) -> str:
    """The per-lane signalling rate (active_speed_ex, when set, supersedes active_speed)."""
    speed = active_speed_ex or active_speed
    return f"{_SPEEDS_GBPS[speed]} Gbps ({speed})" if speed in _SPEEDS_GBPS else f"Invalid speed ({speed})"


def _make_attr_class(cls_name: str, fields: list[str], doc: str) -> type:
    """A read-only attribute bag with one property per field, like pyverbs' struct wrappers."""

    def __init__(self: Any) -> None:
        SoftObject.__init__(self)
        self._v = {}

    ns: dict[str, Any] = {"__slots__": ("_v",), "__init__": __init__, "__doc__": doc,
                          "__str__": lambda self: "\n".join(f"{k}: {self._v[k]}" for k in fields)}
    for f in fields:
        ns[f] = property(lambda self, _f=f: self._v[_f])
    return type(cls_name, (SoftObject,), ns)


_DEVICE_ATTR_FIELDS = [
    "fw_version", "node_guid", "sys_image_guid", "max_mr_size", "page_size_cap", "vendor_id",
    "vendor_part_id", "hw_ver", "max_qp", "max_qp_wr", "device_cap_flags", "max_sge", "max_sge_rd",
    "max_cq", "max_cqe", "max_mr", "max_pd", "max_qp_rd_atom", "max_ee_rd_atom", "max_res_rd_atom",
    "max_qp_init_rd_atom", "max_ee_init_rd_atom", "atomic_caps", "max_ee", "max_rdd", "max_mw",
    "max_raw_ipv6_qps", "max_raw_ethy_qp", "max_mcast_grp", "max_mcast_qp_attach", "max_ah", "max_fmr",
    "max_map_per_fmr", "max_srq", "max_srq_wr", "max_srq_sge", "max_pkeys", "local_ca_ack_delay",
    "phys_port_cnt",
]
_PORT_ATTR_FIELDS = [
    "state", "max_mtu", "active_mtu", "gid_tbl_len", "port_cap_flags", "max_msg_sz", "bad_pkey_cntr",
    "qkey_viol_cntr", "pkey_tbl_len", "lid", "sm_lid", "lmc", "max_vl_num", "sm_sl", "subnet_timeout",
    "init_type_reply", "active_width", "active_speed", "phys_state", "link_layer", "flags",
    "port_cap_flags2", "active_speed_ex",
]
DeviceAttr = _make_attr_class("DeviceAttr", _DEVICE_ATTR_FIELDS, "Device limits (ibv_device_attr).")
PortAttr = _make_attr_class("PortAttr", _PORT_ATTR_FIELDS, "Port attributes (ibv_port_attr).")

# ibv_device_attr_ex: the extended attributes, each capability group a struct of its own as in pyverbs.
ODPCaps = _make_attr_class("ODPCaps", ["general_caps", "rc_odp_caps", "uc_odp_caps", "ud_odp_caps",
                                       "xrc_odp_caps"], "On-demand paging capabilities (none here).")
PCIAtomicCaps = _make_attr_class("PCIAtomicCaps", ["fetch_add", "swap", "compare_swap"],
                                 "PCIe atomic capabilities (none here).")
TSOCaps = _make_attr_class("TSOCaps", ["max_tso", "supported_qpts"], "TCP segmentation offload (none here).")
RSSCaps = _make_attr_class("RSSCaps", ["supported_qpts", "max_rwq_indirection_tables", "rx_hash_fields_mask",
                                       "rx_hash_function", "max_rwq_indirection_table_size"],
                           "Receive-side scaling (none here).")
PacketPacingCaps = _make_attr_class("PacketPacingCaps", ["qp_rate_limit_min", "qp_rate_limit_max",
                                                         "supported_qpts"], "Packet pacing (none here).")
TMCaps = _make_attr_class("TMCaps", ["max_rndv_hdr_size", "max_num_tags", "flags", "max_ops", "max_sge"],
                          "Tag matching (none here).")
CQModerationCaps = _make_attr_class("CQModerationCaps", ["max_cq_count", "max_cq_period"],
                                    "CQ moderation (none here).")
_DEVICE_ATTR_EX_FIELDS = [
    "orig_attr", "comp_mask", "odp_caps", "completion_timestamp_mask", "hca_core_clock", "device_cap_flags_ex",
    "tso_caps", "pci_atomic_caps", "rss_caps", "max_wq_type_rq", "packet_pacing_caps", "raw_packet_caps",
    "tm_caps", "cq_mod_caps", "max_dm_size", "phys_port_cnt_ex",
]
DeviceAttrEx = _make_attr_class("DeviceAttrEx", _DEVICE_ATTR_EX_FIELDS,
                                "Extended device attributes (ibv_device_attr_ex): orig_attr plus the feature groups.")


def _zeroed(cls: type) -> Any:
    return _filled(cls, dict.fromkeys(_fields_of(cls), 0))


def _fields_of(cls: type) -> list[str]:
    return [k for k, v in vars(cls).items() if isinstance(v, property)]


def _filled(cls: type, values: dict[str, Any]) -> Any:
    obj = cls()
    obj._v = values
    return obj

IB_MAX_QP_WR = 32768
IB_MAX_SGE = 30
IB_MAX_CQE = 4194303
IB_MAX_INLINE = 512
IB_MAX_RD_ATOM = 16
EFA_MAX_SQ_WR = 4096
EFA_MAX_RQ_WR = 8192
EFA_MAX_SQ_SGE = 2
EFA_MAX_RQ_SGE = 3
EFA_INLINE_BUF = 32
EFA_MAX_CQE = 65536


def device_limits(dev: SoftDevice) -> dict[str, int]:
    """The limits soft QPs/CQs are checked against (options may override them for tests)."""
    o = dev.options
    if dev.is_efa:
        return {"max_qp_wr": o.max_qp_wr or EFA_MAX_SQ_WR, "max_rq_wr": o.max_qp_wr or EFA_MAX_RQ_WR,
                "max_sge": EFA_MAX_SQ_SGE, "max_rq_sge": EFA_MAX_RQ_SGE, "max_cqe": o.max_cqe or EFA_MAX_CQE,
                "max_inline": o.max_inline_data if o.max_inline_data is not None else EFA_INLINE_BUF,
                "max_rd_atom": 0}
    return {"max_qp_wr": o.max_qp_wr or IB_MAX_QP_WR, "max_rq_wr": o.max_qp_wr or IB_MAX_QP_WR,
            "max_sge": IB_MAX_SGE, "max_rq_sge": IB_MAX_SGE, "max_cqe": o.max_cqe or IB_MAX_CQE,
            "max_inline": o.max_inline_data if o.max_inline_data is not None else IB_MAX_INLINE,
            "max_rd_atom": IB_MAX_RD_ATOM}


class Context(SoftResource):
    """An open soft device (ibv_context). Closing it closes the PDs, CQs and QPs created on it.

    ``Context(cmd_fd=fd)`` imports another context through its command descriptor (``ibv_import_device``;
    the new context owns ``fd`` and closes it): see ``softverbs._export`` for what an import shares and
    which rules it keeps. ``cmd_fd`` is this context's command descriptor, to pass (a copy) to a process
    that imports it.
    """

    __slots__ = ("_name", "_dev", "_children", "_closed", "_export", "_link", "_cmd_fd", "_imports", "_handles",
                 "_exporter")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._closed = True
        self._export: Any = None
        self._link: Any = None
        self._exporter: Any = None  # an import in the exporter's own process: a weak reference to it
        self._cmd_fd: int | None = None
        self._imports: dict[str, dict[int, list[Any]]] = {"pd": {}, "mr": {}}
        self._handles = itertools.count(1)
        self._children: weakref.WeakSet[Any] = weakref.WeakSet()
        name = kwargs.get("name")
        if kwargs.get("cmid") is not None:
            raise PyverbsRDMAError("softverbs opens devices by name or command descriptor only", errno.EOPNOTSUPP)
        cmd_fd = kwargs.get("cmd_fd")
        if cmd_fd is not None:
            self._import(int(cmd_fd))
            return
        if name is None:
            raise PyverbsUserError("Device name must be provided")
        if isinstance(name, bytes):
            name = name.decode()
        dev = _lookup(name)
        if dev is None:
            raise PyverbsRDMAError(f"Failed to find device {name}")
        self._name = name
        self._dev = dev
        self._closed = False
        dev.acquire()

    def _import(self, cmd_fd: int) -> None:
        """ibv_import_device: attach to the exporting context and run an engine like its device."""
        from ._export import ImportLink, LinkError

        try:
            link = ImportLink(cmd_fd)
            reply, _ = link.call("hello")
        except LinkError as exc:
            raise PyverbsRDMAError(f"Failed to import device: {exc.strerror}", exc.errno) from None
        from ._export import EXPORTED

        exporter = EXPORTED.get(str(reply["token"])) if reply.get("pid") == os.getpid() else None
        if exporter is not None and not exporter._closed:  # this process's own context: one engine
            dev = exporter._dev
            self._exporter = weakref.ref(exporter)
        else:  # another process's: an engine of its own, with the device's behaviour
            known = {f.name for f in dataclasses.fields(DeviceOptions)}
            options = DeviceOptions(**{k: v for k, v in reply["options"].items() if k in known})
            options.port = 0  # this engine listens on a port of its own
            dev = SoftDevice(str(reply["name"]), options)
        self._name, self._dev, self._link, self._cmd_fd = str(reply["name"]), dev, link, cmd_fd
        ref = weakref.ref(self)
        link.on_gone = lambda kind, handle: _imported_gone(ref, kind, handle)
        self._closed = False
        dev.acquire()

    @property
    def cmd_fd(self) -> int:
        """The command descriptor (pass a copy, ``os.dup``, to the process that imports this context)."""
        if self._closed:
            raise PyverbsUserError("the context is closed")
        if self._cmd_fd is not None:
            return self._cmd_fd
        if self._export is None:
            from ._export import ExportService

            self._export = ExportService(self)
        return int(self._export.cmd_fd)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        for child in list(self._children):
            child.close()
        self._closed = True
        if self._export is not None:
            self._export.close()
            self._export = None
        if self._link is not None:
            self._link.close()
            self._link = None
        if self._cmd_fd is not None:
            try:
                os.close(self._cmd_fd)
            except OSError:
                pass
            self._cmd_fd = None
        self._dev.release()

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_comp_vectors(self) -> int:
        return 1

    def query_device(self) -> Any:
        dev = self._dev
        lim = device_limits(dev)
        efa = dev.is_efa
        return _filled(DeviceAttr, {
            "fw_version": "0.0.0 (softverbs)", "node_guid": _guid(dev), "sys_image_guid": _guid(dev),
            "max_mr_size": (1 << 64) - 1, "page_size_cap": 0xFFFFFFFFFFFFF000,
            "vendor_id": 0x1D0F if efa else 0x02C9, "vendor_part_id": 0xEFA1 if efa else 4129, "hw_ver": 0,
            "max_qp": 1 << 17, "max_qp_wr": lim["max_qp_wr"], "device_cap_flags": 0,
            "max_sge": lim["max_sge"], "max_sge_rd": lim["max_sge"], "max_cq": 1 << 17,
            "max_cqe": lim["max_cqe"], "max_mr": 1 << 20, "max_pd": 1 << 17,
            "max_qp_rd_atom": lim["max_rd_atom"], "max_ee_rd_atom": 0, "max_res_rd_atom": 1 << 20,
            "max_qp_init_rd_atom": lim["max_rd_atom"], "max_ee_init_rd_atom": 0,
            "atomic_caps": int(e.IBV_ATOMIC_NONE if efa else e.IBV_ATOMIC_HCA), "max_ee": 0, "max_rdd": 0,
            "max_mw": 0, "max_raw_ipv6_qps": 0, "max_raw_ethy_qp": 0, "max_mcast_grp": 0,
            "max_mcast_qp_attach": 0, "max_ah": 1 << 16, "max_fmr": 0, "max_map_per_fmr": 0, "max_srq": 0,
            "max_srq_wr": 0, "max_srq_sge": 0, "max_pkeys": 1, "local_ca_ack_delay": 16, "phys_port_cnt": 1,
        })

    def query_device_ex(self, ex_input: Any = None) -> Any:
        """query_device() plus the extended groups, all empty: a soft device has no ODP, TSO, RSS, tag
        matching, packet pacing, CQ moderation, device memory or completion timestamps."""
        orig = self.query_device()
        return _filled(DeviceAttrEx, {
            "orig_attr": orig, "comp_mask": 0, "odp_caps": _zeroed(ODPCaps), "completion_timestamp_mask": 0,
            "hca_core_clock": 0, "device_cap_flags_ex": orig.device_cap_flags, "tso_caps": _zeroed(TSOCaps),
            "pci_atomic_caps": _zeroed(PCIAtomicCaps), "rss_caps": _zeroed(RSSCaps), "max_wq_type_rq": 0,
            "packet_pacing_caps": _zeroed(PacketPacingCaps), "raw_packet_caps": 0, "tm_caps": _zeroed(TMCaps),
            "cq_mod_caps": _zeroed(CQModerationCaps), "max_dm_size": 0, "phys_port_cnt_ex": orig.phys_port_cnt,
        })

    def query_port(self, port_num: int) -> Any:
        if port_num != 1:
            raise PyverbsRDMAError(f"Failed to query port {port_num}", errno.EINVAL)
        dev = self._dev
        return _filled(PortAttr, {
            "state": int(e.IBV_PORT_ACTIVE), "max_mtu": int(e.IBV_MTU_4096), "active_mtu": int(e.IBV_MTU_4096),
            "gid_tbl_len": 1, "port_cap_flags": 0,
            "max_msg_sz": dev.options.max_rdma_size if dev.is_efa else 1 << 31,
            "bad_pkey_cntr": 0, "qkey_viol_cntr": 0, "pkey_tbl_len": 1, "lid": dev.port & 0xFFFF, "sm_lid": 0,
            "lmc": 0, "max_vl_num": 1, "sm_sl": 0, "subnet_timeout": 0, "init_type_reply": 0,
            "active_width": 2, "active_speed": 128, "phys_state": 5,
            "link_layer": e.IBV_LINK_LAYER_UNSPECIFIED if dev.is_efa else e.IBV_LINK_LAYER_INFINIBAND,
            "flags": 0, "port_cap_flags2": 0, "active_speed_ex": 0,
        })

    def query_gid(self, port_num: int, index: int) -> GID:
        if port_num != 1 or index != 0:
            raise PyverbsRDMAError(f"Failed to query gid {index} of port {port_num}")
        return GID(gid_for_endpoint(self._dev.advertise, self._dev.port))

    def query_pkey(self, port_num: int, index: int) -> int:
        if port_num != 1 or index != 0:
            raise PyverbsRDMAError(f"Failed to query pkey {index} of port {port_num}")
        return 0xFFFF


def _imported_gone(ref: Any, kind: str, handle: int | None) -> None:
    """The exporter closed an object this context imported (``kind`` "pd" or "mr"), or itself ("context",
    handle None): imported MRs lose their keys, imported PDs take nothing more."""
    ctx = ref()
    if ctx is None:
        return
    imports = ctx._imports
    if kind == "context":
        pds = [pd for group in imports["pd"].values() for pd in group]
        cores = [core for group in imports["mr"].values() for core in group]
        imports["pd"].clear()
        imports["mr"].clear()
    elif kind == "pd":
        pds = imports["pd"].pop(int(handle or 0), [])
        idents = {id(pd._ident) for pd in pds}
        cores = [core for group in imports["mr"].values() for core in group if id(core.pd) in idents]
    else:
        pds, cores = [], imports["mr"].pop(int(handle or 0), [])
    for pd in pds:
        pd._gone = True
    dev = ctx._dev
    with dev.lock:
        for core in cores:
            core.valid = False
            if dev.mrs_by_lkey.get(core.lkey) is core:
                del dev.mrs_by_lkey[core.lkey]
            if dev.mrs_by_rkey.get(core.rkey) is core:
                del dev.mrs_by_rkey[core.rkey]
