"""transportd: a per-node RDMA transport daemon for fused multi-node GPU kernels."""

__all__ = ["__version__"]
__version__ = "0.1.0"
