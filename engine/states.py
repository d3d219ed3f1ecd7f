"""The one vocabulary of node states: the mesh stores them, the events carry them, the console shows them.

Torch-free (the console imports it, beside engine/telemetry.py). Each value is a protocol string: the mesh writes it
into `state/<id>` (docs/mesh.md) and a node's `state` event carries it (docs/telemetry.md), so a value never changes
without a protocol change (the store's digest) and a schema change (telemetry.SCHEMA_VERSION). The console adds its
own words for what is not a node of the mesh (a spare host, a host it cannot reach: console/nodes.py `HostState`);
none of them is a word here.
"""

from __future__ import annotations

from enum import Enum


class NodeState(str, Enum):
    """A node's place in the run, as the node itself writes it (`state/<id>`) and says it (a `state` event), and
    as its peers see it (dead).

    STARTING  the process is up and registered, and in no plan yet: a formation candidate, or a restarted member
              that will ask to join.
    JOINING   it asked to join a running run: waits for a plan that admits it, then receives the state.
    TRAINING  a member: it trains its rounds and contributes to each outer step.
    DRAINING  a member that leaves after its next committed outer step (its last round counts).
    STANDBY   a member that stepped out of an outer step (its own link too slow for the run, or it missed the
              state it needed): the planner neither waits for it nor admits it until it asks to join again.
              Never a spare host: that is the console's `spare`.
    LEFT      it exited on purpose (completed, drained, stopped, or failed cleanly: the reason says which).
    DEAD      never written by the node itself: its peers' verdict (heartbeat silent past the timeout, lease
              expired), or the console's when it saw the process die.
    """

    STARTING = "starting"
    JOINING = "joining"
    TRAINING = "training"
    DRAINING = "draining"
    STANDBY = "standby"
    LEFT = "left"
    DEAD = "dead"

    def __str__(self) -> str:
        return self.value


# what a node may write into its own `state/<id>` (DEAD is only ever concluded by others)
STORED_STATES = frozenset(s for s in NodeState if s is not NodeState.DEAD)
# what a node's `state` event says (the session's lifecycle; the mesh's standby goes out as a warning)
EVENT_STATES = frozenset({NodeState.STARTING, NodeState.JOINING, NodeState.TRAINING, NodeState.DRAINING,
                          NodeState.LEFT})