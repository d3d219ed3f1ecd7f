"""The scale goal of the membership protocol, held by a test: bench/mesh_scale.py's simulation (the real Mesh of every
node over one counting MemoryStore, 60 ms per store round trip, simulated time) at a few sizes. The bench itself runs
4 to 1024 nodes by hand (docs/mesh.md, "Scale"); here the sizes stay small enough for CI, and what is asserted is that
nothing grows with N: round trips per heartbeat tick and per node per outer step, the time to a plan, and keys per
live node."""

from __future__ import annotations

import sys

from procs import ROOT, free_port

sys.path.insert(0, str(ROOT / "bench"))
import mesh_scale  # noqa: E402

RTT = 0.06


def test_store_round_trips_per_node_do_not_grow_with_the_number_of_nodes():
    small, large = (mesh_scale.measure(n, RTT) for n in (4, 256))
    for r in (small, large):
        assert r["ok"] and r["deaths"] == 0 and r["members"] == r["n"], r  # no healthy node left out of a plan
        assert r["tick_ops"] == 3, r  # add my counter, compare_set the registry, one multi_get of every counter
    # one outer step: arrival, the plan, the post and the decision; a constant per node, not a scan of the others
    assert large["step_ops"] <= 10 and large["step_ops"] <= small["step_ops"] * 1.25, (small, large)
    # the leader plans from one read of the table: the time to a plan does not grow with N at a fixed RTT
    assert large["boundary_s"] <= small["boundary_s"] + 2 * RTT, (small, large)
    # keys are bounded by the live nodes (a handful each), not by history
    assert large["keys"] <= 4 * large["n"] + 20, large


def test_rebuilt_process_groups_leave_one_rendezvous_key_per_local_rank():
    """Every new generation builds a gloo group under zb/pg/<generation>/<local rank>; gloo writes one key per rank
    there. A node deletes its key of the previous generation as it builds the next, so a run of any length keeps one
    such key per live node and local rank (defect 9 of issue 13: pg keys were never cleaned)."""
    from datetime import timedelta

    import torch.distributed as dist

    from engine.mesh.group import make_group
    from engine.mesh.protocol import Plan

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    base = store.num_keys()
    node = "pg-keys-test"  # an id no other test in this process builds groups for (groups are cached per id)
    counts = []
    for generation in range(1, 31):
        plan = Plan(generation=generation, outer_step=generation, attempt=0, members=(node,))
        for local_rank in (0, 1):
            make_group(store, plan, node, local_rank, 10.0)
        counts.append(store.num_keys() - base)
    assert counts == [2] * 30, counts
