"""The state hand-off: after a commit, a plan's source broadcasts parameters, outer momentum and Progress to its
joiners (and, at a run's first outer step, to every member, so nodes resumed from checkpoints of different ages
start from one set of weights).

Every member takes part in the broadcast over the plan's group. A member that is not the source compares what it
received with its own state, a free check that the members agree, and adopts the source's state where it differs.
If the hand-off fails the commit stands: a joiner that missed its state steps out and, once the run planned its
next outer step without it, asks to join again, which hands it the state from a member still alive (the planner
neither waits for it nor counts it meanwhile; engine/mesh/node.py, step_out).
Gloo moves host tensors only, so on a GPU these are host copies (a hand-off is rare).

At a run's first outer step (plan.forming, no joiners) the members first compare fingerprints of what the
hand-off would move (parameters and outer momentum: one small all_gather). Where every member already holds the
source's state, as in every fresh run started from one seed, nothing moves: a 1B model's 4 GB would have taken
160 s at 200 Mbit/s. Members that hold other weights (resumed from other checkpoints, a node restarted under a
store restart) differ, and the source's state moves to all of them. A member that differs and did not get it (the
transfer failed) steps out and joins again, which hands it the state.

The broadcast is a chain: the source, then the joiners, then the other members, in plan order, each forwarding a
piece (PIECE_BYTES) to the next as soon as it has it. Every uplink carries the state once, so the hand-off takes
the state's bytes over one link plus a piece per extra hop, whatever the number of members. gloo's broadcast sent
the whole state from the source to each member in turn: with 4 hosts its uplink carried it 3 times (1.6-2.0x the
link bound at 200 Mbit/s, docs/performance.md). A node gives up only on a death before it in the chain; a next
node that dies or freezes ends its forwarding, not its receiving.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.outer.buffers import OuterBuffers, fingerprint
from engine.outer.groups import GROUP_ERRORS, MeshLinks, PeerLost
from engine.outer.optimizer import OuterOptimizer
from engine.outer.progress import Progress
from engine.errors import first_line

PIECE_BYTES = 256 * 1024  # one message of the chain: at 200 Mbit/s each extra hop delays the end by 10 ms
TAG = 1 << 20  # the chain's message tags start here, clear of the mean's (engine/outer/allreduce.py)
WINDOW = 256  # pieces in flight per hop (64 MiB): a 1 Gbit/s link with 0.5 s of round trip stays busy

Adopt = Callable[[torch.Tensor, list[torch.Tensor]], None]  # (parameters, every tensor received) -> None


class MissedState(Exception):
    """A joiner's state did not arrive: it stepped out, and joins again (DilocoOuter._round)."""


class StateHandoff:
    def __init__(self, bufs: OuterBuffers, opt: OuterOptimizer, links: MeshLinks, emit: Callable[..., Any]):
        self.bufs, self.opt, self.links, self.emit = bufs, opt, links, emit

    def send(self, plan: Any, progress: Progress, agreed: torch.Tensor, adopt: Adopt, *, into_mean: bool) -> None:
        """A member's side: the source sends `agreed` (its weights of this outer step); the others check theirs
        (into_mean: receive the parameters straight into the free mean buffer, where it is on the host)."""
        source = self.links.node_id == plan.source
        check = not plan.joiners  # a (re)formed run's first outer step: fingerprints first
        differs = False  # this member's fingerprints were read and are not the source's
        missed: str | None = None  # they differ, and the source's state did not come
        tensors: list[torch.Tensor] = []
        try:
            same = False
            if check:
                rows = self._fingerprints(plan, agreed)
                theirs = rows[plan.rank_of(plan.source)]
                same = bool((rows == theirs).all())
                differs = not bool((rows[plan.rank_of(self.links.node_id)] == theirs).all())
            if not same:
                tensors = self._tensors(progress, agreed, source=source, into_mean=into_mean)
                self._broadcast(plan, tensors)
        except GROUP_ERRORS as e:
            # already committed here: a joiner that missed its state steps out on its side (receive)
            # The group stays: the hand-off follows a commit, the members that got the state keep the generation's
            # group, and one rebuilt here alone would meet none of them at its rendezvous (a lost attempt). The
            # abandoned chain's receives use tags of their own (TAG + i), clear of the mean's.
            if isinstance(e, PeerLost) and not source and tensors and tensors[0] is self.bufs.mean:
                # but its thread may still write pieces into the mean buffer when a frozen node before this one
                # wakes up, as an abandoned collective may (exchange.py). (The source's tensors are its agreed
                # weights, which with overlap are the mean buffer itself: they stay.)
                self.bufs.renew_scratch()
            self.emit("warning", message=f"state hand-off to {list(plan.joiners) or 'the members'} failed: "
                                         f"{first_line(e, 200)}")
            tensors = []
            if plan.forming and differs:  # not when the check itself failed: then nothing says it differs
                missed = first_line(e, 200)
        if check:  # (a hand-off without joiners is a formation's)
            # every local rank of the node comes here at this step, whatever its shard found: the node steps out as
            # one when any of its ranks holds weights of its own that the source's did not replace
            lost = self.links.local.every(missed)
            if lost:
                self._step_out(plan, lost[0])
                return
        if tensors and not source and not torch.equal(tensors[0], agreed.cpu()):
            self.emit("warning", message=f"outer step {plan.outer_step}: parameters differed from source "
                                         f"{plan.source}'s; adopted the source's")
            adopt(tensors[0], tensors)

    def receive(self, plan: Any, progress: Progress, adopt: Adopt, *, into_mean: bool) -> None:
        """A joiner's side: adopt the source's state and its counters. Where it did not arrive (on any local rank:
        the source or a joiner before this one in the chain died, a link dropped), the commit stands without this
        node: it steps out, keeps nothing of what came, and raises MissedState; the caller asks to join again,
        which hands it the state from a member still alive."""
        tensors = self._tensors(progress, None, source=False, into_mean=into_mean)
        error = None
        try:
            self._broadcast(plan, tensors)
        except GROUP_ERRORS as e:
            error = first_line(e, 200)
            if isinstance(e, PeerLost) and tensors[0] is self.bufs.mean:
                self.bufs.renew_scratch()  # the abandoned chain's thread may still write into it (send, above)
        missed = self.links.local.every(error)
        if missed:
            why = f"the state from {plan.source} did not arrive ({missed[0]})"
            self.links.local.on_leader("step out", lambda: self.links.mesh.step_out(
                plan, why, cause="it missed the state it joined for"))
            raise MissedState(f"outer step {plan.outer_step}: {why}")
        adopt(tensors[0], tensors)
        progress.step, progress.outer_step, progress.tokens = (int(c) for c in tensors[-1].tolist())

    def _fingerprints(self, plan: Any, agreed: torch.Tensor) -> torch.Tensor:
        """Every member's row of fingerprints of its parameters and outer momentum (one small all_gather; the same
        rows on every member). Not its counters: every member is at the plan's outer step, and with time rounds
        each node counts its own inner steps and tokens (a member keeps its own whatever it receives)."""
        pg = self.links.group(plan)
        assert pg is not None, "a hand-off has more than one member"
        mom = self.opt.check_tensor()
        mine = torch.tensor([int(fingerprint(agreed), 16), int(fingerprint(mom), 16) if mom is not None else -1],
                            dtype=torch.int64)
        rows = torch.empty(plan.size, mine.numel(), dtype=torch.int64)
        self.links.bounded(plan, "state check", lambda: pg.allgather([[rows[i] for i in range(plan.size)]],
                                                                     [mine]).wait(), until_decided=False)
        return rows

    def _step_out(self, plan: Any, err: str) -> None:
        """A member of a run's first outer step whose weights differ from the source's and did not receive them
        must not train on from its own: it steps out, and at its next boundary it asks to join again, which
        hands it the state. (Every local rank calls this; local rank 0 steps the node out.)"""
        why = (f"the state hand-off of the run's first outer step failed ({err}) and this node's weights differ "
               f"from source {plan.source}'s: it joins again to receive them")
        self.links.local.on_leader("step out", lambda: self.links.mesh.step_out(
            plan, why, cause="its weights differ from the run's"))

    def _tensors(self, progress: Progress, agreed: torch.Tensor | None, *, source: bool,
                 into_mean: bool) -> list[torch.Tensor]:
        """In order: parameters, the outer optimizer's state (its handoff_tensors: none, or its momentum), progress."""
        n = self.bufs.numel
        if source:
            assert agreed is not None
            out = [agreed.cpu()]
        else:
            out = [self.bufs.mean if into_mean and self.bufs.device.type == "cpu" else torch.empty(n)]
        out += self.opt.handoff_tensors(n, source=source)
        out.append(torch.tensor([progress.step, progress.outer_step, progress.tokens], dtype=torch.int64))
        return out

    def _broadcast(self, plan: Any, tensors: list[torch.Tensor]) -> None:
        pg = self.links.group(plan)
        assert pg is not None, "a plan with joiners has more than one member"
        # the joiners first: a member that dies mid-chain cuts off only the nodes after it (whose part is a check
        # of a state they already hold), never a joiner that needs it. This rank gives up on a death upstream
        # only; a next node that dies or freezes ends its forwarding, not its receiving
        rest = [m for m in plan.members if m != plan.source]
        ids = [plan.source] + sorted(rest, key=lambda m: m not in plan.joiners)
        at = ids.index(self.links.node_id)
        after = ids[at + 1] if at + 1 < len(ids) else None
        upstream = ids[:at]  # watched until every piece has landed here; then a death costs this node nothing
        delivered = self.links.bounded(
            plan, "state hand-off", lambda: chain(pg, [plan.rank_of(m) for m in ids], tensors,
                                                  downstream_lost=lambda: after in self.links.dead(plan),
                                                  received=upstream.clear),
            until_decided=False, watch=upstream)
        if not delivered:
            self.emit("warning", message=f"state hand-off: {after} stopped taking the state from "
                                         f"{self.links.node_id}; the nodes after it in the chain "
                                         f"({', '.join(ids[at + 1:])}) did not get it")


def pieces(tensors: list[torch.Tensor], piece_bytes: int = PIECE_BYTES) -> list[torch.Tensor]:
    """The tensors (contiguous) cut into flat views of at most piece_bytes, in order."""
    out = []
    for t in tensors:
        flat = t.view(-1)
        out += list(flat.split(max(1, piece_bytes // flat.element_size())))
    return out


def chain(pg: dist.ProcessGroup, order: list[int], tensors: list[torch.Tensor], *, piece_bytes: int = PIECE_BYTES,
          window: int = WINDOW, downstream_lost: Callable[[], bool] = lambda: False,
          received: Callable[[], None] = lambda: None, poll_s: float = 0.01) -> bool:
    """A pipelined broadcast from order[0] down the chain of group ranks `order`: every rank but the first
    receives each piece from the rank before it and sends it on to the rank after it at once. At most `window`
    receives are posted ahead and `window` sends are in flight, so a model of any size holds a bounded number of
    messages (a piece lands whenever it comes within the window).

    Returns whether every piece went on to the next rank (True on the last). The sends run on a thread of their
    own (_Forward): a next rank that dies (its sends fail) or that downstream_lost() says is gone (a frozen one
    would hold its sends until gloo's timeout) ends this rank's forwarding, never its receiving. A failed
    receive raises: the state did not arrive. received() is called once every piece has landed here."""
    at = order.index(pg.rank())
    before = order[at - 1] if at > 0 else None
    after = order[at + 1] if at + 1 < len(order) else None
    parts = pieces(tensors, piece_bytes)
    forward = _Forward(pg, after, window) if after is not None else None
    arrivals: deque = deque()

    def post(i: int) -> None:
        if before is not None and i < len(parts):
            arrivals.append(pg.recv([parts[i]], before, TAG + i))
    try:
        for i in range(window):
            post(i)
        for i, p in enumerate(parts):
            if before is not None:
                arrivals.popleft().wait()
                post(i + window)
            if forward is not None:
                forward.put((i, p))
    except BaseException:
        if forward is not None:
            forward.put(None)  # its thread ends once the sends it made are done (or fail)
        raise
    received()
    return forward is None or forward.finish(downstream_lost, poll_s)


class _Forward:
    """The sends of one hop of the chain, on a thread of their own, at most `window` in flight: a next rank that
    stalls holds up only them."""

    def __init__(self, pg: dist.ProcessGroup, to: int, window: int):
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(pg, to, window), name="diloco-handoff-forward",
                                        daemon=True)
        self._thread.start()

    def put(self, item: tuple[int, torch.Tensor] | None) -> None:
        self._queue.put(item)

    def _run(self, pg: dist.ProcessGroup, to: int, window: int) -> None:
        sends: deque = deque()
        try:
            while (item := self._queue.get()) is not None:
                i, piece = item
                if len(sends) >= window:
                    sends.popleft().wait()
                sends.append(pg.send([piece], to, TAG + i))
            for work in sends:
                work.wait()
        except GROUP_ERRORS as e:  # the next rank died: what it would have forwarded is lost downstream
            self.error = e

    def finish(self, lost: Callable[[], bool], poll_s: float) -> bool:
        """Wait for every send, or until lost() says the next rank is gone; True when every piece went."""
        self._queue.put(None)
        while self._thread.is_alive():
            if lost():
                return False  # the thread stays blocked in gloo until its timeout; nothing waits for it
            self._thread.join(poll_s)
        return self.error is None
