"""The data plane: a rail's worker process and its link to the main process, the proxy over the compiled
engine, ring-record translation and batching, flag files and flag publication into GPU memory."""
