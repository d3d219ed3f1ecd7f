"""--resume starts the nodes the run had when it ended (console/cluster.py, Cluster._resumed_nodes), with the fake
engine and store of tests/test_cluster.py."""

from __future__ import annotations

import asyncio
import io

from console import cli
from console.cluster import Cluster
from console.fleet import Fleet, NodeState
from test_cluster import cleanup, make_profile, states, until, workdir  # noqa: F401 -- fixtures used below


async def test_resume_starts_the_nodes_the_run_had_not_the_profiles_active_hosts(workdir, cleanup):
    """Defect: --resume after a stop started the profile's active hosts: node-b, drained on purpose, came back from
    its old checkpoint, and node-c, a standby host added during the run, stayed spare with its checkpoint."""
    profile = make_profile(workdir)
    first = Cluster(profile, Fleet(run="t"))
    nodes = first.fleet.nodes
    await first.start()
    await until(lambda: all(nodes[n].state is NodeState.TRAINING for n in ("node-a", "node-b")), what="a, b")
    assert await first.add("node-c")
    await until(lambda: nodes["node-c"].state is NodeState.TRAINING, what=f"node-c added: {states(first.fleet)}")
    assert await first.drain("node-b")
    await until(lambda: nodes["node-b"].state is NodeState.LEFT, what=f"node-b drained: {states(first.fleet)}")
    assert await first.stop()
    await first.close()
    # attached to the run that ended: its outcome (it said "nothing runs", exit 1, and left the store running)
    ended = Fleet(run="t")
    code = await asyncio.wait_for(cli.run_headless(Cluster(profile, ended), ended, attach=True, interval=0.1,
                                                   out=io.StringIO()), 30)
    assert code == cli.EXIT_STOPPED, states(ended)

    resumed = Cluster(profile, Fleet(run="t"), resume=True)
    nodes = resumed.fleet.nodes
    try:
        await resumed.start()
        await until(lambda: all(nodes[n].state is NodeState.TRAINING for n in ("node-a", "node-c")),
                    what=f"a and c resumed: {states(resumed.fleet)}")
        # left, "drained": a success of the run when the others complete (a reason of its own made the outcome 3)
        assert (nodes["node-b"].state, nodes["node-b"].reason) == (NodeState.LEFT, "drained")
        assert "node-b" not in resumed.running()
        assert (workdir / "runs/t/node-b/events.jsonl").read_text().count('"run_start"') == 1  # not started again
    finally:
        assert await resumed.stop()
        await resumed.close()
