"""The etcd store against a real 3-member etcd cluster (TLS with client certificates): the same answers as the
in-memory store the protocol tests use, atomic counters under concurrency, gloo's rendezvous through a PrefixStore,
leased keys that vanish when their process is SIGKILLed, and a client without a certificate refused."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from datetime import timedelta

import pytest

from engine.store.etcd_gateway import EtcdError, Gateway, Tls, cluster_health
from engine.store.etcd import EtcdStore
from engine.mesh import MemoryStore


def _etcd(cluster, timeout: float = 5.0, **kw) -> EtcdStore:
    return EtcdStore(cluster.endpoints, prefix=f"test/{uuid.uuid4().hex[:8]}/", tls=cluster.tls, timeout=timeout,
                     **kw)


def _script(store) -> list:
    """What the mesh relies on, as a list of answers (run on both stores, compared)."""
    out = [store.set("a", "1"), store.get("a"), store.add("n", 0), store.add("n", 5), store.add("n", -2),
           store.compare_set("c", "", "first"), store.compare_set("c", "", "second"),
           store.compare_set("c", "first", "third"), store.compare_set("c", "nope", "x"), store.get("c"),
           store.compare_set("missing", "x", "y"), store.check(["missing"]), store.check(["a", "c"]),
           store.check(["a", "missing"]), store.delete_key("a"), store.delete_key("a"), store.check(["a"]),
           store.set("bin", b"\x00\xff"), store.get("bin")]
    with pytest.raises(LookupError):
        store.get("missing")
    return out


def test_same_answers_as_the_memory_store(etcd_cluster):
    assert _script(_etcd(etcd_cluster, timeout=0.3)) == _script(MemoryStore())


def test_multi_get_multi_set_num_keys_wait_and_prefix_isolation(etcd_cluster):
    store, other = _etcd(etcd_cluster), _etcd(etcd_cluster)
    store.multi_set(["x", "y", "z"], ["1", b"2", "3"])
    assert store.multi_get(["z", "x"]) == [b"3", b"1"] and store.num_keys() == 3
    assert other.num_keys() == 0 and not other.check(["x"])  # another run's prefix sees nothing
    threading.Timer(0.3, lambda: other.set("late", "ok")).start()
    t0 = time.monotonic()
    other.wait(["late"])
    assert other.get("late") == b"ok" and 0.2 < time.monotonic() - t0 < 3
    with pytest.raises(LookupError, match="waited 0.2s"):
        other.wait(["never"], timedelta(seconds=0.2))


def test_concurrent_adds_are_atomic(etcd_cluster):
    store = _etcd(etcd_cluster)
    clones = [store.clone() for _ in range(4)]
    seen: list[int] = []
    threads = [threading.Thread(target=lambda s=s: seen.extend(s.add("count", 1) for _ in range(15))) for s in clones]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert store.add("count", 0) == 60 and sorted(seen) == list(range(1, 61))  # every value handed out once


def test_gloo_rendezvous_and_allreduce_through_a_prefix_store(etcd_cluster):
    import torch
    import torch.distributed as dist

    store = _etcd(etcd_cluster, timeout=30.0)
    results: dict[int, float] = {}

    def rank(r: int) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        mine = store.clone()  # held: C++ finds the Python methods only while the Python object lives
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/0/", mine), r, 2, opts)
        t = torch.tensor([float(r + 1)])
        pg.allreduce([t]).wait()
        results[r] = t.item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {0: 3.0, 1: 3.0}


LEASED = r'''
import sys, time
from engine.store.etcd_gateway import Tls
from engine.store.etcd import EtcdStore
ca, cert, key, prefix, *endpoints = sys.argv[1:]
store = EtcdStore(endpoints, prefix=prefix, tls=Tls(ca, cert, key), timeout=10.0, lease_ttl=2.0)
store.lease_key("hb/me")
store.add("hb/me", 1)
store.clone().add("hb/me", 1)  # the heartbeat thread's clone writes with the same lease
store.set("bye/me", "kept")
print("ready", flush=True)
time.sleep(600)
'''


def test_a_leased_key_vanishes_within_its_ttl_after_sigkill(etcd_cluster, procs):
    prefix = f"test/{uuid.uuid4().hex[:8]}/"
    tls = etcd_cluster.tls
    proc = procs.start([sys.executable, "-c", LEASED, tls.ca, tls.cert, tls.key, prefix, *etcd_cluster.endpoints])
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.poll() is not None else ""
    store = EtcdStore(etcd_cluster.endpoints, prefix=prefix, tls=tls, timeout=5.0)
    time.sleep(3.0)  # longer than the TTL: the keepalive thread holds the key
    assert store.add("hb/me", 0) == 2
    proc.kill()
    t0 = time.monotonic()
    while store.check(["hb/me"]):
        assert time.monotonic() - t0 < 2.0 + 3.0, "leased key outlived its TTL"  # etcd checks expiry every 0.5 s
        time.sleep(0.1)
    assert store.get("bye/me") == b"kept"  # only leased keys go


def test_a_client_without_a_certificate_is_refused(etcd_cluster):
    t0 = time.monotonic()
    with pytest.raises(EtcdError, match="TLS refused"):
        Gateway(etcd_cluster.endpoints, tls=Tls(etcd_cluster.tls.ca), timeout=10.0).call("kv/range", {"key": "YQ=="})
    assert time.monotonic() - t0 < 5  # refused at once, not retried until the deadline
    with pytest.raises(EtcdError):  # plain http to a TLS port: no answer either
        Gateway(etcd_cluster.endpoints, tls=None, timeout=1.0).call("kv/range", {"key": "YQ=="})
    with_cert = Gateway(etcd_cluster.endpoints, tls=etcd_cluster.tls, timeout=10.0)
    assert "header" in with_cert.call("kv/range", {"key": "YQ=="})


def test_health_counts_members_up_and_names_the_leader(etcd_cluster):
    health = cluster_health(etcd_cluster.endpoints, etcd_cluster.tls)
    assert health.up == 3 and health.total == 3 and health.leader in {"m0", "m1", "m2"}
    assert health.label() == f"etcd 3/3 up, leader {health.leader}"


def test_config_rules_for_the_etcd_backend(tmp_path):
    from engine.config import ConfigError, load_config

    base = tmp_path / "c.toml"
    base.write_text("[data]\nfake = true\n[mesh]\nstore_backend = \"etcd\"\n")
    with pytest.raises(ConfigError, match="needs mesh.etcd_endpoints"):
        load_config(str(base), [])
    with pytest.raises(ConfigError, match="needs mesh.etcd_ca, etcd_cert and etcd_key"):
        load_config(str(base), ["--mesh.etcd_endpoints=a:2379,b:2379"])
    with pytest.raises(ConfigError, match="etcd_prefix must name the run"):
        load_config(str(base), ["--mesh.etcd_endpoints=a:1", "--mesh.etcd_insecure=true", "--mesh.etcd_prefix=/"])
    cfg = load_config(str(base), ["--mesh.etcd_endpoints=a:2379, b:2379", "--mesh.etcd_ca=ca", "--mesh.etcd_cert=c",
                                  "--mesh.etcd_key=k"])
    assert cfg.mesh.etcd_endpoints == ["a:2379", "b:2379"]


def test_open_store_reaches_the_cluster_or_fails_within_its_timeout(etcd_cluster, tmp_path):
    from engine.config import MeshConfig
    from engine.mesh import MeshError, open_store

    tls = etcd_cluster.tls
    good = MeshConfig(store_backend="etcd", etcd_endpoints=etcd_cluster.endpoints, etcd_ca=tls.ca,
                      etcd_cert=tls.cert, etcd_key=tls.key, etcd_prefix=f"test/{uuid.uuid4().hex[:8]}/",
                      store_timeout=2.0)
    store = open_store(good)
    assert store.has_leases() and store.num_keys() == 0
    with pytest.raises(MeshError, match="mesh.etcd_cert: .*nope.crt: no such file"):
        open_store(good.model_copy(update={"etcd_cert": str(tmp_path / "nope.crt")}))
    t0 = time.monotonic()
    dead = good.model_copy(update={"etcd_endpoints": ["127.0.0.1:1"]})
    with pytest.raises(MeshError, match=r"membership store etcd https://127.0.0.1:1 did not answer .* within 2s"):
        open_store(dead)
    assert time.monotonic() - t0 < 4
    # the heartbeat's reconnect: a client that shares the lost one's lease (its heartbeat key stays its own), and
    # a probe of one beat, not a whole store_timeout, while the cluster does not answer
    again = open_store(good, probe_timeout=0.5, like=store)
    assert again is not store and again._lease is store._lease and again.num_keys() == 0
    lost = EtcdStore(["127.0.0.1:1"], prefix=good.etcd_prefix, tls=Tls(tls.ca, tls.cert, tls.key), timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(MeshError, match=r"did not answer kv/range within 0.5s"):
        open_store(good, probe_timeout=0.5, like=lost)
    assert time.monotonic() - t0 < 1.5


def test_a_node_whose_lease_ends_is_dead_at_once_and_a_goodbye_outlives_its_lease(etcd_cluster):
    """On etcd each process's heartbeat key is leased: when its lease ends (SIGKILL: no more keepalives) etcd
    deletes the key and the peers' next tick sees the death, without waiting out the heartbeat timeout. A clean
    exit's goodbye (the negative counter) is written without the lease, so it outlives the process: a left node
    is never reported dead."""
    from mesh_sim import CFG, Sim, _run_committed

    prefix = f"protocol/{uuid.uuid4().hex[:8]}/"
    stores = [EtcdStore(etcd_cluster.endpoints, prefix=prefix, tls=etcd_cluster.tls, timeout=10.0,
                        lease_ttl=CFG.heartbeat_timeout) for _ in range(3)]  # one lease per "process"
    try:
        sim = Sim(stores[0])
        for name, own in zip("abc", stores):
            assert sim.start(name, store=own) == [False]
        _run_committed(sim, 0, ["a", "b", "c"])
        assert not sim.nodes["a"].heartbeat.is_dead("b")
        sim.kill("b")
        stores[1]._lease.revoke()  # what a lapsed TTL does, without waiting for it
        t0 = sim.t
        sim.sleep(CFG.heartbeat_interval)  # one tick of the survivors
        assert sim.nodes["a"].heartbeat.is_dead("b") and sim.t - t0 < CFG.heartbeat_timeout
        assert ("a", "b") in sim.changes("dead") and ("c", "b") in sim.changes("dead")
        sim.kill("c")
        sim.nodes["c"].leave("completed")
        stores[2].close()  # the process ends: its lease is revoked
        assert stores[0].get("zb/hb/c") == b"-1"
        sim.sleep(CFG.heartbeat_interval)
        assert sim.nodes["a"].heartbeat.is_dead("c") and ("a", "c") not in sim.changes("dead")
    finally:
        for s in stores:
            s.close()


def test_answers_every_op_of_the_mesh_like_tcpstore(etcd_cluster):
    """tests/test_store.py checks that MemoryStore answers these as TCPStore does; etcd must answer them the same."""
    from test_store import _contract

    assert _contract(_etcd(etcd_cluster)) == _contract(MemoryStore())


def test_multi_get_or_none_reads_present_and_missing_keys_in_one_go_beyond_the_txn_cap(etcd_cluster):
    """The heartbeat's read on etcd: a vanished key answers None at once (multi_get would wait for it). More
    ranges than the cluster takes in one txn (the test members run with console/etcd.py's MAX_TXN_OPS) fall back
    to txns of etcd's default size."""
    from console.etcd import MAX_TXN_OPS
    from engine.store.etcd import DEFAULT_TXN_OPS

    store = _etcd(etcd_cluster, timeout=10.0)
    store.multi_set(["k1", "k3"], ["1", "3"])
    t0 = time.monotonic()
    assert store.multi_get_or_none(["k1", "k2", "k3"]) == [b"1", None, b"3"]
    assert store.multi_get_or_none(["k2"]) == [None] and time.monotonic() - t0 < 5
    assert store._txn_ops is None
    many = [f"n{i}" for i in range(MAX_TXN_OPS + 10)]
    store.set(many[-1], "last")
    assert store.multi_get_or_none(["k1"] + many) == [b"1"] + [None] * (len(many) - 1) + [b"last"]
    assert store._txn_ops == DEFAULT_TXN_OPS  # the cluster refused the big txn: chunked from now on
    assert store.multi_get(["k3", "k1"]) == [b"3", b"1"]


def test_a_heartbeat_on_etcd_costs_three_requests_with_live_dead_and_departed_peers(etcd_cluster):
    """The tick's three round trips hold on etcd too (one HTTP request each): a peer whose leased key vanished
    is read as missing in the same txn, not waited for, and a departed peer's goodbye is one more range in it."""
    from mesh_sim import CFG, Sim

    shared = _etcd(etcd_cluster, timeout=10.0, lease_ttl=CFG.heartbeat_timeout)
    own = EtcdStore(etcd_cluster.endpoints, prefix=shared.prefix, tls=etcd_cluster.tls, timeout=10.0,
                    lease_ttl=CFG.heartbeat_timeout)  # "x" is another process: its own client and lease
    try:
        sim = Sim(shared)
        sim.start(*[f"n{i}" for i in range(8)])
        sim.start("x", store=own)
        sim.start("y")
        sim.kill("x")
        own._lease.revoke()  # its key vanishes, as one TTL after a SIGKILL
        sim.kill("y")
        sim.nodes["y"].leave("completed")
        calls = []
        real = shared.gateway.call
        shared.gateway.call = lambda path, *a, **kw: calls.append(path) or real(path, *a, **kw)
        sim.nodes["n1"].heartbeat.tick()
        assert calls == ["kv/txn", "kv/txn", "kv/txn"], calls  # add, the registry's compare_set, the read
        assert sim.nodes["n1"].heartbeat.is_dead("x") and sim.nodes["n1"].heartbeat.is_dead("y")
    finally:
        shared.close()
        own.close()


def test_an_add_whose_reply_was_lost_counts_once(etcd_cluster):
    """The member applied the txn and died before answering: the gateway sends it again. The receipt written with
    the first send tells the retry it was applied (else a counter such as gloo's rendezvous count skips a number)."""
    import httpx

    store = _etcd(etcd_cluster)
    assert store.add("count", 1) == 1
    real_post, lost = store.gateway._http.post, []

    def post_then_lose_the_reply(url, **kw):
        reply = real_post(url, **kw)
        if url.endswith("/kv/txn") and not lost:
            lost.append(url)
            raise httpx.ReadError("connection reset by peer")  # applied, but the answer never arrives
        return reply

    store.gateway._http.post = post_then_lose_the_reply
    assert store.add("count", 1) == 2 and lost
    assert store.add("count", 0) == 2  # counted once
    assert [k for k in store.keys() if k.startswith("_receipts/")] == []  # receipts do not pile up


def test_an_id_whose_leased_key_vanished_is_taken_over_at_once(etcd_cluster):
    """A node restarted after a SIGKILL under the same id: on etcd its old process's heartbeat key is gone with
    the lease, which proves the id free; no heartbeat timeout of watching the old counter (as on TCPStore)."""
    from mesh_sim import CFG, Sim, _run_committed

    shared = _etcd(etcd_cluster, timeout=10.0, lease_ttl=CFG.heartbeat_timeout)
    old, new = (EtcdStore(etcd_cluster.endpoints, prefix=shared.prefix, tls=etcd_cluster.tls, timeout=10.0,
                          lease_ttl=CFG.heartbeat_timeout) for _ in range(2))
    try:
        sim = Sim(shared)
        sim.start("a")
        sim.start("b", store=old)
        _run_committed(sim, 0, ["a", "b"])
        sim.kill("b")
        old._lease.revoke()  # SIGKILL, one TTL later
        sim.sleep(CFG.heartbeat_interval)
        t0 = sim.t
        b = sim.node("b", key="b2", store=new)
        assert b.start() is True and sim.t - t0 < CFG.heartbeat_timeout  # a joiner of the running run, at once
        sim.alive.add("b2")
    finally:
        for s in (shared, old, new):
            s.close()
