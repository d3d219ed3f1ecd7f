"""The node table's row cells, pure: what an operator reads for a node that runs and for one that is gone."""

from __future__ import annotations

import time

from console.fleet import Fleet, HostState, NodeState
from console.widgets.node_table import node_row


def _fleet_with_sample() -> Fleet:
    fleet = Fleet(run="t")
    fleet.add_node("node-a", "local", NodeState.STARTING)
    fleet.ingest_event("node-a", {"v": 1, "type": "resource", "ts": time.time(), "node": "node-a", "rank": 0,
                                  "device": "cpu", "util": 97.5, "mem_used": 600 * 2**20, "mem_total": 2**34})
    fleet.ingest_event("node-a", {"v": 1, "type": "state", "ts": time.time(), "node": "node-a", "rank": 0,
                                  "state": "training"})
    return fleet


def test_a_running_node_shows_its_labelled_cpu_sample():
    row = node_row(_fleet_with_sample().nodes["node-a"], heartbeat_timeout=6.0)
    assert str(row["util"]) == "CPU  97.5%" and "RSS" in str(row["mem"]) and "600" in str(row["mem"])


def test_a_dead_or_left_node_shows_no_utilization():
    for state in (NodeState.DEAD, NodeState.LEFT, HostState.FAILED):
        fleet = _fleet_with_sample()
        fleet.set_state("node-a", state, "gone")
        row = node_row(fleet.nodes["node-a"], heartbeat_timeout=6.0)
        assert "%" not in str(row["util"]) and "RSS" not in str(row["mem"]), state
