"""EFA direct verbs (pyverbs.providers.efa.efadv): EfaContext, SRD QPs and the EFA CQ.

Creation follows rdma-core 59's EFA provider (providers/efa/verbs.c efa_check_qp_attr): SRD QPs are
IBV_QPT_DRIVER with driver_qp_type SRD; send_ops_flags may hold SEND, SEND_WITH_IMM, RDMA_READ (with the
device's RDMA_READ cap) and RDMA_WRITE / RDMA_WRITE_WITH_IMM (with the RDMA_WRITE cap); the
unsolicited-write-receive flag needs its cap too. Anything else is EOPNOTSUPP.
"""

from __future__ import annotations

import errno
from typing import Any

from ... import libibverbs_enums as e
from ..._base import SoftObject
from ...cq import CQEX, CqInitAttrEx
from ...device import Context, device_limits
from ...pyverbs_error import PyverbsRDMAError
from ...qp import QP, QPEx, QPInitAttr, QPInitAttrEx
from . import efa_enums as dve

__all__ = ["EfaCQ", "EfaContext", "EfaDVCQInitAttr", "EfaDVDeviceAttr", "EfaQPInitAttr", "SRDQP", "SRDQPEx"]

DEFAULT_CAPS = (dve.EFADV_DEVICE_ATTR_CAPS_RDMA_READ | dve.EFADV_DEVICE_ATTR_CAPS_RNR_RETRY
                | dve.EFADV_DEVICE_ATTR_CAPS_CQ_WITH_SGID | dve.EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE
                | dve.EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV)


def device_caps(dev: Any) -> int:
    caps = dev.options.efa_device_caps
    return DEFAULT_CAPS if caps is None else caps


class EfaDVDeviceAttr(SoftObject):
    """efadv_device_attr: EFA limits and capability bits (incl. max_rdma_size, RDMA_WRITE)."""

    __slots__ = ("_v",)

    def __init__(self) -> None:
        super().__init__()
        self._v: dict[str, int] = {}

    @property
    def comp_mask(self) -> int:
        return self._v.get("comp_mask", 0)

    @property
    def max_sq_wr(self) -> int:
        return self._v["max_sq_wr"]

    @property
    def max_rq_wr(self) -> int:
        return self._v["max_rq_wr"]

    @property
    def max_sq_sge(self) -> int:
        return self._v["max_sq_sge"]

    @property
    def max_rq_sge(self) -> int:
        return self._v["max_rq_sge"]

    @property
    def inline_buf_size(self) -> int:
        return self._v["inline_buf_size"]

    @property
    def device_caps(self) -> int:
        return self._v["device_caps"]

    @property
    def max_rdma_size(self) -> int:
        return self._v["max_rdma_size"]


class EfaContext(Context):
    """A Context on an EFA device, with query_efa_device()."""

    __slots__ = ()

    def __init__(self, name: str = "") -> None:
        super().__init__(name=name)

    def query_efa_device(self) -> EfaDVDeviceAttr:
        dev = self._dev
        if not dev.is_efa:
            raise PyverbsRDMAError(f"Failed to query efa device {self.name}", errno.EOPNOTSUPP)
        lim = device_limits(dev)
        attr = EfaDVDeviceAttr()
        attr._v = {
            "comp_mask": 0, "max_sq_wr": lim["max_qp_wr"], "max_rq_wr": lim["max_rq_wr"],
            "max_sq_sge": lim["max_sge"], "max_rq_sge": lim["max_rq_sge"], "inline_buf_size": lim["max_inline"],
            "device_caps": device_caps(dev), "max_rdma_size": dev.options.max_rdma_size,
        }
        return attr


class EfaQPInitAttr(SoftObject):
    """efadv_qp_init_attr: driver_qp_type (SRD), flags (e.g. EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV), sl."""

    __slots__ = ("driver_qp_type", "flags", "sl", "_comp_mask")

    def __init__(self) -> None:
        super().__init__()
        self.driver_qp_type = 0
        self.flags = 0
        self.sl = 0
        self._comp_mask = 0

    @property
    def comp_mask(self) -> int:
        return self._comp_mask


def _check_efa(dev: Any, init_attr: Any, efa_attr: EfaQPInitAttr, send_ops: int | None) -> None:
    if not dev.is_efa:
        raise PyverbsRDMAError("Failed to create SRD QP: not an EFA device", errno.EOPNOTSUPP)
    caps = device_caps(dev)
    if int(init_attr.qp_type) != e.IBV_QPT_DRIVER:
        raise PyverbsRDMAError("Failed to create SRD QP: QP type not IBV_QPT_DRIVER", errno.EINVAL)
    if efa_attr.driver_qp_type != dve.EFADV_QP_DRIVER_TYPE_SRD:
        raise PyverbsRDMAError("Failed to create SRD QP: driver QP type must be SRD", errno.EOPNOTSUPP)
    supp_flags = dve.EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV \
        if caps & dve.EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV else 0
    if efa_attr.flags & ~supp_flags:
        raise PyverbsRDMAError("Failed to create SRD QP: unsupported EFA flags", errno.EOPNOTSUPP)
    if send_ops is not None:
        supp = int(e.IBV_QP_EX_WITH_SEND | e.IBV_QP_EX_WITH_SEND_WITH_IMM)
        if caps & dve.EFADV_DEVICE_ATTR_CAPS_RDMA_READ:
            supp |= int(e.IBV_QP_EX_WITH_RDMA_READ)
        if caps & dve.EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE:
            supp |= int(e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM)
        if send_ops & ~supp:
            raise PyverbsRDMAError("Failed to create SRD QP: unsupported send_ops_flags", errno.EOPNOTSUPP)


class SRDQP(QP):
    """An SRD QP created from a PD and QPInitAttr (qp_type IBV_QPT_DRIVER); posts with post_send (sends only)."""

    __slots__ = ()

    def __init__(self, pd: Any, init_attr: QPInitAttr) -> None:
        SoftObject.__init__(self)
        self._closed = True
        self._ex = False
        efa_attr = EfaQPInitAttr()
        efa_attr.driver_qp_type = dve.EFADV_QP_DRIVER_TYPE_SRD
        _check_efa(pd._dev, init_attr, efa_attr, None)
        self._create(pd, init_attr, efa_attr)


class SRDQPEx(QPEx):
    """An SRD QP with the extended post API; the only way to RDMA write/read on EFA."""

    __slots__ = ()

    def __init__(self, ctx: Context, attr_ex: QPInitAttrEx, efa_init_attr: EfaQPInitAttr) -> None:
        SoftObject.__init__(self)
        self._closed = True
        self._wr_id = 0
        self._wr_flags = 0
        self._comp_mask = 0
        comp_mask = int(attr_ex.comp_mask)
        send_ops = int(attr_ex._send_ops_flags) if comp_mask & e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS else None
        _check_efa(ctx._dev, attr_ex, efa_init_attr, send_ops)
        self._create(ctx, attr_ex, efa_init_attr)
        self._ex = send_ops is not None

    def _get_comp_mask(self, dst: str) -> int:
        srd_mask = {"INIT": e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_QKEY, "RTR": 0, "RTS": e.IBV_QP_SQ_PSN}
        return int(srd_mask[dst] | e.IBV_QP_STATE)


class EfaDVCQInitAttr(SoftObject):
    """efadv_cq_init_attr: extra WC flags (EFADV_WC_EX_WITH_SGID, EFADV_WC_EX_WITH_IS_UNSOLICITED)."""

    __slots__ = ("wc_flags", "_comp_mask")

    def __init__(self, wc_flags: int = 0) -> None:
        super().__init__()
        self.wc_flags = wc_flags
        self._comp_mask = 0

    @property
    def comp_mask(self) -> int:
        return self._comp_mask


class EfaCQ(CQEX):
    """The EFA extended CQ: adds read_sgid() and is_unsolicited() for the current completion."""

    __slots__ = ("_efa_flags",)

    def __init__(self, ctx: Context, attr_ex: CqInitAttrEx, efa_init_attr: EfaDVCQInitAttr | None) -> None:
        if not ctx._dev.is_efa:
            raise PyverbsRDMAError("Failed to create EFA CQ", errno.EOPNOTSUPP)
        if efa_init_attr is None:
            efa_init_attr = EfaDVCQInitAttr()
        caps = device_caps(ctx._dev)
        supported = dve.EFADV_WC_EX_WITH_SGID if caps & dve.EFADV_DEVICE_ATTR_CAPS_CQ_WITH_SGID else 0
        if caps & dve.EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV:
            supported |= dve.EFADV_WC_EX_WITH_IS_UNSOLICITED
        if efa_init_attr.wc_flags & ~supported:
            raise PyverbsRDMAError("Failed to create EFA CQ", errno.EOPNOTSUPP)
        super().__init__(ctx, attr_ex)
        self._efa_flags = efa_init_attr.wc_flags

    def read_sgid(self) -> Any:
        """The sender's GID of the current receive completion (None for send completions)."""
        from ...addr import GID, gid_for_endpoint

        c = self._c()
        if not c[2] & 0x80 or not self._efa_flags & dve.EFADV_WC_EX_WITH_SGID:
            return None
        host = self._ctx._dev.advertise
        return GID(gid_for_endpoint(host, c[8]))

    def is_unsolicited(self) -> bool:
        return bool(self._c()[12])
