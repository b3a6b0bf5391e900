"""The errors of ibgda: a WQE the NIC would refuse (with the mlx5 syndrome it would report) and a queue that
could not be set up. The syndromes live here, beside the exception that carries them."""

from __future__ import annotations

from enum import IntEnum

from transportd.errors import TransportdError

__all__ = ["Mlx5QueueError", "Syndrome", "WqeFormatError"]


class Syndrome(IntEnum):
    """Error CQE syndromes (MLX5_CQE_SYNDROME_*)."""

    LOCAL_LENGTH_ERR = 0x01
    LOCAL_QP_OP_ERR = 0x02
    LOCAL_PROT_ERR = 0x04
    WR_FLUSH_ERR = 0x05
    MW_BIND_ERR = 0x06
    BAD_RESP_ERR = 0x10
    LOCAL_ACCESS_ERR = 0x11
    REMOTE_INVAL_REQ_ERR = 0x12
    REMOTE_ACCESS_ERR = 0x13
    REMOTE_OP_ERR = 0x14
    TRANSPORT_RETRY_EXC_ERR = 0x15
    RNR_RETRY_EXC_ERR = 0x16
    REMOTE_ABORTED_ERR = 0x22


class WqeFormatError(ValueError):
    """A WQE the NIC would refuse: it completes with an error CQE carrying ``syndrome``."""

    def __init__(self, syndrome: Syndrome, message: str) -> None:
        self.syndrome = Syndrome(syndrome)
        super().__init__(message)


class Mlx5QueueError(TransportdError):
    """A DevX command or a CUDA mapping for an IBGDA queue failed."""
