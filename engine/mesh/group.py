"""Store connection and the per-generation global process group (gloo), independent of torchrun's default group.

    store = connect_store(addr, port, timeout)      # MeshError within `timeout` when unreachable
    group = make_group(store, plan, node_id, local_rank, timeout)

A group lives under its own store prefix zb/pg/<generation>/<local_rank>, so a rebuilt group never meets the
rendezvous keys of a broken one, and local rank i of every node meets only local rank i of the others (FSDP
shards). Consecutive plans of one generation have the same members: the group is reused (one cached group per
local rank), so a run with a stable membership pays the gloo rendezvous once.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

from engine.mesh.protocol import Keys, MeshError, Plan

_groups: dict[tuple[str, int], tuple[int, Any]] = {}  # (node_id, local_rank) -> (generation, group)


def connect_store(addr: str, port: int, timeout: float) -> Any:
    """A TCPStore client. The TCP port is probed first so that an unreachable store fails within `timeout`
    (TCPStore's own connect retries can take a multiple of it)."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(1.0, remaining))):
                break
        except OSError as e:
            last = e
        if time.monotonic() + 0.2 > deadline:
            raise MeshError(f"membership store {addr}:{port} unreachable within {timeout:g}s ({last}); start it "
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
    prefix = Keys().group_prefix(plan.generation, local_rank)
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
