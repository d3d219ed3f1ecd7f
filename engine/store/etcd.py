"""The membership store on etcd: the TCPStore interface the mesh uses, and a c10d Store for gloo's rendezvous.

    store = EtcdStore(["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"], prefix="zeroband/run-1/",
                      tls=Tls(ca, cert, key), timeout=30.0, lease_ttl=6.0)
    store.set(k, v); store.get(k); store.add(k, 1); store.compare_set(k, expected, desired); store.check([k])
    store.delete_key(k); store.multi_get([k1, k2]); store.multi_set([k1, k2], [v1, v2]); store.wait([k])
    store.num_keys(); store.clone(); store.lease_key(k)   # k now vanishes a lease TTL after this process dies
    store.multi_get_or_none([k1, k2])   # one round trip, None for a missing key; store.unlease_key(k)

Same semantics as TCPStore (and engine/store/memory.py) for what the mesh calls: values come back as bytes;
`add` creates a missing counter at 0; `compare_set` on a missing key sets it only when `expected` is empty and
returns the value now stored (or `expected` when nothing was stored); `get` and `multi_get` wait for a missing
key up to the store's timeout, then raise LookupError (what gloo's rendezvous needs).

How each maps onto etcd (every key lives under the run's prefix, so runs sharing a cluster never meet):
  set, multi_set       kv/put, one txn of puts
  get, check           kv/range (a txn of ranges for several keys: one round trip, one revision)
  multi_get_or_none    the same txn of ranges, missing keys as None (the heartbeat's read: no wait)
  add                  txn(mod_revision as last seen -> put n+amount [+ a receipt], else range), retried on a
                       concurrent writer; the receipt makes a resent txn (lost reply) count once
  compare_set          txn(value == expected, or create_revision == 0 for "") -> put, else range
  delete_key           kv/deleterange
  wait                 bounded polling of check() (gloo waits at most once per group)
  lease_key            every write of that key carries this process's lease (TTL = mesh.heartbeat_timeout),
                       kept alive by a thread; SIGKILL stops the keepalives and etcd deletes the key by itself

Subclassing torch.distributed.Store (as torch's own elastic EtcdStore does) lets PrefixStore and
ProcessGroupGloo use it: C++ calls back into these methods.
"""

from __future__ import annotations

import math
import threading
import uuid
import time
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from engine.store.endpoints import parse_endpoint
from engine.store.etcd_gateway import EtcdError, Gateway, Tls, b64, range_end, unb64

WAIT_POLL_S = (0.005, 0.01, 0.02, 0.05, 0.1)  # growing pauses of wait()/get() on a missing key
DEFAULT_TXN_OPS = 128  # etcd's default --max-txn-ops (the console starts its members with more, console/etcd.py)
ADD_RETRIES = 1000  # concurrent writers of one counter: bounded, each retry means another writer progressed
RECEIPTS = "_receipts/"  # under the run's prefix: add() receipts, each deleted right after its add


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class _Lease:
    """One lease per process (shared by its clones), granted on first use and kept alive by a daemon thread."""

    def __init__(self, gateway: Gateway, ttl: float) -> None:
        self.gateway = gateway
        self.ttl = max(2, math.ceil(ttl))  # etcd TTLs are whole seconds
        self.keys: set[str] = set()
        self.id: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def current(self) -> str:
        with self._lock:
            if self.id is None:
                self.id = str(self.gateway.call("lease/grant", {"TTL": self.ttl})["ID"])
                if self._thread is None:
                    self._thread = threading.Thread(target=self._keep_alive, name="etcd-lease", daemon=True)
                    self._thread.start()
            return self.id

    def _keep_alive(self) -> None:
        # three refreshes per TTL: one lost refresh (a member killed under it) still leaves two
        while not self._stop.wait(self.ttl / 3):
            lease = self.id
            try:
                reply = self.gateway.call("lease/keepalive", {"ID": lease}, timeout=self.ttl / 3)
            except EtcdError as e:
                self.error = str(e)  # a quorum loss: keep trying; etcd extends leases on a new leader
                continue
            if int(reply.get("result", {}).get("TTL", 0) or 0) <= 0:
                with self._lock:  # expired (the cluster lost quorum for longer than the TTL): the next write
                    if self.id == lease:  # grants a new lease; until then this node's leased keys are gone
                        self.id = None

    def revoke(self) -> None:
        self._stop.set()
        with self._lock:
            lease, self.id = self.id, None
        if lease is not None:
            try:
                self.gateway.call("lease/revoke", {"ID": lease}, timeout=self.gateway.request_timeout)
            except EtcdError:
                pass  # the lease ends by itself a TTL later: revoking only makes the keys vanish sooner


class EtcdStore(dist.Store):
    def __init__(self, endpoints: Sequence[str], *, prefix: str, tls: Tls | None = None, timeout: float = 30.0,
                 lease_ttl: float = 6.0, request_timeout: float = 2.0, _lease: _Lease | None = None) -> None:
        super().__init__()  # required for the pybind trampoline: C++ (PrefixStore, gloo) calls these methods
        if not prefix.strip("/"):
            raise ValueError("mesh.etcd_prefix: must name the run (e.g. 'zeroband/run-1/'), not the whole keyspace")
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.endpoints = list(endpoints)
        self.tls = tls
        self.store_timeout = timeout
        self.lease_ttl = lease_ttl
        self.set_timeout(timedelta(seconds=timeout))
        self.request_timeout = request_timeout
        self.gateway = Gateway(self.endpoints, tls=tls, timeout=timeout, request_timeout=request_timeout)
        self._lease = _lease if _lease is not None else _Lease(self.gateway.clone(), lease_ttl)
        self._seen: dict[str, tuple[str, int]] = {}  # add(): the last (mod_revision, value) this client saw
        # reads of many keys go in one txn until the cluster refuses its size (a cluster started without a larger
        # --max-txn-ops): then in txns of DEFAULT_TXN_OPS ranges, one round trip each
        self._txn_ops: int | None = None

    # ---- the TCPStore interface ---------------------------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self.gateway.call("kv/put", self._put(key, value))

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Every key's value, waiting (up to the store timeout) for missing ones, as TCPStore does."""
        found = self._wait_for(keys, self.store_timeout)
        if found is None:
            raise LookupError(f"etcd: key(s) {', '.join(keys)} not in the store within {self.store_timeout:g}s")
        return [found[k] for k in keys]

    def multi_get_or_none(self, keys: Sequence[str]) -> list[bytes | None]:
        """Every key's value read at one revision in one round trip, None for a missing key, without waiting: the
        heartbeat's read, where a missing key is a peer whose lease ran out (TCPStore has no such call; the mesh
        calls it only on a store with leases)."""
        found = self._ranges(keys, partial=True) or {}
        return [found.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self.gateway.call("kv/txn", {"success": [{"request_put": self._put(k, v)} for k, v in zip(keys, values)]})

    def add(self, key: str, amount: int) -> int:
        if amount == 0:  # a read: no write, so a leased key keeps its lease
            kv = self._range_one(key)
            return int(unb64(kv.get("value")) or b"0") if kv is not None else self._add(key, 0)
        return self._add(key, amount)

    def _add(self, key: str, amount: int) -> int:
        """One txn per add in the usual case: put current + amount if the key is still at the revision this client
        last saw (a heartbeat counter has one writer); else the txn's failure branch reads it and we go again.

        A reply lost after the txn was applied (a member dying in between) makes the gateway send it again, which
        would count twice. Except for leased keys (heartbeat counters, where only change matters and an extra
        write per beat is not worth it), the txn also writes a receipt unique to this add: finding it in the
        failure branch means the first send was applied, and its value is the answer."""
        full = self._key(key)
        receipt = None if key in self._lease.keys else self._key(f"{RECEIPTS}{uuid.uuid4().hex}")
        seen = self._seen.get(key)  # (mod_revision, value) after this client's last write or read of key
        for _ in range(ADD_RETRIES):
            if seen is None:
                cmp = {"key": full, "target": "CREATE", "create_revision": "0", "result": "EQUAL"}
                value = amount
            else:
                cmp = {"key": full, "target": "MOD", "mod_revision": seen[0], "result": "EQUAL"}
                value = seen[1] + amount
            puts = [{"request_put": self._put(key, str(value))}]
            reads = [{"request_range": {"key": full}}]
            if receipt is not None:
                puts.append({"request_put": {"key": receipt, "value": b64(str(value))}})
                reads.append({"request_range": {"key": receipt}})
            reply = self.gateway.call("kv/txn", {"compare": [cmp], "success": puts, "failure": reads})
            if not reply.get("succeeded") and receipt is not None:
                done = reply["responses"][1]["response_range"].get("kvs", [])
                if done:  # applied by a send whose reply was lost
                    value = int(unb64(done[0].get("value")))
                    reply = {"succeeded": True, "header": {"revision": done[0]["mod_revision"]}}
            if reply.get("succeeded"):
                self._seen[key] = (reply["header"]["revision"], value)  # a txn is one revision: the key's
                if receipt is not None:
                    self.gateway.call("kv/deleterange", {"key": receipt})
                return value
            kvs = reply["responses"][0]["response_range"].get("kvs", [])
            seen = (kvs[0]["mod_revision"], int(unb64(kvs[0].get("value")) or b"0")) if kvs else None
        raise EtcdError(f"etcd add {key}: {ADD_RETRIES} concurrent writers in a row")

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        full, exp, want = self._key(key), _b(expected), _b(desired)
        if exp == b"":
            absent = {"key": full, "target": "CREATE", "create_revision": "0", "result": "EQUAL"}
            stored, current = self._swap(key, absent, want)
            if stored:
                return want
            if current:
                return current
            # present with an empty value: that counts as "expected empty" too, as in TCPStore
        stored, current = self._swap(key, {"key": full, "target": "VALUE", "value": b64(exp), "result": "EQUAL"}, want)
        if stored:
            return want
        return exp if current is None else current  # missing and expected something: nothing stored

    def check(self, keys: Sequence[str]) -> bool:
        return self._ranges(keys) is not None

    def delete_key(self, key: str) -> bool:
        reply = self.gateway.call("kv/deleterange", {"key": self._key(key)})
        return int(reply.get("deleted", 0) or 0) > 0

    def num_keys(self) -> int:
        reply = self.gateway.call("kv/range", {"key": b64(self.prefix), "range_end": range_end(self.prefix),
                                               "count_only": True})
        return int(reply.get("count", 0) or 0)

    def reach(self, timeout: float | None = None) -> None:
        """One request to the cluster (EtcdError unless it answers within `timeout`, default the store timeout)."""
        self.gateway.call("kv/range", {"key": b64(self.prefix), "range_end": range_end(self.prefix),
                                       "count_only": True}, timeout=timeout)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self.store_timeout if timeout is None else timeout.total_seconds()
        if self._wait_for(keys, limit) is None:
            raise LookupError(f"etcd: waited {limit:g}s for key(s) {', '.join(keys)}")

    def clone(self) -> "EtcdStore":
        """Another connection pool (the heartbeat thread's), the same lease: leased keys stay this process's."""
        return EtcdStore(self.endpoints, prefix=self.prefix, tls=self.tls, timeout=self.store_timeout,
                         lease_ttl=self.lease_ttl, request_timeout=self.request_timeout, _lease=self._lease)

    def keys(self) -> list[str]:
        """Every key of this run, sorted, without the prefix (tests, debugging)."""
        reply = self.gateway.call("kv/range", {"key": b64(self.prefix), "range_end": range_end(self.prefix),
                                               "keys_only": True})
        return sorted(unb64(kv["key"]).decode()[len(self.prefix):] for kv in reply.get("kvs", []))

    @property
    def host(self) -> str:
        """The first member's address: make_group() finds this host's address on the route to it."""
        return parse_endpoint(self.endpoints[0]).host

    @property
    def port(self) -> int:
        return parse_endpoint(self.endpoints[0]).port

    # ---- leases -----------------------------------------------------------------------------------------------
    def lease_key(self, key: str) -> None:
        """From now on every write of key carries this process's lease: the key outlives the process by at most
        the lease TTL (mesh.heartbeat_timeout). A dead node's heartbeat key vanishes without anyone polling."""
        self._lease.keys.add(key)

    def unlease_key(self, key: str) -> None:
        """Later writes of key carry no lease (etcd detaches it from the lease on that put): a node's goodbye
        stays in the store after the process and its lease are gone."""
        self._lease.keys.discard(key)

    def has_leases(self) -> bool:
        return True

    def close(self) -> None:
        """Revoke the lease (leased keys vanish now) and drop the connections."""
        self._lease.revoke()
        self.gateway.close()

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return b64(self.prefix + key)

    def _put(self, key: str, value: str | bytes) -> dict[str, Any]:
        body: dict[str, Any] = {"key": self._key(key), "value": b64(_b(value))}
        if key in self._lease.keys:
            body["lease"] = self._lease.current()
        return body

    def _swap(self, key: str, compare: dict[str, Any], desired: bytes) -> tuple[bool, bytes | None]:
        """One txn: put desired if compare holds. (True, None) when stored, else (False, the current value or None
        when the key is missing)."""
        full = self._key(key)
        reply = self.gateway.call("kv/txn", {"compare": [compare],
                                             "success": [{"request_put": self._put(key, desired)}],
                                             "failure": [{"request_range": {"key": full}}]})
        if reply.get("succeeded"):
            return True, None
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        return False, unb64(kvs[0].get("value")) if kvs else None

    def _range_one(self, key: str) -> dict[str, Any] | None:
        kvs = self.gateway.call("kv/range", {"key": self._key(key)}).get("kvs", [])
        return kvs[0] if kvs else None

    def _ranges(self, keys: Sequence[str], partial: bool = False) -> dict[str, bytes] | None:
        """All keys' values read at one revision, or None if any is missing (partial: the keys present)."""
        if len(keys) == 1:
            kv = self._range_one(keys[0])
            return ({} if partial else None) if kv is None else {keys[0]: unb64(kv.get("value"))}
        out: dict[str, bytes] = {}
        for key, response in zip(keys, self._range_txn(keys)):
            kvs = response.get("response_range", {}).get("kvs", [])
            if kvs:
                out[key] = unb64(kvs[0].get("value"))
            elif not partial:
                return None
        return out if partial or len(out) == len(keys) else None

    def _range_txn(self, keys: Sequence[str]) -> list[dict[str, Any]]:
        """One range response per key: one txn, or txns of DEFAULT_TXN_OPS once the cluster refused a larger one."""
        def txn(chunk: Sequence[str]) -> list[dict[str, Any]]:
            body = {"success": [{"request_range": {"key": self._key(k)}} for k in chunk]}
            return self.gateway.call("kv/txn", body).get("responses", [])
        if self._txn_ops is None:
            try:
                return txn(keys)
            except EtcdError as e:
                if "too many operations in txn request" not in str(e):
                    raise
                self._txn_ops = DEFAULT_TXN_OPS
        n = self._txn_ops
        return [r for i in range(0, len(keys), n) for r in txn(keys[i:i + n])]

    def _wait_for(self, keys: Sequence[str], limit: float) -> dict[str, bytes] | None:
        deadline = time.monotonic() + limit
        for attempt in range(1_000_000):  # bounded by the deadline
            found = self._ranges(keys)
            if found is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(WAIT_POLL_S[min(attempt, len(WAIT_POLL_S) - 1)], remaining))
        return None
