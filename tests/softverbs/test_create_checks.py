"""Create-time checks rdma-core's own tests found missing (see test_rdma_core_suite.py), checked directly:
comp_vector against num_comp_vectors, IBV_QP_INIT_ATTR_CREATE_FLAGS on RC (mlx5) and SRD (efa) QPs, and the
answers softverbs gives for features it lacks (query_device_ex, QPEx.ind_table)."""

from __future__ import annotations

import errno
from collections.abc import Iterator

import pytest

from softverbs import cq, device, pd, qp
from softverbs import libibverbs_enums as e
from softverbs.providers.efa import efa_enums, efadv
from tests.support.verbs_resources import raises_errno
from transportd.backends import verbs


@pytest.fixture
def v():
    return verbs.load("soft")


@pytest.fixture
def ib() -> Iterator[device.Context]:
    with device.Context(name="softib0") as ctx:
        yield ctx


def test_comp_vector_must_be_below_num_comp_vectors(v, ib) -> None:
    n = ib.num_comp_vectors
    with cq.CQ(ib, 16, None, None, n - 1) as ok:
        assert ok.cqe == 16
    for bad in (n, n + 1):
        raises_errno(v, errno.EINVAL, cq.CQ, ib, 16, None, None, bad)
        raises_errno(v, errno.EINVAL, cq.CQEX, ib, cq.CqInitAttrEx(cqe=16, comp_vector=bad))
    with cq.CQEX(ib, cq.CqInitAttrEx(cqe=16, comp_vector=n - 1)):
        pass


def _rc_attr_ex(ib_pd: pd.PD, scq: cq.CQ, comp_mask: int, create_flags: int) -> qp.QPInitAttrEx:
    return qp.QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=scq, rcq=scq, pd=ib_pd, cap=qp.QPCap(4, 4, 1, 1),
                           comp_mask=comp_mask, create_flags=create_flags)


def test_rc_qp_takes_create_flags_mask_with_no_flags(v, ib) -> None:
    mask = int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_CREATE_FLAGS)
    with pd.PD(ib) as ib_pd, cq.CQ(ib, 16) as scq:
        with qp.QP(ib, _rc_attr_ex(ib_pd, scq, mask, 0)) as q:
            assert q.qp_state == e.IBV_QPS_RESET
        with qp.QPEx(ib, _rc_attr_ex(ib_pd, scq, mask | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, 0)) as q:
            assert q.ind_table is None
        # flags softverbs does not model are refused, as are masks outside its subset (TSO, XRCD, RSS)
        raises_errno(v, errno.EOPNOTSUPP, qp.QP, ib, _rc_attr_ex(ib_pd, scq, mask, e.IBV_QP_CREATE_SCATTER_FCS))
        raises_errno(v, errno.EOPNOTSUPP, qp.QP, ib,
                     _rc_attr_ex(ib_pd, scq, int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_MAX_TSO_HEADER), 0))


def test_srd_qp_refuses_create_flags_mask(v) -> None:
    with efadv.EfaContext(name="softefa0") as ctx, pd.PD(ctx) as efa_pd, cq.CQ(ctx, 16) as scq:
        efa_attr = efadv.EfaQPInitAttr()
        efa_attr.driver_qp_type = efa_enums.EFADV_QP_DRIVER_TYPE_SRD
        base = int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)

        def attr(mask: int) -> qp.QPInitAttrEx:
            return qp.QPInitAttrEx(qp_type=e.IBV_QPT_DRIVER, scq=scq, rcq=scq, pd=efa_pd, cap=qp.QPCap(4, 4, 1, 1),
                                   comp_mask=mask, send_ops_flags=int(e.IBV_QP_EX_WITH_SEND))

        with efadv.SRDQPEx(ctx, attr(base), efa_attr) as q:
            assert q.ind_table is None
        raises_errno(v, errno.EOPNOTSUPP, efadv.SRDQPEx, ctx, attr(base | e.IBV_QP_INIT_ATTR_CREATE_FLAGS), efa_attr)


def test_query_device_ex_reports_no_extended_features(ib) -> None:
    ex = ib.query_device_ex()
    assert ex.orig_attr.max_qp_wr == ib.query_device().max_qp_wr
    assert ex.phys_port_cnt_ex == 1
    assert ex.odp_caps.general_caps == 0 and ex.odp_caps.rc_odp_caps == 0
    assert ex.tso_caps.max_tso == 0 and ex.rss_caps.supported_qpts == 0 and ex.tm_caps.max_num_tags == 0
    assert ex.max_dm_size == 0 and ex.completion_timestamp_mask == 0 and ex.pci_atomic_caps.fetch_add == 0


def test_port_helpers_name_the_soft_port(ib) -> None:
    port = ib.query_port(1)
    for text in (device.translate_mtu(port.active_mtu), device.width_to_str(port.active_width),
                 device.speed_to_str(port.active_speed, port.active_speed_ex),
                 device.phys_state_to_str(port.phys_state), device.translate_link_layer(port.link_layer)):
        assert "Invalid" not in text
    assert "Invalid" in device.speed_to_str(3, 0) and "Invalid" in device.translate_mtu(9)
