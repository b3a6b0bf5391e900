"""The data plane: a rail's worker process and its link to the main process, the proxy over the compiled
engine, ring-record translation and batching, and flag publication into GPU memory. The flag file's layout is
the contract's (``cmd_ring.flagfile``; ``flagfile`` here is the same module under its old name)."""
