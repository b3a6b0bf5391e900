"""Two processes ("nodes") exchange 10^5 random RDMA writes and write-with-imm over SRD, every byte checked.

The nodes keep application-level credits for write-with-imm (see mp_node): SRD has no flow control of
its own, and a peer that runs ahead of a receiver that is not being scheduled overruns the receiver's CQ.
`hold` makes that schedule explicit: one node polls nothing until its peer has finished sending or has
run out of credits.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest

from tests.conformance import mp_node

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

N_OPS = 50_000  # per direction: 10^5 work requests in all
N_OPS_HELD = 20_000  # per direction; about 10^4 write-with-imm, more than a held receiver's CQ has room for
SIZE_MAX = 2048
TIMEOUT_S = 240.0


def _exchange(provider: Any, n_ops: int, credits: bool = True, hold_b: bool = False) -> list[dict[str, Any]]:
    """Run nodes A (seed 11) and B (seed 22); both results, errors included."""
    device = provider.need_efa()
    ctx = mp.get_context("spawn")
    peer_a, peer_b = ctx.Pipe()
    res_a_r, res_a_w = ctx.Pipe(duplex=False)
    res_b_r, res_b_w = ctx.Pipe(duplex=False)
    common = (provider.name, device)
    nodes = [ctx.Process(target=mp_node.run_node, args=(peer_a, res_a_w, *common, 11, 22, n_ops, SIZE_MAX, TIMEOUT_S,
                                                         credits, False), daemon=True),
             ctx.Process(target=mp_node.run_node, args=(peer_b, res_b_w, *common, 22, 11, n_ops, SIZE_MAX, TIMEOUT_S,
                                                         credits, hold_b), daemon=True)]
    for p in nodes:
        p.start()
    try:
        results = []
        for name, r in (("A", res_a_r), ("B", res_b_r)):
            assert r.poll(TIMEOUT_S + 30), f"node {name} neither finished nor reported an error"
            results.append(r.recv())
    finally:
        for p in nodes:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results


def _check(results: list[dict[str, Any]], n_ops: int) -> None:
    errors = {name: res["error"] for name, res in zip("AB", results, strict=True) if "error" in res}
    assert not errors, errors  # both nodes': the first to fail is often not the first in line
    for res in results:
        assert res["sent"] == n_ops
        assert res["bad_bytes"] == 0, f"{res['bad_bytes']} wrong bytes, first at {res['first_bad']}"
    for (seed, _), res in zip(((11, 22), (22, 11)), reversed(results), strict=True):
        sizes, _, imm = mp_node.layout(seed, n_ops, SIZE_MAX)
        assert res["received_imm"] == int(imm.sum())
        assert res["bytes"] == int(sizes.sum())


def test_two_nodes_exchange_random_writes_over_srd(provider) -> None:
    _check(_exchange(provider, N_OPS), N_OPS)


def test_srd_exchange_with_a_receiver_that_stops_polling(provider) -> None:
    """B polls nothing until A is out of credits: A stops at the credit window, B's CQ holds it all."""
    _check(_exchange(provider, N_OPS_HELD, hold_b=True), N_OPS_HELD)


def test_srd_write_imm_without_credits_overruns_a_receiver_that_stops_polling(provider) -> None:
    """What the credits prevent. Without them A completes every write while B is not polling (SRD acks
    a write once placed, whatever the state of the CQ), B's CQ overflows, and B's next poll says so."""
    if not provider.soft:
        pytest.skip("a NIC reports a CQ overrun as an asynchronous event; softverbs has its next poll fail")
    _, _, imm_a = mp_node.layout(11, N_OPS_HELD, SIZE_MAX)
    assert int(imm_a.sum()) > mp_node.CQE
    res_a, res_b = _exchange(provider, N_OPS_HELD, credits=False, hold_b=True)
    assert "overrun" in res_b.get("error", ""), res_b
    assert "peer failed" in res_a.get("error", ""), res_a
