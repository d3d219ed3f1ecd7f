"""Store connection and the per-generation global process group (gloo), independent of torchrun's default group.

    store = open_store(cfg.mesh)                    # mesh.store_backend: a TCPStore client or an EtcdStore
    store = open_store(cfg.mesh, probe_timeout=beat, like=lost)   # the heartbeat's reconnect (etcd: same lease)
    store = connect_store(addr, port, timeout)      # MeshError within `timeout` when unreachable
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

import os
import socket
import time
from datetime import timedelta
from typing import Any

from engine.mesh.protocol import Keys, MeshError, Plan

_groups: dict[tuple[str, int], tuple[int, Any]] = {}  # (node_id, local_rank) -> (generation, group)
_own_keys: dict[tuple[str, int], str] = {}  # (node_id, local_rank) -> this rank's rendezvous key of its last group


def open_store(m: Any, probe_timeout: float | None = None, like: Any = None) -> Any:
    """The membership store mesh config `m` names: the TCPStore at store_addr:store_port, or the run's prefix of an
    etcd cluster (engine/etcd_store.py). Either way a MeshError within `probe_timeout` (default m.store_timeout)
    when it cannot be reached. The heartbeat's reconnect passes the lost client as `like`: on etcd the new client
    shares its lease (the node's heartbeat key stays its own; a new lease would leave the old one renewed)."""
    if m.store_backend == "etcd":
        return connect_etcd(m, probe_timeout, like)
    return connect_store(m.store_addr, m.store_port, m.store_timeout, probe_timeout)


def connect_etcd(m: Any, probe_timeout: float | None = None, like: Any = None) -> Any:
    from engine.etcd_gateway import EtcdError, Tls
    from engine.etcd_store import EtcdStore

    tls = None
    if not m.etcd_insecure:
        for name in ("etcd_ca", "etcd_cert", "etcd_key"):
            if not os.path.isfile(getattr(m, name)):
                raise MeshError(f"mesh.{name}: {getattr(m, name)}: no such file")
        tls = Tls(m.etcd_ca, m.etcd_cert, m.etcd_key)
    # heartbeat keys are leased for one heartbeat timeout: a dead node's key vanishes by itself.
    # one HTTP request may take a quarter of a heartbeat timeout. A member that never answers (a cut link, or a
    # follower holding a proposal it forwarded to a leader that just died: etcd drops it silently) is left for the
    # next one; after a leader's loss a beat lands at most one election plus one request timeout late, which with
    # etcd's default election (1-2 s) fits inside mesh.heartbeat_timeout minus an interval (half the timeout did
    # not: a beat that waited out two such requests got its node declared dead)
    # a reconnect (`like`) probes through the lost client and clones it only once the cluster answers: the gateway
    # fails over by itself, and a clone per failed beat would only pile up connection pools during an outage
    store = like if like is not None else EtcdStore(
        m.etcd_endpoints, prefix=m.etcd_prefix, tls=tls, timeout=m.store_timeout, lease_ttl=m.heartbeat_timeout,
        request_timeout=min(m.heartbeat_timeout / 4, m.store_timeout))
    try:
        store.reach(probe_timeout)  # an unreachable cluster fails here, within the probe timeout
    except EtcdError as e:
        raise MeshError(f"membership store {e}") from None
    return store.clone() if like is not None else store


def connect_store(addr: str, port: int, timeout: float, probe_timeout: float | None = None) -> Any:
    """A TCPStore client whose operations time out after `timeout`. The TCP port is probed first so that an
    unreachable store fails within `probe_timeout` (default: `timeout`; TCPStore's own connect retries can take a
    multiple of it). The heartbeat's reconnect probes for one beat, but its client keeps the full timeout."""
    import torch.distributed as dist

    deadline = time.monotonic() + (timeout if probe_timeout is None else probe_timeout)
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(1.0, remaining))):
                break
        except OSError as e:
            last = e
        if time.monotonic() + 0.2 > deadline:
            raise MeshError(f"membership store {addr}:{port} unreachable within "
                            f"{timeout if probe_timeout is None else probe_timeout:g}s ({last}); start it "
                            f"with `python -m engine.store --port {port}` or fix mesh.store_addr/GLOBAL_ADDR")
        time.sleep(0.2)
    try:
        return dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout), wait_for_workers=False)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MeshError(f"membership store {addr}:{port}: {first}") from None


def _local_address(store: Any) -> str:
    """The address of this host on the route to the store: peers reach the store, so they reach us there."""
    host = getattr(store, "host", "127.0.0.1")
    port = getattr(store, "port", 1)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP connect sends nothing: it only picks the route
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
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MeshError(f"node {node_id}: process group of generation {plan.generation} ({plan.size} members) "
                        f"not formed within {timeout:g}s: {first}") from None
    group = dist.ProcessGroup(prefix_store, rank, plan.size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_group_name(prefix)
    _groups[(node_id, local_rank)] = (plan.generation, group)
    return group


def forget_groups() -> None:
    """Drop the cached groups (after a failed collective the caller moves to a new generation anyway)."""
    _groups.clear()
