"""When a round ends, and what it weighs.

    diloco.round = "steps"   a round is diloco.inner_steps inner steps on every node (DiLoCo's H)
    diloco.round = "time"    a round ends at a deadline the plan sets, whatever each node's speed

Either way a node's pseudo-gradient counts in the mean by the tokens it trained in its round (the weight travels
on the wire beside it, engine/outer/allreduce.py): with step rounds every node trains the same tokens and the mean
is the plain one; with time rounds a host twice as fast contributes twice the tokens and weighs twice as much.

With time rounds the run is measured in rounds: train.max_steps / diloco.inner_steps rounds, on every node, and
the LR schedule follows the round clock (step_for_schedule), the same on every node at the same moment whatever
its speed; each node's progress.step still counts its own steps (data position, checkpoints, logs).

The rules (steps or time, H, fragments, the run's length) are the schedule's (schedule.py), which builds this clock
on the wall clock it is given, once. The deadline is wall-clock time (time.time() unless injected): the plan
carries it (Plan.deadline, set by the planner as it writes the plan), so every member ends its round at the same
moment, a joiner admitted by that plan included.
Hosts' clocks must agree to well within a round (`zeroband-console PROFILE check` compares them). Before the
first plan, and where a plan carries none (overlap: the next round starts before its plan exists), the deadline
is the last one plus round_seconds, or now plus round_seconds when that has already passed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from engine.outer.progress import Progress


class RoundRules(Protocol):
    """What the clock asks of the schedule (engine.outer.schedule.Schedule)."""

    @property
    def timed(self) -> bool: ...

    @property
    def seconds(self) -> float: ...

    def due_at(self, step: int) -> bool: ...

    def boundaries_before(self, step: int) -> int: ...

    def step_of_boundary(self, outer_step: int) -> int: ...

    def rounds(self, max_steps: int) -> int: ...

    def lr_step(self, rounds_done: float) -> int: ...


class RoundClock:
    def __init__(self, schedule: RoundRules, clock: Callable[[], float] = time.time):
        self.schedule, self.seconds = schedule, schedule.seconds
        self.clock = clock  # given once: every deadline and step length is read on it
        self.deadline: float | None = None  # time rounds: when this round ends
        self._tokens0: int | None = None  # progress.tokens when this round began
        self._last_step_at: float | None = None  # when due() was last asked: the length of an inner step

    @property
    def timed(self) -> bool:
        return self.schedule.timed

    def begin(self, progress: Progress, plan: Any = None, *, keep_tokens: bool = False) -> None:
        """A round begins now (after a commit, a hand-off, an overlapped boundary): its tokens count from here
        (keep_tokens: a resumed round goes on counting from its checkpointed start); its deadline is the plan's,
        or the last one's plus a round."""
        if not keep_tokens:
            self._tokens0 = progress.tokens
        self._last_step_at = None  # the outer step between two rounds is no inner step
        if not self.timed:
            return
        deadline = getattr(plan, "deadline", None)
        if deadline is None:
            now = self.clock()
            nxt = self.deadline + self.seconds if self.deadline is not None else now + self.seconds
            deadline = nxt if nxt > now else now + self.seconds
        self.deadline = deadline

    def reopen(self, tokens: int) -> None:
        """The round before this one did not commit (its outer step, in flight, was stopped): this round goes on
        counting its tokens too, as its pseudo-gradient now holds both rounds' progress."""
        if self._tokens0 is not None:
            self._tokens0 -= tokens

    def due(self, progress: Progress) -> bool:
        """This node's round is over (after an inner step). Time rounds: local ranks must agree (the caller). A node
        ends its round at the step that ends nearest the deadline: it does not start a step that would end more than
        half a step past it, so a slow node's last step does not make it late for the planner's grace."""
        if not self.timed:
            return self.schedule.due_at(progress.step)
        now = self.clock()
        step_s, self._last_step_at = (now - self._last_step_at if self._last_step_at is not None else 0.0), now
        return self.deadline is not None and now + step_s / 2 >= self.deadline

    def close(self, progress: Progress) -> int:
        """The tokens of the round that ends now (the next round counts from its begin(): after the commit, so a
        checkpoint saved at a boundary before it committed still knows the round's tokens)."""
        tokens0 = self._tokens0 if self._tokens0 is not None else self._guess_tokens0(progress)
        return max(0, progress.tokens - tokens0)

    def pending_at_resume(self, progress: Progress) -> bool:
        """A checkpoint saved at a step-round boundary before it committed: that round is contributed at start.
        (A time round in progress at a checkpoint goes on after the resume and ends at its next deadline.)"""
        return not self.timed and progress.step > 0 and self.schedule.due_at(progress.step) \
            and self.schedule.boundaries_before(progress.step) > progress.outer_step

    def _guess_tokens0(self, progress: Progress) -> int:
        """A checkpoint older than the round clock: the tokens since the last committed boundary, from the steps
        (step rounds: the steps up to outer_step's boundary were committed)."""
        if progress.step <= 0:
            return progress.tokens
        per_step = progress.tokens / progress.step
        since = progress.step - self.schedule.step_of_boundary(progress.outer_step)
        return progress.tokens - int(round(max(0, since) * per_step))

    # ---- the run's length and schedule --------------------------------------------------------------------------

    def finished(self, progress: Progress, max_steps: int) -> bool:
        if not self.timed:
            return progress.step >= max_steps
        return progress.outer_step >= self.schedule.rounds(max_steps)

    def step_for_schedule(self, progress: Progress) -> int | None:
        """Time rounds: the step of the LR schedule now, H per round, advancing with the round clock. Step rounds:
        None (the schedule follows the node's own steps)."""
        if not self.timed or self.deadline is None:
            return None
        into = 1.0 - min(1.0, max(0.0, (self.deadline - self.clock()) / self.seconds))
        return self.schedule.lr_step(progress.outer_step + into)

    def resume(self, progress: Progress) -> None:
        """At start: a fresh run's round counts from here; a resumed one from its checkpointed round start."""
        if self._tokens0 is None:
            self._tokens0 = self._guess_tokens0(progress)

    def state_dict(self) -> dict[str, Any]:
        return {"round_tokens0": self._tokens0}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("round_tokens0") is not None:
            self._tokens0 = int(sd["round_tokens0"])
