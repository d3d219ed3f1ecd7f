"""How the caller's thread waits: what every poll checks, one idle interval, and the pause while the store is lost.

Every wait of a node (Mesh's boundary, admission and commit, and the start-up's in registration.py) is a bounded
polling loop with a deadline from MeshConfig, and every poll first runs `check`, in this order: the heartbeat gave
up (MeshError), the store restarted empty (Reformed: the node's view of the run is forgotten), a stop or drain was
requested (`interrupt()` returns "stopped" or "drained": Stopped). A store error in a wait run by `resilient` is
not fatal: the wait pauses until the heartbeat has the store back (bounded by mesh.store_lost_timeout through the
heartbeat, and interruptible) and starts over. Outside such a wait, `guard` turns a store error into one MeshError
line naming the node and what it was doing.

A wait polls every 2 ms at first, and then never sleeps more than an eighth of what it has waited so far, up to
mesh.polling_interval (`idle`): a wait notices what it waits for at most 2 ms or 12.5 % late. A plan or a
decision usually lands within a few milliseconds of the last arrival or post (one store round trip of the
leader), and a fixed interval made every boundary and every commit wait up to a whole interval (100 ms) for it:
about 0.2 s of each outer step on any link (issue 21). Pauses that doubled from 5 ms still lost up to half of the
wait so far: a leader that had waited 0.3 s for a late member saw its arrival up to 0.1 s later, and that member
waited for the plan meanwhile. A wait of 1 s polls about 45 times; a long wait polls once an interval.

Without a heartbeat thread (tests, the scale bench) `idle` and the pause beat the heart themselves, so a single
thread can drive several nodes deterministically; they poll at the fixed interval.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from engine.errors import first_line
from engine.mesh.heartbeat import Heartbeat
from engine.mesh.membership import STORE_ERRORS, Membership
from engine.mesh.protocol import Excluded, Keys, MeshError, Reformed, Stopped
from engine.states import NodeState


FIRST_POLL_S = 0.002  # a wait's shortest pause
LATE = 1 / 8  # a pause is at most this share of the wait so far (and at least FIRST_POLL_S)


class _StoreDown(Exception):
    """A store call of the caller's thread failed: wait for the heartbeat to get the store back, then retry."""


class Polling:
    """The rules every wait of one node polls by."""

    def __init__(self, m: Membership, heartbeat: Heartbeat, node_id: str, keys: Keys, cfg: Any, *,
                 sleep: Callable[[float], None], interrupt: Callable[[], str | None] | None,
                 can_resume: bool) -> None:
        self.m = m
        self.heartbeat = heartbeat
        self.node_id = node_id
        self.keys = keys
        self.cfg = cfg
        self.sleep = sleep
        self.interrupt = interrupt  # "stopped" / "drained" ends the wait (Stopped)
        self.can_resume = can_resume  # the heartbeat can reconnect: a wait may outlive a lost store
        self._waiting: str | None = None  # the wait `idle` last paused in, and its next pause
        self._waited = 0.0  # seconds that wait has paused so far

    def check(self, what: str) -> None:
        """What every wait checks at every poll: the heartbeat's fate, a restarted store, a stop or drain."""
        self.check_heartbeat()
        if self.m.reset:
            self.m.forget_run()
            raise Reformed(f"node {self.node_id}: {what}: the membership store restarted empty; the run re-forms")
        reason = self.interrupt() if self.interrupt is not None else None
        if reason:
            raise Stopped(reason, what)

    def idle(self, what: str) -> None:
        """One pause of the wait `what`: 2 ms, or an eighth of the wait so far, up to mesh.polling_interval.
        Without a heartbeat thread the wait loops beat themselves (tests) and pause a whole interval each time."""
        self.check(what)
        interval = self.cfg.polling_interval
        if not self.heartbeat.use_thread:
            if self.m.state != NodeState.LEFT:
                self.heartbeat.beat()
                self.check_heartbeat()
            self.sleep(interval)
            return
        if what != self._waiting:
            self._waiting, self._waited = what, 0.0
        pause = min(interval, max(FIRST_POLL_S, LATE * self._waited))
        self._waited += pause
        self.sleep(pause)

    def check_heartbeat(self) -> None:
        if self.heartbeat.error is not None:
            raise MeshError(f"node {self.node_id}: heartbeat stopped: {self.heartbeat.error}")

    def resilient(self, what: str, call: Callable[[], Any]) -> Any:
        """Run a wait; a store error pauses it until the store is back, then it starts over (bounded by
        mesh.store_lost_timeout through the heartbeat, and interruptible)."""
        while True:
            try:
                with self.guard(what, resumable=True):
                    return call()
            except _StoreDown:
                self._await_store(what)

    def _await_store(self, what: str) -> None:
        while True:
            self.check(what)
            if not self.heartbeat.use_thread:
                self.heartbeat.beat()
            elif not self.heartbeat.alive():
                self.check_heartbeat()
                raise MeshError(f"node {self.node_id}: {what}: lost the membership store (heartbeat stopped)")
            if self.heartbeat.lost_since is None and self._store_answers():
                return
            self.sleep(self.cfg.polling_interval)

    def _store_answers(self) -> bool:
        try:
            self.m.store.check([self.keys.ids()])
            return True
        except STORE_ERRORS:
            return False

    @contextmanager
    def guard(self, what: str, resumable: bool = False) -> Iterator[None]:
        """Store failures: in a resumable wait, a pause until the heartbeat has the store back (_StoreDown);
        else one MeshError line naming this node and what it was doing."""
        try:
            yield
        except (MeshError, Excluded, Stopped, Reformed, ValueError):
            raise
        except STORE_ERRORS as e:
            if resumable and self.can_resume and self.m.ready and self.heartbeat.error is None:
                raise _StoreDown(first_line(e)) from None
            raise MeshError(f"node {self.node_id}: {what}: lost the membership store ({first_line(e)})") from None
