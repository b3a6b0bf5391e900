"""An op's round number, kept in device memory, so that its launches can be captured in a CUDA graph.

A fused op's launch k waits for flag values derived from k (flags are monotonic: nothing is reset). Passed as
a launch argument, k would be frozen into a captured graph, and every replay would wait for values its flags
passed long ago. So each op keeps its round in a small int32 tensor (:func:`round_words`): word 0 the number
of rounds run, word 1 a count of the programs that finished the current launch (0 between launches; MoE adds
word 2, its fused rounds). A launch reads its round at the start (:func:`this_round`), and the last of its
programs to finish stores it (:func:`last_to_finish`), so the next launch in stream order, replayed or not,
runs the next round. No launch writes the round before all of its programs have read it: the last program
is last only once every program has counted itself finished, each after its own read (release order).

A launch that moves nothing (``communicate=False``) leaves it as it was.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


def round_words(device: Any, words: int = 2) -> Any:
    """A fresh round tensor on ``device`` (int32, zeros: no round run yet)."""
    import torch

    return torch.zeros(words, dtype=torch.int32, device=device)


@triton.jit
def this_round(rounds_ptr):
    """The round this launch runs: one past the last one a launch finished."""
    return tl.load(rounds_ptr) + 1


@triton.jit
def last_to_finish(rounds_ptr):
    """Called once by every program of a launch, as its last step: True in the last program to call it, which
    then resets the count for the next launch and may store the round (``tl.store(rounds_ptr, epoch)``)."""
    tl.debug_barrier()  # every thread of the program is past its reads of the round
    finished = tl.atomic_add(rounds_ptr + 1, 1, sem="acq_rel", scope="gpu")
    last = finished == tl.num_programs(0) - 1
    if last:
        tl.store(rounds_ptr + 1, 0)
    return last
