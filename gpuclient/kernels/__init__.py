"""Fused multi-node kernels on transportd channels: compute and RDMA overlapped at tile granularity.

Each kernel is a host object built on a joined session: it registers the buffers the kernel's peers write
into, sizes a chunk plan (``gpuclient.ChunkPlan``) whose chunks are independent of the compute tiles, and
compiles its Triton kernel on first use. ``torch`` and ``triton`` are needed (the ``.[triton]`` extra and a CUDA
build of torch); operands are torch tensors or any CUDA array torch views without a copy (CuPy, through DLPack
or ``__cuda_array_interface__``; bf16 as 16-bit integers: ``_operands``), results torch tensors.

    op = AllGatherGemm(session, m_local=1024, n=4096, k=8192)   # before session.exchange()
    session.exchange()
    c = op(a_shard, b)                                           # C = all_gather(A) @ B, bf16 in, fp32 acc

``GemmReduceScatter`` (this rank's segment of ``sum_r A_r @ B_r``) and ``GemmAllReduce`` (all of it) follow
the same contract, as does ``RingAttention`` (sequence-parallel attention, forward: K and V pass around
the ring while each rank attends to what has arrived); ``MoE`` (expert-parallel dispatch and combine,
DeepEP low-latency style) too, with two calls per round (``MoE.dispatch_gemm`` fuses the dispatch with
each local expert's GEMM). docs/kernels.md describes each op's math,
layouts and launch contract.

Flags: every kernel takes ``slot_base`` and needs ``op.slots`` flag words from there; a kernel that finds
the session without flags allocates ``slot_base + op.slots`` of them in device memory.
"""

from gpuclient.kernels.allgather_gemm import AllGatherGemm
from gpuclient.kernels.gemm_reduce_scatter import GemmAllReduce, GemmReduceScatter
from gpuclient.kernels.moe import MoE, MoEHandle
from gpuclient.kernels.ring_attention import RingAttention

__all__ = ["AllGatherGemm", "GemmAllReduce", "GemmReduceScatter", "MoE", "MoEHandle", "RingAttention"]
