"""A node's connection to the membership store (the implementations live in engine/store/).

    store = open_store(cfg.mesh)                    # mesh.store_backend: a TCPStore client or an EtcdStore
    store = open_store(cfg.mesh, probe_timeout=beat, like=lost)   # the heartbeat's reconnect (etcd: same lease)
    store = connect_store(addr, port, timeout)      # MeshError within `timeout` when unreachable

Each value of mesh.store_backend is one StoreBackend (BACKENDS): how a node reaches that store. A new backend is a
class here with its `open`, one entry in BACKENDS, and the value in engine/config.py's MeshConfig.store_backend
(with the checks of its own settings). What a client of any backend must provide is engine/store/memory.py's list.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Protocol

from engine.errors import first_line
from engine.mesh.protocol import MeshError


class StoreBackend(Protocol):
    """The membership store of one mesh.store_backend value, as a node reaches it."""

    def open(self, probe_timeout: float | None = None, like: Any = None) -> Any:
        """A client of the store: a MeshError within `probe_timeout` (default mesh.store_timeout) when it cannot be
        reached. `like`: the lost client a reconnect replaces."""
        ...


class TcpBackend:
    """One TCPStore process at mesh.store_addr:store_port (`python -m engine.store`)."""

    def __init__(self, m: Any) -> None:
        self.m = m

    def open(self, probe_timeout: float | None = None, like: Any = None) -> Any:
        m = self.m  # a lost TCPStore client holds nothing worth keeping: a new one (`like` unused)
        return connect_store(m.store_addr, m.store_port, m.store_timeout, probe_timeout)


class EtcdBackend:
    """The run's prefix (mesh.etcd_prefix) of a replicated etcd cluster (engine/store/etcd.py), over TLS with a
    client certificate unless mesh.etcd_insecure. Heartbeat keys are leased: a dead node's key vanishes by itself."""

    def __init__(self, m: Any) -> None:
        self.m = m

    def open(self, probe_timeout: float | None = None, like: Any = None) -> Any:
        return connect_etcd(self.m, probe_timeout, like)


BACKENDS: dict[str, Callable[[Any], StoreBackend]] = {"tcp": TcpBackend, "etcd": EtcdBackend}


def store_backend(m: Any) -> StoreBackend:
    """The StoreBackend mesh config `m` names (mesh.store_backend)."""
    return BACKENDS[m.store_backend](m)


def open_store(m: Any, probe_timeout: float | None = None, like: Any = None) -> Any:
    """The membership store mesh config `m` names: the TCPStore at store_addr:store_port, or the run's prefix of an
    etcd cluster (engine/store/etcd.py). Either way a MeshError within `probe_timeout` (default m.store_timeout)
    when it cannot be reached. The heartbeat's reconnect passes the lost client as `like`: on etcd the new client
    shares its lease (the node's heartbeat key stays its own; a new lease would leave the old one renewed)."""
    return store_backend(m).open(probe_timeout, like)


def connect_etcd(m: Any, probe_timeout: float | None = None, like: Any = None) -> Any:
    from engine.store.etcd_gateway import EtcdError, Tls
    from engine.store.etcd import EtcdStore

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
                            f"with `python -m engine.store --host {addr} --port {port}` (on the machine of that "
                            "address) or fix mesh.store_addr/GLOBAL_ADDR")
        time.sleep(0.2)
    try:
        return dist.TCPStore(addr, port, None, False, timedelta(seconds=timeout), wait_for_workers=False)
    except RuntimeError as e:
        raise MeshError(f"membership store {addr}:{port}: {first_line(e)}") from None
