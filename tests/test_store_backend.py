"""The store's backend as the checks see it (console/store/): what the console runs for it, by host, with
the ports each binds, and what every engine host dials; the preflight's plans are built from these alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


def test_each_backend_has_its_own_store_rules_and_the_engines_keys(tmp_path):
    """The [store] rules are the profile's backend's own (profile.py's _STORE_RULES): etcd keys under a TCP store
    are one line naming the file, the line of `backend` and what to set; the same keys under etcd are that
    backend's to judge. The engines' mesh.* keys come from the backend too: none for TCP (its address is in their
    environment), the endpoints and the node's certificate for etcd."""
    from console.profile import ProfileError, parse_profile

    text = (ROOT / "profiles" / "local.toml").read_text()
    assert "backend" not in text.split("[store]")[1].split("[")[0]  # the TCP store by default
    tcp = text.replace("[store]\n", "[store]\nbackend = \"tcp\"\netcd_endpoints = [\"10.0.0.1:2379\"]\n", 1)
    line = tcp.splitlines().index('backend = "tcp"') + 1
    with pytest.raises(ProfileError) as e:
        parse_profile(tcp, "local.toml")
    assert str(e.value) == (f"local.toml:{line}: store.backend: etcd_hosts / etcd_endpoints are given but backend "
                            f"is 'tcp' (set backend = \"etcd\")")
    assert store_backend(load_profile(ROOT / "profiles" / "local.toml")).engine_overrides("node-a") == {}
    etcd = etcd_profile(tmp_path)
    keys = store_backend(etcd).engine_overrides("node-b")
    assert keys["mesh.store_backend"] == "etcd" and keys["mesh.etcd_cert"].endswith("/node-b/pki/client.crt")


def test_the_store_backend_is_read_in_one_place():
    """No `if backend == ...` in the console: console/store/ picks the implementation (BACKENDS) and profile.py's
    rules table is the only other reader of store.backend; each part asks the interface."""
    readers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "console").rglob("*.py")
                     if re.search(r"\bbackend\s*[!=]=", p.read_text()))
    assert readers == []
    picks = [str(p.relative_to(ROOT)) for p in (ROOT / "console").rglob("*.py")
             if re.search(r"\.store\.backend\b", p.read_text())]
    assert sorted(picks) == ["console/profile.py", "console/store/__init__.py"]
