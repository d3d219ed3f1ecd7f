"""A node's identity in the store and its start-up: the config digest, claiming its id, registering (and
registering again), its own `state/<id>`, and whether it joins a running run or (re)forms one.

Start-up, in the order Mesh.start() calls it:

    check_digest     compare_set(digest): the first node writes it, every other one must match it
    claim_id         wait for a pending prune of this id; compare_set(info/<id>); an id held by a live process
                     (its counter moves within a heartbeat timeout) is refused, a dead or departed one taken over
    register         (etcd: lease hb/<id>) hb, state, the empty leader and plan keys, the store's life, then the
                     registry entry: whoever finds the id registered finds its keys
    must_join        a member of the last plan beats and runs the run: join it; else (re)form it

The heartbeat (heartbeat.py) calls check_still_me at every tick and register_again when the id has left the
registry (a restarted store, or pruned while frozen). The waits here are bounded; each poll runs the node's checks
(`check`, Polling.check: its heartbeat's fate, a restarted store, a stop or drain).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable

from engine.mesh.membership import UPDATE_WITHIN_S, Membership, Registry, text
from engine.mesh.planner import Planner
from engine.mesh.protocol import Keys, MeshError, StateRecord
from engine.states import NodeState
from engine.toml_text import toml_value

# a peer in a running run (a member, or one that stepped out and will ask again), and one that runs none (yet)
_RUNNING = (NodeState.TRAINING, NodeState.DRAINING, NodeState.STANDBY)
_RESTING = (NodeState.STARTING, NodeState.JOINING, NodeState.LEFT)


def differences(mine: str, run: str, most: int = 4) -> str:
    """What differs between two values of the digest key ("HASH/wN/sS/pP SETTINGS-JSON", engine/outer/diloco.py),
    this node's and the run's, as "diloco.fragments = 4 here, 1 in the run; ..."; "" when they cannot tell (a
    value without its settings, from an engine before they travelled with it)."""
    (mine_id, _, mine_json), (run_id, _, run_json) = mine.partition(" "), run.partition(" ")
    tags = [dict((part[:1], part[1:]) for part in value.split("/")[1:]) for value in (mine_id, run_id)]
    out = []
    if tags[0].get("p") != tags[1].get("p") and all("p" in t for t in tags):
        out.append(f"engine wire protocol /p{tags[0].get('p')} here, /p{tags[1].get('p')} in the run (one engine "
                   f"version on every node)")
    if tags[0].get("w") != tags[1].get("w") and all("w" in t for t in tags):
        out.append(f"workers per node {tags[0].get('w')} here, {tags[1].get('w')} in the run")
    if tags[0].get("s") != tags[1].get("s") and all("s" in t for t in tags):
        out.append(f"inner.strategy {tags[0].get('s')} here, {tags[1].get('s')} in the run (the outer step's "
                   "buffers are laid out by it)")
    try:
        ours, theirs = json.loads(mine_json), json.loads(run_json)
    except ValueError:
        ours = theirs = {}
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key, "default") != theirs.get(key, "default"):
            out.append(f"{key} = {_shown(ours, key)} here, {_shown(theirs, key)} in the run")
    if len(out) > most:
        out[most:] = [f"and {len(out) - most} more"]
    return "; ".join(out)


def _shown(settings: dict[str, Any], key: str) -> str:
    return toml_value(settings[key]) if key in settings else "its default"


class Registration:
    """This node's id, token and digest in the store, and its start-up."""

    def __init__(self, m: Membership, planner: Planner, node_id: str, keys: Keys, cfg: Any, *, digest: str,
                 info: dict[str, Any], leased: bool, clock: Callable[[], float], sleep: Callable[[float], None],
                 emit: Callable[..., Any]) -> None:
        self.m = m
        self.planner = planner
        self.node_id = node_id
        self.keys = keys
        self.cfg = cfg
        self.digest = digest
        self.info = info  # Mesh's: its `token` tells two holders of the id apart
        self.leased = leased  # a store with leases (etcd) deletes a dead node's heartbeat key by itself
        self.clock = clock
        self.sleep = sleep
        self.emit = emit

    def write_state(self, st: StateRecord, s: Any) -> None:
        self.m.node_state = st
        s.set(self.keys.state(self.node_id), st.to_json())

    def announce(self, state: NodeState, reason: str = "") -> None:
        """This node's lifecycle moves to `state` (its waits move it): its state/<id> says so, over the caller
        thread's client, the rest of the record as last written."""
        self.m.state = state
        st = self.m.node_state
        self.write_state(StateRecord(state, st.token, st.at, st.contributing, st.draining, st.ok, st.group, reason),
                         self.m.store)

    def info_json(self) -> str:
        return json.dumps({**self.info, "node": self.node_id}, sort_keys=True, default=str)

    def _rejected(self) -> None:
        plan = self.m.plan
        self.emit("membership", change="rejected", subject=self.node_id, generation=plan.generation if plan else 0,
                  members=[])

    def check_digest(self, s: Any) -> None:
        current = text(s.compare_set(self.keys.digest(), "", self.digest))
        # the hash decides; the settings after it only say what differs (an engine that sends none still matches)
        mine, run = self.digest.partition(" ")[0], current.partition(" ")[0]
        if mine != run:
            what = differences(self.digest, current) or (
                "every node must use the same model, data.seq_len and diloco settings (e.g. inner_steps H, "
                "fragments, round, sentinel_ratio), the same workers per node (/wN) and an engine of the same wire "
                "protocol (/pN)")
            self._rejected()
            # the store keeps the first node's digest for good: a resume with new settings on the store of a run
            # that has ended was refused without a word of what to do
            raise MeshError(f"node {self.node_id}: config digest {mine} differs from the run's {run}: {what} (the "
                            f"store keeps its run's settings: a run with other settings needs a fresh store)")

    def claim_id(self, check: Callable[[str], None]) -> None:
        """Claim the node id. An id held by a process whose counter still moves is refused; one held by a dead
        or departed process (a restart after a crash or a stop) is taken over. `check` runs at every poll."""
        k, store = self.keys, self.m.store
        self._await_pending_prune(check)
        mine = self.info_json()
        current = text(store.compare_set(k.info(self.node_id), "", mine))
        if current == mine:
            return
        # on a store with leases a vanished heartbeat key is proof enough: its holder stopped renewing its lease
        held = not self.leased or store.check([k.hb(self.node_id)])
        counter = int(text(store.add(k.hb(self.node_id), 0))) if held else 0
        if held and counter >= 0 and self._counter_moves(self.node_id, check):
            try:
                old = json.loads(current)
                where = f" (host {old.get('host')}, pid {old.get('pid')})"
            except ValueError:
                where = ""
            self._rejected()
            raise MeshError(f"node id {self.node_id!r} is in use by a live node{where}: give this node another "
                            f"GLOBAL_UNIQUE_ID / mesh.node_id")
        store.set(k.info(self.node_id), mine)

    def register(self) -> None:
        """Keys first, then the registry entry: whoever finds the id registered finds its keys."""
        k, s = self.keys, self.m.store
        if self.leased:  # etcd: the heartbeat key dies with this process, a lease TTL after its last renewal
            s.lease_key(k.hb(self.node_id))
        counter = int(text(s.add(k.hb(self.node_id), 1)))
        if counter <= 0:  # the id left cleanly before (negative counter): beat from 1 again
            s.set(k.hb(self.node_id), "1")
        self.write_state(StateRecord(NodeState.STARTING, self.info["token"]), s)
        s.compare_set(k.leader(), "", "")  # created empty: every tick reads it in one multi_get
        s.compare_set(k.latest(), "", "")
        self.m.store_life = text(s.compare_set(k.life(), "", uuid.uuid4().hex))

        def add_me(reg: Registry) -> None:
            reg.gone.pop(self.node_id, None)
            if self.node_id not in reg.ids:
                reg.ids.append(self.node_id)
        Registry.update(s, k, add_me)

    def _await_pending_prune(self, check: Callable[[str], None]) -> None:
        """An id the leader pruned from the registry (listed in `gone`) has its keys deleted at the leader's next
        prune. A process restarted under that id waits for that deletion before it claims the id: claimed first,
        its fresh keys would be deleted under it (and a deletion seen mid-claim reads as a moving counter). A
        leader that is gone too never deletes them: after a few beats the id is taken back from `gone` here."""
        deadline = self.clock() + self.cfg.heartbeat_timeout + 3 * self.cfg.heartbeat_interval
        while self.node_id in Registry.read(self.m.store, self.keys)[1].gone:
            check("waiting for the leader to finish pruning this id's old keys")
            if self.clock() > deadline:
                Registry.update(self.m.store, self.keys, lambda reg: reg.gone.pop(self.node_id, None))
                return
            self.sleep(self.cfg.polling_interval)

    def _counter_moves(self, node: str, check: Callable[[str], None]) -> bool:
        """Watch a heartbeat counter for one timeout (plus a beat): True as soon as it goes up. Only a live
        process raises it; a deleted key (a prune) reads 0 and a clean leave writes it negative."""
        key = self.keys.hb(node)
        first = int(text(self.m.store.add(key, 0)))
        deadline = self.clock() + self.cfg.heartbeat_timeout + self.cfg.heartbeat_interval
        while self.clock() <= deadline:
            check("checking whether the node id is in use")
            if int(text(self.m.store.add(key, 0))) > first:
                return True
            self.sleep(self.cfg.polling_interval)
        return False

    def must_join(self, idle: Callable[[str], None]) -> bool:
        """Join a running run, or (re)form one. Join iff a member of the last plan is beating and is running the
        run (training or draining); re-form when every member is dead, gone, or itself restarted (starting,
        joining): after a stop of every node, their restarted processes form a new life of the run together.
        `idle` is one poll interval of the wait (Polling.idle: it beats too when no heartbeat thread runs)."""
        m = self.m
        _, latest = self.planner.latest()
        if latest is None:
            return False
        others = [n for n in latest.members if n != self.node_id]
        limit = 2 * self.cfg.heartbeat_timeout + self.cfg.store_timeout
        deadline = self.clock() + limit
        while True:
            _, reg = Registry.read(m.store, self.keys)
            listed = [n for n in others if n in reg.ids]
            states = self.planner.states(listed)
            with m.lock:
                now = self.clock()
                running = [n for n in listed if m.liveness.moved(n) and not m.liveness.is_dead(n, now)
                           and states[n] is not None and states[n].state in _RUNNING]
                resting = all(m.liveness.is_dead(n, now) or (states[n] is not None and
                                                             states[n].state in _RESTING)
                              for n in listed)
            if running:
                m.epoch = latest.epoch
                return True
            if resting:
                # no member runs the run: this node (re)forms it in a new epoch, with any restarted member
                m.epoch = m.base_generation = latest.generation
                return False
            if self.clock() > deadline:
                raise MeshError(f"node {self.node_id}: could not tell within {limit:g}s whether the run's members "
                                f"{others} are alive (their heartbeats were not observed)")
            idle("deciding whether to join or form the run")

    # ---- called by the heartbeat ----------------------------------------------------------------------------

    def check_still_me(self, raw: str) -> None:
        """A node that was silent long enough to be declared dead (stopped, swapped out) may find that a newer
        process took its id over: it must not beat under that id again."""
        holder = json.loads(raw) if raw else {}
        if holder.get("token") != self.info.get("token"):
            raise MeshError(f"node {self.node_id} was declared dead and a newer process (pid {holder.get('pid')}) "
                            f"took its id over: this process must exit")

    def register_again(self, s: Any, within: float = UPDATE_WITHIN_S) -> bool:
        """This id is not in the registry: the store restarted empty, or the others pruned this node while it
        was frozen. Register again (on the heartbeat's client `s`); True after a restart: the waits re-form the
        run (Reformed)."""
        k, m = self.keys, self.m
        # The store's life tells a restart from a prune: the first node back in an empty store writes a new one.
        # (The digest cannot: a peer that registered again first has written it already.)
        life = text(s.compare_set(k.life(), "", uuid.uuid4().hex))
        reset, m.store_life = life != m.store_life, life
        current = text(s.compare_set(k.info(self.node_id), "", self.info_json()))
        self.check_still_me(current)
        self.check_digest(s)
        s.compare_set(k.leader(), "", "")
        s.compare_set(k.latest(), "", "")
        if reset:
            m.reset = True
            self.write_state(StateRecord(NodeState.STARTING, self.info["token"]), s)
        else:  # pruned while silent: the leader deleted its keys, and a registered id must have them (a reader
            # of an absent TCPStore key blocks until it appears: the planner would wait store_timeout for it)
            self.write_state(m.node_state, s)
        Registry.update(s, k, lambda reg: reg.ids.append(self.node_id) if self.node_id not in reg.ids else None,
                        within=within)
        return reset
