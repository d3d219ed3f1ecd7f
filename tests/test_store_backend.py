"""The store's backend as the checks see it (console/store/): what the console runs for it, by host, with
the ports each binds, and what every engine host dials; the preflight's plans are built from these alone."""

from __future__ import annotations

from pathlib import Path

from console.preflight.runner import build_plans
from console.profile import load_profile
from console.store import store_backend
from console.store.base import Endpoint, Server
from console.store.etcd import EtcdStore
from console.store.tcp import TcpStore
from test_console_etcd import _profile as etcd_profile

ROOT = Path(__file__).resolve().parent.parent


def test_tcp_one_store_on_its_host_dialled_by_every_engine():
    profile = load_profile(ROOT / "profiles" / "local.toml")
    backend = store_backend(profile)
    assert isinstance(backend, TcpStore)
    assert backend.servers() == [Server("node-a", "store", (Endpoint("127.0.0.1", 29610, "the store"),))]
    assert backend.links() == [Endpoint("127.0.0.1", 29610, "the store")]
    plans = {p.name: p for p in build_plans(profile, "start", None, None)}
    assert sorted(plans["node-a"].roles) == ["engine", "store"] and [str(t) for t in plans["node-a"].binds] == \
        ["127.0.0.1:29610"]
    assert plans["node-b"].binds == () and [str(t) for t in plans["node-b"].links] == ["127.0.0.1:29610"]


def test_etcd_one_member_per_host_two_ports_each_and_an_add_binds_none(tmp_path):
    profile = etcd_profile(tmp_path)
    client, peer = profile.store.etcd_client_port, profile.store.etcd_peer_port
    backend = store_backend(profile)
    assert isinstance(backend, EtcdStore)
    servers = backend.servers()
    assert [(s.host, s.role) for s in servers] == [("node-a", "etcd"), ("node-b", "etcd"), ("node-c", "etcd")]
    # member i on client + 2i and peer + 2i: three members on one machine never share a port
    assert [[e.port for e in s.binds] for s in servers] == [[client + 2 * i, peer + 2 * i] for i in range(3)]
    assert [e.port for e in backend.links()] == [client, client + 2, client + 4]
    plans = {p.name: p for p in build_plans(profile, "start", None, None)}
    assert sorted(plans["node-c"].roles) == ["etcd"]  # a standby host: a member, not an engine
    assert [t.port for t in plans["node-c"].binds] == [client + 4, peer + 4]
    added = build_plans(profile, "add", ["node-c"], None)
    assert [(sorted(p.roles), p.binds) for p in added] == [(["engine"], ())]
