"""The per-generation global process group (gloo), independent of torchrun's default group.

    group = make_group(store, plan, node_id, local_rank, timeout)

A group lives under its own store prefix zb/pg/<generation>/<local_rank>, so a rebuilt group never meets the
rendezvous keys of a broken one, and local rank i of every node meets only local rank i of the others (FSDP
shards). Consecutive plans of one generation have the same members: the group is reused (one cached group per
local rank), so a run with a stable membership pays the gloo rendezvous once. gloo writes one key per rank
(`<prefix>/0/<rank>`); a node deletes its key of the previous generation when it builds the next one, and the
mesh's pruner deletes the key of a node that died (from the group recorded in its state), so the store keeps at
most one such key per live node and local rank.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

from engine.errors import first_line
from engine.mesh.membership import text
from engine.mesh.protocol import Keys, Liveness, MeshError, Plan
from engine.store.server import resolve

_groups: dict[tuple[str, int], tuple[int, Any]] = {}  # (node_id, local_rank) -> (generation, group)
_own_keys: dict[tuple[str, int], str] = {}  # (node_id, local_rank) -> this rank's rendezvous key of its last group


def _local_address(store: Any) -> str:
    """The address of this host on the route to the store: peers reach the store, so they reach us there."""
    host = getattr(store, "host", "127.0.0.1")
    port = getattr(store, "port", 1)
    try:
        family, address = resolve(host, port, socket.SOCK_DGRAM)  # the family the store is dialled in
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)  # UDP connect sends nothing: it only picks the route (IPv4 or IPv6, as the store's)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def make_group(store: Any, plan: Plan, node_id: str, local_rank: int, timeout: float) -> Any:
    """The gloo process group of plan.members (rank = position in members). Blocks until every member has
    joined the rendezvous, at most `timeout` seconds (also the timeout of every collective on it)."""
    import torch
    import torch.distributed as dist

    rank = plan.rank_of(node_id)
    cached = _groups.get((node_id, local_rank))
    if cached is not None and cached[0] == plan.generation:
        return cached[1]
    _groups.pop((node_id, local_rank), None)  # drop the old generation's group before building the new one
    old_key = _own_keys.pop((node_id, local_rank), None)
    if old_key is not None:
        store.delete_key(old_key)  # every member that needed it connected long ago (that group ran collectives)
    keys = Keys()
    prefix = keys.group_prefix(plan.generation, local_rank)
    _own_keys[(node_id, local_rank)] = keys.group_key(plan.generation, local_rank, rank)
    prefix_store = dist.PrefixStore(prefix, store)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(store))]
    try:
        backend = dist.ProcessGroupGloo(prefix_store, rank, plan.size, opts)
    except RuntimeError as e:
        raise MeshError(f"node {node_id}: process group of generation {plan.generation} ({plan.size} members) "
                        f"not formed within {timeout:g}s: {first_line(e)}") from None
    group = dist.ProcessGroup(prefix_store, rank, plan.size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_group_name(prefix)
    _groups[(node_id, local_rank)] = (plan.generation, group)
    return group


def forget_groups(store_restarted: bool = False) -> None:
    """Drop the cached groups (after a failed collective the caller moves to a new generation anyway). After a store
    restart also the rendezvous keys this process would delete at its next group: they were the old store's, and
    the new store's generations count from 1 again, so the key of that name may be another member's fresh one
    (its deletion left the group's rendezvous waiting out allreduce_timeout)."""
    _groups.clear()
    if store_restarted:
        _own_keys.clear()


def attempt_decided(store: Any, plan: Plan) -> bool:
    """Whether the plan's attempt has been decided (commit or abort): one read of its decision key, for any local
    rank (only local rank 0 owns a Mesh). A collective still running after the decision is of no use."""
    key = Keys().decision(plan.epoch, plan.outer_step, plan.attempt)
    return bool(store.check([key]) and store.get(key))


class PeerWatch:
    """The liveness of a few members, for a local rank that holds no Mesh (local rank > 0 of a node): their heartbeat
    counters read from the store on each look and judged as the heartbeat judges them (Liveness). A node's hand-off
    chains run on every local rank, and without this only local rank 0 could give up on a dead member: the others
    waited for gloo's timeout (diloco.allreduce_timeout) while their node stood still.

    A member first seen gets a full mesh.heartbeat_timeout of grace; a key gone from a store with leases (etcd) is
    death at once, and so is a key gone from any store (the leader pruned a long-dead id) or a negative counter (a
    clean exit)."""

    def __init__(self, store: Any, timeout: float, clock: Any = None) -> None:
        self.store, self.liveness, self.clock = store, Liveness(timeout), clock or time.monotonic
        self.keys = Keys()

    def dead(self, nodes: list[str]) -> list[str]:
        if not nodes:
            return []
        now = self.clock()
        self.liveness.look(now)
        keys = [self.keys.hb(n) for n in nodes]
        if hasattr(self.store, "multi_get_or_none"):
            values = self.store.multi_get_or_none(keys)
        elif self.store.check(keys):  # torch's TCPStore: a read of a missing key would wait for it
            values = self.store.multi_get(keys)
        else:
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        for node, raw in zip(nodes, values):
            self.liveness.see(node, None if raw is None else int(text(raw)), now)
        return [n for n in nodes if self.liveness.is_dead(n, now)]
