"""A small synchronous client for etcd's v3 API through its HTTP/JSON gateway (no gRPC, no protobuf), over httpx.

    gw = Gateway(["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"], tls=Tls(ca, cert, key), timeout=30.0)
    gw.call("kv/put", {"key": b64("zb/x"), "value": b64("1")})
    health = cluster_health(endpoints, tls, timeout=2.0)      # members up, leader: the console's header

Every etcd server serves the gateway on its client port (`/v3/kv/range`, `/v3/kv/txn`, `/v3/lease/grant`, ...;
keys and values base64 in JSON). Why not a gRPC client library: python-etcd3 pins an old protobuf and is
unmaintained; aetcd is asyncio-only (the mesh is threads) and pulls grpcio; etcd3gw wraps this same gateway with
requests; calling it directly leaves failover and every timeout to us.

Failover: a call goes to the endpoint that answered last; a refused connection, a reset, a timeout or an etcd
"unavailable" answer (no leader during an election, a member stopping) moves it to the next endpoint and retries,
with a short growing pause, until the call's deadline. Only then does it raise EtcdError (one line: which
endpoints, the last reason). With TLS, a server that wants a client certificate refuses a client without one.

Idempotence: put, range, delete and compare-and-swap are safe to resend. A txn whose reply was lost (the member
died after forwarding it) may have been applied; EtcdStore.add() writes a receipt with its txn so that a resend
finds it (docs/mesh.md).
"""

from __future__ import annotations

import base64
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from engine.errors import first_line

RETRY_PAUSE_S = (0.02, 0.05, 0.1, 0.2, 0.3)
# gRPC codes the gateway returns in {"code": N} for a cluster that cannot answer right now (retry elsewhere/later)
_RETRYABLE_CODES = {4, 8, 10, 13, 14}  # DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNAVAILABLE
_RETRYABLE_MESSAGES = ("leader changed", "no leader", "request timed out", "stopped", "too many requests",
                       "not capable", "unhealthy cluster")


class EtcdError(RuntimeError):
    """etcd could not answer within the deadline, or refused the request; str() is one line."""


@dataclass(frozen=True)
class Tls:
    """Files of the run's PKI (console/etcd.py makes them): the CA that signed the members, this client's pair."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def b64(value: str | bytes) -> str:
    return base64.b64encode(value if isinstance(value, bytes) else value.encode()).decode()


def unb64(value: str | None) -> bytes:
    return base64.b64decode(value) if value else b""


def range_end(prefix: str) -> str:
    """The etcd range_end that selects every key starting with prefix (prefix with its last byte + 1)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return b64(bytes(raw))


def normalize(endpoint: str, tls: Tls | None) -> str:
    endpoint = endpoint.strip().rstrip("/")
    if "://" in endpoint:
        return endpoint
    return f"{'https' if tls else 'http'}://{endpoint}"


class Gateway:
    """One HTTP connection pool to an etcd cluster; thread-safe (httpx.Client is). clone() for another pool."""

    def __init__(self, endpoints: Sequence[str], *, tls: Tls | None = None, timeout: float = 30.0,
                 request_timeout: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("etcd: no endpoints given (mesh.etcd_endpoints)")
        self.endpoints = [normalize(e, tls) for e in endpoints]
        self.tls = tls
        self.timeout = timeout
        self.request_timeout = request_timeout  # one HTTP request; a dead member costs at most this much
        self._current = 0
        self._lock = threading.Lock()
        verify: Any = tls.context() if tls else True
        self._http = httpx.Client(verify=verify, timeout=request_timeout)

    def clone(self) -> "Gateway":
        return Gateway(self.endpoints, tls=self.tls, timeout=self.timeout, request_timeout=self.request_timeout)

    def close(self) -> None:
        self._http.close()

    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST /v3/PATH with body to the current endpoint, failing over until `timeout` (default self.timeout)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        last = "no attempt"
        for attempt in range(1_000_000):  # bounded by the deadline below
            with self._lock:
                index = self._current
            url = f"{self.endpoints[index]}/v3/{path}"
            try:
                reply = self._http.post(url, json=body)
            except httpx.HTTPError as e:
                last = f"{self.endpoints[index]}: {first_line(e)}"
                if "CERTIFICATE" in last.upper():  # refused or untrusted: no other member will think otherwise
                    raise EtcdError(f"etcd {path}: TLS refused ({last}); does this client have the run's "
                                    f"certificate (mesh.etcd_cert/etcd_key) and CA (mesh.etcd_ca)?") from None
            else:
                data = _json(reply)
                if reply.status_code == 200 and "code" not in data:
                    return data
                message = str(data.get("message") or data.get("error") or reply.text[:200])
                last = f"{self.endpoints[index]}: {message}"
                if not _retryable(reply.status_code, data.get("code"), message):
                    raise EtcdError(f"etcd {path}: {last}")
            with self._lock:
                if self._current == index:
                    self._current = (index + 1) % len(self.endpoints)
            if time.monotonic() + RETRY_PAUSE_S[0] > deadline:
                break
            time.sleep(min(RETRY_PAUSE_S[min(attempt // len(self.endpoints), len(RETRY_PAUSE_S) - 1)],
                           max(0.0, deadline - time.monotonic())))
        raise EtcdError(f"etcd {', '.join(self.endpoints)} did not answer {path} within "
                        f"{self.timeout if timeout is None else timeout:g}s (last: {last})")

    def call_one(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request to one endpoint, no failover (health probes); raises EtcdError."""
        try:
            reply = self._http.post(f"{endpoint}/v3/{path}", json=body)
        except httpx.HTTPError as e:
            raise EtcdError(f"{endpoint}: {first_line(e)}") from None
        data = _json(reply)
        if reply.status_code != 200 or "code" in data:
            raise EtcdError(f"{endpoint}: {data.get('message') or reply.text[:200]}")
        return data


@dataclass(frozen=True)
class Health:
    """What the console's header shows for the etcd backend."""

    up: int
    total: int
    leader: str | None  # the leader's member name, None when no member knows one
    reason: str = ""  # why members are down (the first failure), empty when all answer

    def label(self) -> str:
        lead = f"leader {self.leader}" if self.leader else "no leader"
        return f"etcd {self.up}/{self.total} up, {lead}"


def cluster_health(endpoints: Sequence[str], tls: Tls | None, timeout: float = 2.0) -> Health:
    """Ask every endpoint for its status (one request each, no failover): how many answer, who leads."""
    gw = Gateway(endpoints, tls=tls, timeout=timeout, request_timeout=timeout)
    try:
        up, leader_id, reason, names = 0, None, "", {}
        for endpoint in gw.endpoints:
            try:
                status = gw.call_one(endpoint, "maintenance/status", {})
            except EtcdError as e:
                reason = reason or str(e)
                continue
            up += 1
            leader_id = leader_id or (status.get("leader") if status.get("leader") not in (None, "0") else None)
            if not names:
                try:
                    members = gw.call_one(endpoint, "cluster/member/list", {}).get("members", [])
                    names = {m.get("ID"): m.get("name") or m.get("ID") for m in members}
                except EtcdError as e:
                    reason = reason or str(e)
        leader = names.get(leader_id, leader_id) if leader_id else None
        return Health(up=up, total=len(gw.endpoints), leader=leader, reason=reason)
    finally:
        gw.close()


def _retryable(status: int, code: Any, message: str) -> bool:
    if status in (502, 503, 504):
        return True
    try:
        if int(code) in _RETRYABLE_CODES:
            return True
    except (TypeError, ValueError):
        pass
    return any(m in message for m in _RETRYABLE_MESSAGES)


def _json(reply: httpx.Response) -> dict[str, Any]:
    try:
        data = reply.json()
    except ValueError:
        return {"code": -1, "message": f"HTTP {reply.status_code}: {reply.text[:200]}"}
    if not isinstance(data, dict):
        return {"code": -1, "message": f"HTTP {reply.status_code}: unexpected reply"}
    if "error" in data and "code" not in data:  # streaming endpoints wrap errors as {"error": {...}}
        err = data["error"]
        return {"code": err.get("grpc_code", err.get("code", -1)), "message": err.get("message", str(err))}
    return data
