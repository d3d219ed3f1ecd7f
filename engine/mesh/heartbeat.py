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
comes back empty (restarted) gets this node registered again (Registration.register_again); the main thread sees
`Membership.reset` and re-forms the run with its state (Reformed). A node the others pruned while it was frozen
registers again too, and is excluded at its next boundary like any straggler.

The heartbeat owns its thread, its own store client (a clone), its outbox, its tick timings (link_slow) and the
leader's pruning state; it writes the liveness table (and when it last read it) and the lease into the node's
Membership. Without a thread (tests, the scale bench) whoever drives the node calls tick() or beat() instead.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections import deque
from typing import Any, Callable

from engine.errors import first_line
from engine.mesh.membership import STORE_ERRORS, Membership, Registry, RegistryBusy, text
from engine.mesh.protocol import Keys, MeshError, Plan, StateRecord
from engine.mesh.registration import Registration
from engine.states import NodeState

__all__ = ["MIN_TICKS", "STORE_ERRORS", "Heartbeat", "Outbox", "Registry", "text"]

MIN_TICKS = 4  # heartbeat ticks a node must have timed before link_slow() judges its link (its baseline)

_running: "weakref.WeakSet[Heartbeat]" = weakref.WeakSet()  # heartbeats whose thread runs
_exit_hook = False


def _stop_at_exit() -> None:
    # a daemon thread still inside a C++ store call when the interpreter finalizes aborts the whole process
    # ("terminate called without an active exception"); atexit runs before daemon threads are torn down
    for heartbeat in list(_running):
        heartbeat.stop()


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
    """One node's heartbeat: its thread (or tick() called by hand), the liveness table, the lease, pruning, and the
    store's loss and return."""

    def __init__(self, m: Membership, registration: Registration, node_id: str, keys: Keys, cfg: Any, *,
                 workers: int, leased: bool, clock: Callable[[], float], emit: Callable[..., Any],
                 reconnect: Callable[[], Any] | None, thread: bool) -> None:
        self.m = m
        self.registration = registration
        self.node_id = node_id
        self.keys = keys
        self.cfg = cfg
        self.workers = workers  # local ranks per node: one rendezvous key each to delete at a prune
        self.leased = leased  # a store with leases (etcd) deletes a dead node's heartbeat key by itself
        self.clock = clock
        self.emit = emit
        self.reconnect = reconnect  # a fresh store client, while the store is lost
        self.use_thread = thread
        self.store: Any = None  # the heartbeat's own client (a clone of the caller's when a thread beats)
        self.error: str | None = None  # why this node must give up (set once, read by every wait)
        self.lost_since: float | None = None  # the store stopped answering at; None while it answers
        self.ticks: deque[float] = deque(maxlen=32)  # durations of the last heartbeat ticks (link_slow)
        self.tick_began: float | None = None  # when the tick under way began
        self._seq = 0
        self._reg_cache: tuple[str | None, Any, list[str], list[str]] = (None, None, [], [])  # see _read_registry
        self._reported: set[str] = set()  # peers whose death this node already emitted
        self._gone_seen: set[str] = set()  # pruned ids seen at this node's last prune (deleted at its next)
        self._gone_groups: dict[str, Any] = {}
        self._thread: threading.Thread | None = None
        self._outbox = Outbox(emit)
        self._stop = threading.Event()

    # ---- start and stop ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """The node is registered: beat from now on (a thread of its own, or one tick now when driven by hand)."""
        self.store = self.m.store.clone() if self.use_thread else self.m.store
        if not self.use_thread:
            self.tick()
            return
        global _exit_hook
        if not _exit_hook:
            atexit.register(_stop_at_exit)
            _exit_hook = True
        _running.add(self)
        self._outbox.start(f"mesh-telemetry-{self.node_id}")
        self._thread = threading.Thread(target=self._loop, name=f"mesh-heartbeat-{self.node_id}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Its thread still beats."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        _running.discard(self)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.cfg.heartbeat_interval + self.cfg.store_timeout)
        self._outbox.close(timeout=self.cfg.heartbeat_interval)

    # ---- the tick -------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """One heartbeat: beat, read the registry and every peer's counter, check the lease, prune, report."""
        m = self.m
        s = self.store if self.store is not None else m.store
        self._seq = s.add(self.keys.hb(self.node_id), 1)
        reg, others, keys = self._read_registry(s)
        if self.node_id not in reg.ids:
            try:  # within half a heartbeat timeout: a tick that waits longer leaves the counter still, and this
                # node dead to its peers; the next tick (which beats first) tries again
                reset = self.registration.register_again(s, within=self.cfg.heartbeat_timeout / 2)
            except RegistryBusy as e:
                self._emit("warning", message=f"node {self.node_id}: {e}: registering again at the next tick")
                return
            self._emit("warning", message=f"node {self.node_id}: " + (
                "the membership store restarted empty: registered again, the run re-forms" if reset else
                "was removed from the registry while silent: registered again"))
            reg, others, keys = self._read_registry(s)
        values = self._read_tick(s, keys)
        self.registration.check_still_me(text(values[0]))
        now = self.clock()
        with m.lock:
            fresh = m.liveness.look(now)
            for node in set(m.liveness.known()) - set(others):
                m.liveness.forget(node)
            for node, raw in zip(others, values[2:]):  # a leased key that vanished (etcd): dead now, no timeout
                m.liveness.see(node, None if raw is None else int(text(raw)), now)
            dead = {n: m.liveness.is_dead(n, now) for n in others}
            m.last_look = now
        if not fresh:
            m.is_leader = False  # whatever it held, the others may have moved on: re-check below
            self._emit("warning", message=f"node {self.node_id}: no heartbeat for more than "
                                          f"{self.cfg.heartbeat_timeout:g}s (frozen or cut off); liveness "
                                          f"re-learned from now")
        for node in others:
            if dead[node] or node in self._reported:
                self._report_peer(node, dead[node], m.liveness.is_gone(node))
        self._check_lease(s, text(values[1]), set(reg.ids), fresh)
        if m.is_leader:
            self._prune(s, reg)
        self._emit("heartbeat", seq=self._seq, peers=self.peer_ages())

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
        if not self.leased:
            return s.multi_get(keys)
        values = s.multi_get_or_none(keys)
        missing = [key for key, value in zip(keys[:2], values[:2]) if value is None]
        if missing:
            raise LookupError(f"membership store: key(s) {', '.join(missing)} missing")
        return values

    def _timed_tick(self) -> None:
        began = self.tick_began = self.clock()
        try:
            self.tick()
        finally:
            self.tick_began = None
        self.ticks.append(self.clock() - began)

    def beat(self) -> bool:
        """One tick with store-loss handling. False when this node must give up (the reason is in `error`)."""
        try:
            if self.lost_since is not None:
                self._reconnect_now()
            self._timed_tick()
        except MeshError as e:
            self.error = str(e)
            return False
        except STORE_ERRORS as e:
            now = self.clock()
            if self.lost_since is None:
                self.lost_since = now
                self._emit("warning", message=f"node {self.node_id}: lost the membership store "
                                              f"({first_line(e)}); training goes on, waiting up to "
                                              f"mesh.store_lost_timeout={self.cfg.store_lost_timeout:g}s "
                                              f"for it to come back")
            if self.reconnect is None or now - self.lost_since > self.cfg.store_lost_timeout:
                self.error = (f"lost the membership store ({first_line(e)})" if self.reconnect is None else
                              f"the membership store did not come back within mesh.store_lost_timeout "
                              f"({self.cfg.store_lost_timeout:g}s): {first_line(e)}")
                return False
            return True
        if self.lost_since is not None:
            self.lost_since = None
            self._emit("warning", message=f"node {self.node_id}: the membership store is back")
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.beat():
                return
            self._stop.wait(self.cfg.heartbeat_interval)

    def _reconnect_now(self) -> None:
        try:
            store = self.reconnect()
        except MeshError as e:  # unreachable for now: one more failed try, not the end
            raise ConnectionError(str(e)) from None
        hb = store.clone() if self.use_thread else store
        self.m.store, self.store = store, hb

    # ---- what the table and the ticks say -------------------------------------------------------------------

    def peer_ages(self) -> dict[str, float]:
        now = self.clock()
        live = self.m.liveness
        with self.m.lock:
            return {n: round(live.age(n, now) or 0.0, 3) for n in live.known()
                    if n != self.node_id and not live.is_gone(n)}

    def is_dead(self, node: str) -> bool:
        with self.m.lock:
            return self.m.liveness.is_dead(node, self.clock())

    def link_slow(self) -> bool:
        """This node's own store round trips are being retransmitted: at least two of its last eight heartbeat
        ticks (the one under way counts once it is late) took mesh.slow_tick longer than its fastest of the last
        32. A lost packet costs a tick TCP's minimum retransmission timeout (200 ms on Linux), far above the
        round trips of a healthy link, loaded or far away; a slow store slows every node's ticks, but then no
        collective between the nodes is overdue, and a node steps out only when both are true (engine/outer/diloco.py).
        A baseline needs only MIN_TICKS ticks, so that a link that turns lossy in the first seconds of a node's life
        (a fault right after a start or a re-join) is told too; before that no tick is judged."""
        ticks = list(self.ticks)
        if len(ticks) < MIN_TICKS:
            return False  # no baseline yet
        late = min(ticks) + self.cfg.slow_tick
        slow = sum(t > late for t in ticks[-8:])
        began = self.tick_began
        if began is not None and self.clock() - began > late:
            slow += 1
        return slow >= 2

    def link_healthy(self) -> bool:
        """The last four ticks were all on time (see link_slow): a node that stepped out may ask to join again."""
        ticks = list(self.ticks)
        began = self.tick_began
        late = (min(ticks) if ticks else 0.0) + self.cfg.slow_tick
        return len(ticks) >= 4 and all(t <= late for t in ticks[-4:]) \
            and (began is None or self.clock() - began <= late)

    # ---- liveness reports, lease, pruning -------------------------------------------------------------------

    def _report_peer(self, node: str, dead: bool, gone: bool) -> None:
        """Emit a peer's death once, if it was a member of a plan this node accepted."""
        if not dead:
            self._reported.discard(node)
            return
        plan = self.m.plan
        if node in self._reported or plan is None or node not in self.m.recent:
            return
        self._reported.add(node)
        if not gone:  # a clean exit is reported by its plan (drained) or by the node itself
            self._emit("membership", change="dead", subject=node,
                       members=[n for n in plan.members if n != node], generation=plan.generation)

    def release_lease(self) -> None:
        """Give the leader lease back, from the caller's thread (its client): a node left out of a plan, stepping
        out or leaving. Its next tick takes it again only if it is eligible (_check_lease)."""
        self.m.is_leader = False
        self.m.store.compare_set(self.keys.leader(), self.node_id, "")

    def _check_lease(self, s: Any, holder: str, registered: set[str], fresh: bool) -> None:
        m, key = self.m, self.keys.leader()
        eligible = fresh and m.ready and m.state in (NodeState.STARTING, NodeState.TRAINING, NodeState.DRAINING)
        if not eligible:
            if holder == self.node_id:  # a joiner cannot lead: it may not even hold the state yet
                holder = text(s.compare_set(key, self.node_id, ""))
        elif holder != self.node_id:
            with m.lock:
                free = holder == "" or holder not in registered or m.liveness.is_dead(holder, self.clock())
            if free:
                holder = text(s.compare_set(key, holder, self.node_id))
        m.is_leader = holder == self.node_id
        if holder and holder != m.leader_seen:
            m.leader_seen = holder
            plan = m.plan
            self._emit("membership", change="leader", subject=holder, members=list(plan.members) if plan else [],
                       generation=plan.generation if plan else 0)

    def _prune(self, s: Any, reg: Registry) -> None:
        """The leader drops ids that have been dead for two more timeouts (or left) from the registry, and one
        prune later deletes their keys: a reader that saw them registered has asked for them by then."""
        now = self.clock()
        with self.m.lock:
            victims = [n for n in reg.ids if n != self.node_id
                       and self.m.liveness.silent_for(n, now) > 2 * self.cfg.heartbeat_timeout]
        if victims:
            victims = self._not_awaited_by_a_joiner(s, victims)
        due = [n for n in reg.gone if n in self._gone_seen]
        if victims or due:
            groups = {}
            if victims:
                raws = s.multi_get([self.keys.state(n) for n in victims])
                groups = {n: (st.group if (st := StateRecord.from_json(text(r))) else None)
                          for n, r in zip(victims, raws)}

            deleted: list[str] = []

            def change(r: Registry) -> None:
                r.ids = [n for n in r.ids if n not in victims]
                # an id registered again meanwhile (a restarted process) keeps its keys: they are its new ones
                deleted[:] = [n for n in due if n in r.gone and n not in r.ids]
                for n in due:
                    r.gone.pop(n, None)
                r.gone.update({n: list(g) if g else None for n, g in groups.items()})
            try:
                reg = Registry.update(s, self.keys, change, within=self.cfg.heartbeat_timeout / 2)
            except RegistryBusy:  # nodes registering in a crowd: prune at a later tick (a beat must not wait)
                return
            for n in deleted:
                self._delete_node_keys(s, n, self._gone_groups.get(n))
        self._gone_seen = set(reg.gone)
        self._gone_groups = dict(reg.gone)

    def _not_awaited_by_a_joiner(self, s: Any, victims: list[str]) -> list[str]:
        """The victims this node may prune: a node outside the run's latest plan (woken after the run went on
        without it, waiting to join) leaves that plan's members registered, keys and all, since their states are
        how it learns that the run completed without it (Admission.ended_without_me); pruned, a reader of the
        deleted key waited mesh.store_timeout. A member of the plan prunes them as before."""
        raw = text(s.compare_set(self.keys.latest(), "", ""))  # absent reads "" (Planner.read)
        latest = Plan.from_json(raw) if raw else None
        if latest is None or self.node_id in latest.members:
            return victims
        return [n for n in victims if n not in latest.members]

    def _delete_node_keys(self, s: Any, node: str, group: list[int] | None) -> None:
        k = self.keys
        for key in (k.info(node), k.hb(node), k.state(node)):
            s.delete_key(key)
        if group:
            for local_rank in range(self.workers):
                s.delete_key(k.group_key(group[0], local_rank, group[1]))

    def _emit(self, type_: str, **fields: Any) -> None:
        """Events raised in the heartbeat go through the outbox when a thread beats (never blocks on stdout)."""
        if threading.current_thread() is self._thread:
            self._outbox.put(type_, **fields)
        else:
            self.emit(type_, **fields)
