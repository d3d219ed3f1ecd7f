"""A node's heartbeat: its counter, its view of every peer's (liveness), the leader lease, pruning, store loss.

One tick costs three store round trips whatever the size or the history of the run, on either backend:

    add(hb/<me>, 1)                                   beat
    compare_set(ids, "", "")                          the registry (read; created empty on a fresh store)
    multi_get([info/<me>, leader, hb/<peer>...])      still me? who leads? every registered peer's counter

On a store with leases (etcd, engine/store/etcd.py) hb/<me> is written under this process's lease: it vanishes
one lease TTL (mesh.heartbeat_timeout) after the process stops renewing it, and the tick's read (one txn,
`multi_get_or_none`) sees a peer whose key is gone as dead at once. A stalled counter still counts as death after
the timeout on both backends (a process whose heartbeat thread hangs keeps renewing its lease).

plus, rarely, a compare_set to take the lease and the leader's pruning of ids that are long dead (their keys are
deleted one beat later, so that no reader still asks for them). Events of the heartbeat thread go through an
Outbox whose own thread writes them: a blocked stdout never stops the heartbeat.

A store error does not end the node: the heartbeat keeps trying to reconnect (`Mesh(reconnect=...)`) for up to
mesh.store_lost_timeout. A store that comes back with our keys (a network blip) changes nothing. A store that
comes back empty (restarted) gets this node registered again; the main thread sees `_reset` and re-forms the run
with its state (Reformed). A node the others pruned while it was frozen registers again too, and is excluded at
its next boundary like any straggler.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.errors import first_line
from engine.mesh.protocol import Keys, MeshError, NodeState

STORE_ERRORS = (RuntimeError, OSError, LookupError)  # TCPStore: RuntimeError (DistStoreError); MemoryStore: OSError


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


MIN_TICKS = 4  # heartbeat ticks a node must have timed before link_slow() judges its link (its baseline)


@dataclass
class Registry:
    """The value of `ids`: registered ids, and ids pruned from it whose keys are deleted at the next prune
    (id -> the (generation, rank) of its last process group, for its rendezvous keys)."""

    ids: list[str] = field(default_factory=list)
    gone: dict[str, list[int] | None] = field(default_factory=dict)

    @classmethod
    def read(cls, store: Any, keys: Keys) -> tuple[str, "Registry"]:
        raw = text(store.compare_set(keys.ids(), "", ""))  # one round trip; an absent key reads (and becomes) ""
        return raw, cls.parse(raw)

    @classmethod
    def parse(cls, raw: str) -> "Registry":
        if not raw:
            return cls()
        d = json.loads(raw)
        return cls(list(d["ids"]), dict(d["gone"]))

    def to_json(self) -> str:
        return json.dumps({"ids": self.ids, "gone": self.gone}, separators=(",", ":"))

    @classmethod
    def update(cls, store: Any, keys: Keys, change: Callable[["Registry"], None], attempts: int = 50) -> "Registry":
        """Read-modify-compare_set, retried while another node changes it at the same time (bounded)."""
        for _ in range(attempts):
            raw, reg = cls.read(store, keys)
            change(reg)
            new = reg.to_json()
            if new == raw or text(store.compare_set(keys.ids(), raw, new)) == new:
                return reg
        raise MeshError(f"the registry key {keys.ids()} kept changing under {attempts} attempts to update it")


class Outbox:
    """Telemetry from the heartbeat thread, written by a thread of its own. Bounded: when the writer is stuck
    (stdout blocked), heartbeat events are dropped (counted), never waited for."""

    def __init__(self, emit: Callable[..., Any], limit: int = 1000) -> None:
        self._emit = emit
        self._queue: queue.Queue = queue.Queue(maxsize=limit)
        self.dropped = 0
        self._thread: threading.Thread | None = None

    def start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def put(self, type_: str, **fields: Any) -> None:
        if self._thread is None:
            self._emit(type_, **fields)
            return
        try:
            self._queue.put_nowait((type_, fields))
        except queue.Full:
            self.dropped += 1

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._emit(item[0], **item[1])

    def close(self, timeout: float) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the writer is stuck in a blocked stdout: a daemon thread, left behind
        thread.join(timeout)


class Heartbeat:
    """The heartbeat half of Mesh (engine/mesh/node.py), which provides the attributes used here."""

    # ---- the tick -------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """One heartbeat: beat, read the registry and every peer's counter, check the lease, prune, report."""
        s = self._hb_store if self._hb_store is not None else self.store
        k = self.keys
        self._seq = s.add(k.hb(self.node_id), 1)
        reg, others, keys = self._read_registry(s)
        if self.node_id not in reg.ids:
            self._register_again(s)
            reg, others, keys = self._read_registry(s)
        values = self._read_tick(s, keys)
        self._check_still_me(text(values[0]))
        now = self.clock()
        with self._lock:
            fresh = self._liveness.look(now)
            for node in set(self._liveness.known()) - set(others):
                self._liveness.forget(node)
            for node, raw in zip(others, values[2:]):
                if raw is None:  # its leased heartbeat key vanished (etcd): dead now, no timeout to wait
                    self._liveness.expire(node, now)
                    continue
                counter = int(text(raw))
                self._liveness.observe(node, counter, now, gone=counter < 0)
            dead = {n: self._liveness.is_dead(n, now) for n in others}
            self._ids = list(reg.ids)
            self._last_look = now
        if not fresh:
            self._is_leader = False  # whatever it held, the others may have moved on: re-check below
            self._hb_emit("warning", message=f"node {self.node_id}: no heartbeat for more than "
                                             f"{self.cfg.heartbeat_timeout:g}s (frozen or cut off); liveness "
                                             f"re-learned from now")
        for node in others:
            if dead[node] or node in self._reported:
                self._report_peer(node, dead[node], self._liveness.is_gone(node))
        self._check_lease(s, text(values[1]), set(reg.ids), fresh)
        if self._is_leader:
            self._prune(s, reg)
        self._hb_emit("heartbeat", seq=self._seq, peers=self.peer_ages())

    def _read_registry(self, s: Any) -> tuple[Registry, list[str], list[str]]:
        """The registry, the other ids, and the keys of one tick's multi_get: parsed again only when it changed
        (a 1024-node registry is ~10 kB of JSON; it changes only when nodes come or go)."""
        raw = text(s.compare_set(self.keys.ids(), "", ""))
        if raw != self._reg_cache[0]:
            reg = Registry.parse(raw)
            others = [n for n in reg.ids if n != self.node_id]
            k = self.keys
            self._reg_cache = (raw, reg, others, [k.info(self.node_id), k.leader()] + [k.hb(n) for n in others])
        return self._reg_cache[1], self._reg_cache[2], self._reg_cache[3]

    def _read_tick(self, s: Any, keys: list[str]) -> list[Any]:
        """The tick's multi_get, one round trip. On a store with leases a dead peer's heartbeat key is gone
        (None here) rather than waited for; the other keys of the read are never leased, so a missing one is a
        store that lost them (the store-loss path, as TCPStore's timed-out multi_get)."""
        if not self._leased:
            return s.multi_get(keys)
        values = s.multi_get_or_none(keys)
        missing = [key for key, value in zip(keys[:2], values[:2]) if value is None]
        if missing:
            raise LookupError(f"membership store: key(s) {', '.join(missing)} missing")
        return values

    def _timed_tick(self) -> None:
        began = self._tick_began = self.clock()
        try:
            self.tick()
        finally:
            self._tick_began = None
        self._ticks.append(self.clock() - began)

    def link_slow(self) -> bool:
        """This node's own store round trips are being retransmitted: at least two of its last eight heartbeat
        ticks (the one under way counts once it is late) took mesh.slow_tick longer than its fastest of the last
        32. A lost packet costs a tick TCP's minimum retransmission timeout (200 ms on Linux), far above the
        round trips of a healthy link, loaded or far away; a slow store slows every node's ticks, but then no
        collective between the nodes is overdue, and a node steps out only when both are true (engine/outer/diloco.py).
        A baseline needs only MIN_TICKS ticks, so that a link that turns lossy in the first seconds of a node's life
        (a fault right after a start or a re-join) is told too; before that no tick is judged."""
        ticks = list(self._ticks)
        if len(ticks) < MIN_TICKS:
            return False  # no baseline yet
        late = min(ticks) + self.cfg.slow_tick
        slow = sum(t > late for t in ticks[-8:])
        began = self._tick_began
        if began is not None and self.clock() - began > late:
            slow += 1
        return slow >= 2

    def link_healthy(self) -> bool:
        """The last four ticks were all on time (see link_slow): a node that stepped out may ask to join again."""
        ticks = list(self._ticks)
        began = self._tick_began
        late = (min(ticks) if ticks else 0.0) + self.cfg.slow_tick
        return len(ticks) >= 4 and all(t <= late for t in ticks[-4:]) \
            and (began is None or self.clock() - began <= late)

    def _beat(self) -> bool:
        """One tick with store-loss handling. False when this node must give up (the error is in _hb_error)."""
        try:
            if self._lost_since is not None:
                self._reconnect_now()
            self._timed_tick()
        except MeshError as e:
            self._hb_error = str(e)
            return False
        except STORE_ERRORS as e:
            now = self.clock()
            if self._lost_since is None:
                self._lost_since = now
                self._hb_emit("warning", message=f"node {self.node_id}: lost the membership store "
                                                 f"({first_line(e)}); training goes on, waiting up to "
                                                 f"mesh.store_lost_timeout={self.cfg.store_lost_timeout:g}s "
                                                 f"for it to come back")
            if self._reconnect is None or now - self._lost_since > self.cfg.store_lost_timeout:
                self._hb_error = (f"lost the membership store ({first_line(e)})" if self._reconnect is None else
                                  f"the membership store did not come back within mesh.store_lost_timeout "
                                  f"({self.cfg.store_lost_timeout:g}s): {first_line(e)}")
                return False
            return True
        if self._lost_since is not None:
            self._lost_since = None
            self._hb_emit("warning", message=f"node {self.node_id}: the membership store is back")
        return True

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            if not self._beat():
                return
            self._stop.wait(self.cfg.heartbeat_interval)

    def _reconnect_now(self) -> None:
        try:
            store = self._reconnect()
        except MeshError as e:  # unreachable for now: one more failed try, not the end
            raise ConnectionError(str(e)) from None
        hb = store.clone() if self._use_thread else store
        self.store, self._hb_store = store, hb

    # ---- identity and registration --------------------------------------------------------------------------

    def _check_still_me(self, raw: str) -> None:
        """A node that was silent long enough to be declared dead (stopped, swapped out) may find that a newer
        process took its id over: it must not beat under that id again."""
        holder = json.loads(raw) if raw else {}
        if holder.get("token") != self.info.get("token"):
            raise MeshError(f"node {self.node_id} was declared dead and a newer process (pid {holder.get('pid')}) "
                            f"took its id over: this process must exit")

    def _register_again(self, s: Any) -> None:
        """This id is not in the registry: the store restarted empty, or the others pruned this node while it
        was frozen. Register again; after a restart the main thread re-forms the run (Reformed)."""
        k = self.keys
        # The store's life tells a restart from a prune: the first node back in an empty store writes a new one.
        # (The digest cannot: a peer that registered again first has written it already.)
        life = text(s.compare_set(k.life(), "", uuid.uuid4().hex))
        reset, self._store_life = life != self._store_life, life
        current = text(s.compare_set(k.info(self.node_id), "", self._info_json()))
        self._check_still_me(current)
        self._check_digest(s)
        s.compare_set(k.leader(), "", "")
        s.compare_set(k.latest(), "", "")
        if reset:
            self._reset = True
            self._write_state(NodeState("starting", self.info["token"]), s)
        else:  # pruned while silent: the leader deleted its keys, and a registered id must have them (a reader
            # of an absent TCPStore key blocks until it appears: the planner would wait store_timeout for it)
            self._write_state(self._node_state, s)
        Registry.update(s, k, lambda reg: reg.ids.append(self.node_id) if self.node_id not in reg.ids else None)
        self._hb_emit("warning", message=f"node {self.node_id}: " + (
            "the membership store restarted empty: registered again, the run re-forms" if reset else
            "was removed from the registry while silent: registered again"))

    # ---- liveness reports, lease, pruning -------------------------------------------------------------------

    def _report_peer(self, node: str, dead: bool, gone: bool) -> None:
        """Emit a peer's death once, if it was a member of a plan this node accepted."""
        if not dead:
            self._reported.discard(node)
            return
        plan = self._plan
        if node in self._reported or plan is None or node not in self._recent:
            return
        self._reported.add(node)
        if not gone:  # a clean exit is reported by its plan (drained) or by the node itself
            self._hb_emit("membership", change="dead", subject=node,
                          members=[m for m in plan.members if m != node], generation=plan.generation)

    def _check_lease(self, s: Any, holder: str, registered: set[str], fresh: bool) -> None:
        key = self.keys.leader()
        eligible = fresh and self._ready and self.state in ("starting", "training", "draining")
        if not eligible:
            if holder == self.node_id:  # a joiner cannot lead: it may not even hold the state yet
                holder = text(s.compare_set(key, self.node_id, ""))
        elif holder != self.node_id:
            with self._lock:
                free = holder == "" or holder not in registered or self._liveness.is_dead(holder, self.clock())
            if free:
                holder = text(s.compare_set(key, holder, self.node_id))
        self._is_leader = holder == self.node_id
        if holder and holder != self._leader_seen:
            self._leader_seen = holder
            plan = self._plan
            self._hb_emit("membership", change="leader", subject=holder,
                          members=list(plan.members) if plan else [],
                          generation=plan.generation if plan else 0)

    def _prune(self, s: Any, reg: Registry) -> None:
        """The leader drops ids that have been dead for two more timeouts (or left) from the registry, and one
        prune later deletes their keys: a reader that saw them registered has asked for them by then."""
        now = self.clock()
        with self._lock:
            victims = [n for n in reg.ids if n != self.node_id
                       and self._liveness.silent_for(n, now) > 2 * self.cfg.heartbeat_timeout]
        due = [n for n in reg.gone if n in self._gone_seen]
        if victims or due:
            groups = {}
            if victims:
                raws = s.multi_get([self.keys.state(n) for n in victims])
                groups = {n: (st.group if (st := NodeState.from_json(text(r))) else None)
                          for n, r in zip(victims, raws)}

            deleted: list[str] = []

            def change(r: Registry) -> None:
                r.ids = [n for n in r.ids if n not in victims]
                # an id registered again meanwhile (a restarted process) keeps its keys: they are its new ones
                deleted[:] = [n for n in due if n in r.gone and n not in r.ids]
                for n in due:
                    r.gone.pop(n, None)
                r.gone.update({n: list(g) if g else None for n, g in groups.items()})
            reg = Registry.update(s, self.keys, change)
            for n in deleted:
                self._delete_node_keys(s, n, self._gone_groups.get(n))
        self._gone_seen = set(reg.gone)
        self._gone_groups = dict(reg.gone)

    def _delete_node_keys(self, s: Any, node: str, group: list[int] | None) -> None:
        k = self.keys
        for key in (k.info(node), k.hb(node), k.state(node)):
            s.delete_key(key)
        if group:
            for local_rank in range(int(self.info.get("workers", 1))):
                s.delete_key(k.group_key(group[0], local_rank, group[1]))

    # ---- helpers --------------------------------------------------------------------------------------------

    def _hb_emit(self, type_: str, **fields: Any) -> None:
        """Events raised in the heartbeat go through the outbox when a thread beats (never blocks on stdout)."""
        if threading.current_thread() is self._thread:
            self._outbox.put(type_, **fields)
        else:
            self.emit(type_, **fields)
