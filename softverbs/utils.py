"""Helpers (pyverbs.utils): QP types and states as short names, for messages."""

from __future__ import annotations

from . import libibverbs_enums as e

__all__ = ["qp_state_to_str", "qp_type_to_str"]

_QP_TYPES = {int(e.IBV_QPT_RC): "RC", int(e.IBV_QPT_UC): "UC", int(e.IBV_QPT_UD): "UD",
             int(e.IBV_QPT_RAW_PACKET): "Raw Packet", int(e.IBV_QPT_XRC_SEND): "XRC send",
             int(e.IBV_QPT_XRC_RECV): "XRC receive", int(e.IBV_QPT_DRIVER): "Driver QP"}
_QP_STATES = {int(e.IBV_QPS_RESET): "Reset", int(e.IBV_QPS_INIT): "Init", int(e.IBV_QPS_RTR): "RTR",
              int(e.IBV_QPS_RTS): "RTS", int(e.IBV_QPS_SQD): "SQD", int(e.IBV_QPS_SQE): "SQE",
              int(e.IBV_QPS_ERR): "Error", int(e.IBV_QPS_UNKNOWN): "Unknown"}


def qp_type_to_str(qp_type: int) -> str:
    """'RC', 'UD', ... for an ibv_qp_type value; 'Unknown (n)' otherwise."""
    return _QP_TYPES.get(int(qp_type), f"Unknown ({int(qp_type)})")


def qp_state_to_str(qp_state: int) -> str:
    """'Reset', 'RTS', ... for an ibv_qp_state value; 'Unknown (n)' otherwise."""
    return _QP_STATES.get(int(qp_state), f"Unknown ({int(qp_state)})")
