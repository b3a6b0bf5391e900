"""The pyverbs bridge (``transportd._pyverbs_bridge``, ``make pyverbs-bridge``): what the compiled data path
needs from pyverbs' objects on a real NIC.

Built in CI against the rdma-core 59 tree it builds; without the module the CPU tests skip, unless
``TRANSPORTD_REQUIRE_PYVERBS=1`` (CI) makes that a failure. The ``hardware`` test needs a real device.
"""

from __future__ import annotations

import importlib
import os

import pytest

from transportd import _core

REQUIRE = os.environ.get("TRANSPORTD_REQUIRE_PYVERBS", "") == "1"


@pytest.fixture(scope="module")
def bridge():
    try:
        return importlib.import_module("transportd._pyverbs_bridge")
    except ImportError as exc:
        msg = f"the pyverbs bridge is not built or pyverbs is not importable ({exc}); run `make pyverbs-bridge`"
        if REQUIRE:
            pytest.fail(f"TRANSPORTD_REQUIRE_PYVERBS=1 but {msg}", pytrace=False)
        pytest.skip(msg)


def test_the_handles_offer_what_the_data_path_reads(bridge) -> None:
    """The same attribute names as the softverbs shim's structs, which is what IbPoster looks up."""
    assert hasattr(bridge.QPHandle, "ibv_qp_ex") and hasattr(_core.ShimQP, "ibv_qp_ex")
    assert hasattr(bridge.CQHandle, "ibv_cq_ex") and hasattr(_core.ShimCQ, "ibv_cq_ex")


@pytest.mark.parametrize("wrong", [object(), None, 7])
def test_anything_but_a_pyverbs_extended_qp_or_cq_is_refused(bridge, wrong) -> None:
    with pytest.raises(TypeError):
        bridge.QPHandle(wrong)
    with pytest.raises(TypeError):
        bridge.CQHandle(wrong)


def test_a_softverbs_object_is_not_taken_for_a_pyverbs_one(bridge) -> None:
    """softverbs mimics pyverbs' Python API, not its C structs: the bridge must refuse its objects."""
    from transportd.backends import verbs

    v = verbs.load("soft")
    ctx = v.device.Context(name="softib0")
    try:
        cq = v.cq.CQEX(ctx, v.cq.CqInitAttrEx(cqe=16))
        with pytest.raises(TypeError):
            bridge.CQHandle(cq)
        cq.close()
    finally:
        ctx.close()


@pytest.mark.hardware
def test_a_real_qp_and_cq_give_their_structs(bridge) -> None:
    """On a NIC: the handles carry non-null struct pointers and IbPoster takes them."""
    from transportd.backends import verbs

    v = verbs.load("pyverbs")
    try:
        devices = v.device.get_device_list()
    except v.pyverbs_error.PyverbsRDMAError as exc:
        devices, why = [], str(exc)
    else:
        why = "none listed"
    if not devices:
        pytest.skip(f"no RDMA device ({why})")
    e = v.libibverbs_enums
    ctx = v.device.Context(name=devices[0].name.decode())
    try:
        pd = v.pd.PD(ctx)
        cq = v.cq.CQEX(ctx, v.cq.CqInitAttrEx(cqe=64))
        init = v.qp.QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, pd=pd,
                                 cap=v.qp.QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1),
                                 comp_mask=int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
                                 send_ops_flags=int(e.IBV_QP_EX_WITH_RDMA_WRITE))
        qp = v.qp.QPEx(ctx, init)
        qh, ch = bridge.QPHandle(qp), bridge.CQHandle(cq)
        assert qh.qp is qp and ch.cq is cq
        assert type(qh.ibv_qp_ex).__name__ == "PyCapsule" and type(ch.ibv_cq_ex).__name__ == "PyCapsule"
        from transportd.errors import BackendError, SendQueueFullError

        poster = _core.IbPoster(cq=ch, mode="write", inline=False, scratch_addr=0, scratch_lkey=0,
                                backend_error=BackendError, sq_full_error=SendQueueFullError,
                                verbs_error=BackendError)
        assert poster.add_connection(1, qh, 16, 0, 0, 0) >= 1
        poster.remove_connection(1)
        qp.close()
        cq.close()
        pd.close()
    finally:
        ctx.close()


@pytest.mark.parametrize("wrong", [object(), None, 7])
def test_an_address_handle_address_is_only_read_from_a_pyverbs_ah(bridge, wrong) -> None:
    with pytest.raises(TypeError):
        bridge.ah_address(wrong)


def test_efa_addresses_are_shim_handles_unless_bridged() -> None:
    """Through the shim the lowering carries small integers; with the bridge it carries the ibv_ah pointers
    (read by ``ah_address``), so the same lowering drives a real EFA."""
    from efa.srd_shim import AddressTable, bridged
    from transportd.backends import verbs

    assert not bridged(verbs.load("soft"))
    table = AddressTable()
    ah_a, ah_b = object(), object()
    assert (table.add(ah_a), table.add(ah_b)) == (1, 2) and table.ahs == {1: ah_a, 2: ah_b}
