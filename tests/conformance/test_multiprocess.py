"""Two processes ("nodes") exchange 10^5 random RDMA writes and write-with-imm over SRD, every byte checked."""

from __future__ import annotations

import multiprocessing as mp

from tests.conformance import mp_node

N_OPS = 50_000  # per direction: 10^5 work requests in all
SIZE_MAX = 2048
TIMEOUT_S = 240.0


def test_two_nodes_exchange_random_writes_over_srd(provider) -> None:
    device = provider.need_efa()
    ctx = mp.get_context("spawn")
    peer_a, peer_b = ctx.Pipe()
    res_a_r, res_a_w = ctx.Pipe(duplex=False)
    res_b_r, res_b_w = ctx.Pipe(duplex=False)
    nodes = [ctx.Process(target=mp_node.run_node, args=(peer_a, res_a_w, provider.name, device, 11, 22, N_OPS,
                                                         SIZE_MAX, TIMEOUT_S), daemon=True),
             ctx.Process(target=mp_node.run_node, args=(peer_b, res_b_w, provider.name, device, 22, 11, N_OPS,
                                                         SIZE_MAX, TIMEOUT_S), daemon=True)]
    for p in nodes:
        p.start()
    try:
        results = []
        for r in (res_a_r, res_b_r):
            assert r.poll(TIMEOUT_S + 30), "a node neither finished nor reported an error"
            results.append(r.recv())
    finally:
        for p in nodes:
            p.join(10)
            if p.is_alive():
                p.kill()
    for res in results:
        assert "error" not in res, res["error"]
        assert res["sent"] == N_OPS
        assert res["bad_bytes"] == 0, f"{res['bad_bytes']} wrong bytes, first at {res['first_bad']}"
    sizes_a, _, imm_a = mp_node.layout(11, N_OPS, SIZE_MAX)
    assert results[1]["received_imm"] == int(imm_a.sum())
    assert results[1]["bytes"] == int(sizes_a.sum())
