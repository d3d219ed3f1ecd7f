"""The membership store's backend, as the console runs it: one interface, an implementation per `store.backend`.

    backend = store_backend(profile)     # the one place that reads store.backend: TcpStore or EtcdStore
    backend.servers()                    # what the console runs for it, by host, and the ports each must bind
    backend.links()                      # what every engine host must be able to dial before a start
    backend.engine_overrides(node)       # the engine's mesh.* keys for it (console/launch.py)
    store = backend.host(hosts, on_failed)   # its life during a session: start, attach, watch, stop

    base.py   the interface (StoreBackend, StoreHost) and what both use (Endpoint, Server, bind_errors)
    tcp.py    one `python -m engine.store` on the store host, restarted when it dies, its health probe beside it
    etcd.py   etcd members the console runs (console/etcd.py), or an etcd that runs already

A new backend is a module here with both faces, and a line in BACKENDS.
"""

from __future__ import annotations

from typing import Callable

from console.profile import Profile
from console.store.base import StoreBackend
from console.store.etcd import EtcdStore
from console.store.tcp import TcpStore

BACKENDS: dict[str, Callable[[Profile], StoreBackend]] = {"tcp": TcpStore, "etcd": EtcdStore}


def store_backend(profile: Profile) -> StoreBackend:
    return BACKENDS[profile.store.backend](profile)
