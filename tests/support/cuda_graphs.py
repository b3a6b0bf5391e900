"""CUDA graphs of ranks that one process drives, for the GPU tests and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def capture_per_rank(streams: list[Any], make: Callable[[int], Any]) -> tuple[list[Any], list[Any]]:
    """A graph per rank, capturing ``make(r)`` on rank r's stream (the capture runs nothing; docs/kernels.md,
    launch contract 6); the graphs and what each call returned. ``thread_local``: the daemons' client threads
    may call CUDA while a capture is open."""
    import torch

    graphs, results = [], []
    for r, stream in enumerate(streams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            results.append(make(r))
        graphs.append(graph)
    return graphs, results


def replay_per_rank(graphs: list[Any], streams: list[Any]) -> None:
    """Every rank's graph replayed on its stream, queued and not waited for (the caller synchronizes as its
    measurement needs)."""
    import torch

    for graph, stream in zip(graphs, streams, strict=True):
        with torch.cuda.stream(stream):
            graph.replay()
