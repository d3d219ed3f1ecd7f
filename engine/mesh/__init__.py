"""The elastic membership mesh over a TCPStore (docs/mesh.md is the protocol).

    store = connect_store(addr, port, timeout)
    mesh = Mesh(store, node_id, cfg.mesh, digest=..., info={...}, min_nodes=cfg.diloco.min_nodes, emit=tel.emit)
    is_joiner = mesh.start()
    plan = mesh.wait_admission() if is_joiner else mesh.boundary(k, 0, contributing=True, draining=False)
    group = make_group(store, plan, node_id, local_rank, timeout)
    ok = mesh.commit(plan, succeeded)      # False: abort, redo (k, attempt + 1)
    mesh.leave("completed")

protocol.py holds the pure rules, node.py the node's I/O, group.py the store client and process groups.
"""

from engine.mesh.group import connect_store, forget_groups, make_group
from engine.mesh.memstore import MemoryStore
from engine.mesh.node import Mesh
from engine.mesh.protocol import (ABORT, COMMIT, NODE_STATES, Arrival, BoundaryView, Excluded, Keys, Liveness,
                                  MeshError, Plan, compute_plan, decide)

__all__ = ["ABORT", "COMMIT", "NODE_STATES", "Arrival", "BoundaryView", "Excluded", "Keys", "Liveness", "Mesh",
           "MemoryStore", "MeshError", "Plan", "compute_plan", "connect_store", "decide", "forget_groups",
           "make_group"]
