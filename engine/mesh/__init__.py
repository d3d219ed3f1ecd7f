"""The elastic membership mesh over a TCPStore or etcd (docs/mesh.md is the protocol).

    store = open_store(cfg.mesh)        # mesh.store_backend: tcp (TCPStore) or etcd (engine/store/etcd.py)
    mesh = Mesh(store, node_id, cfg.mesh, digest=..., info={...}, min_nodes=cfg.diloco.min_nodes, emit=tel.emit)
    is_joiner = mesh.start()
    plan = mesh.wait_admission() if is_joiner else mesh.boundary(k, 0, contributing=True, draining=False)
    group = make_group(store, plan, node_id, local_rank, timeout)
    ok = mesh.commit(plan, succeeded)      # False: abort, redo (k, attempt + 1)
    mesh.leave("completed")

protocol.py holds the pure rules; node.py the API and its waits (Mesh), composed of registration.py (the id and
start-up), heartbeat.py (liveness, lease, pruning, store loss), planner.py (the planner's reads and writes),
polling.py (what every wait checks) and admission.py (stepping out, and a joiner's wait), which share
membership.py; connect.py the store client (one StoreBackend per mesh.store_backend), group.py the process groups.
"""

from engine.mesh.connect import StoreBackend, connect_store, open_store, store_backend
from engine.mesh.group import attempt_decided, forget_groups, make_group
from engine.store.memory import MemoryStore
from engine.mesh.node import Mesh
from engine.mesh.protocol import (ABORT, COMMIT, NODE_STATES, Arrival, BoundaryView, Excluded, Keys, Liveness,
                                  MeshError, Plan, Reformed, StateRecord, Stopped, compute_plan, decide)

__all__ = ["ABORT", "COMMIT", "NODE_STATES", "Arrival", "attempt_decided", "BoundaryView", "Excluded", "Keys",
           "Liveness", "Mesh", "MemoryStore", "MeshError", "Plan", "Reformed", "StateRecord", "Stopped", "StoreBackend",
           "compute_plan", "connect_store", "decide", "forget_groups", "make_group", "open_store", "store_backend"]
