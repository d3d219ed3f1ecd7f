"""The schedule, a part of the outer loop: when an outer step is due and what it covers. The only reader of
diloco.inner_steps, diloco.fragments and diloco.round (the session, engine/train.py and the outer loop ask it).

    diloco.round = "steps"   an outer step every inner_steps / fragments inner steps (DiLoCo's H, split P ways)
    diloco.round = "time"    a round ends at a deadline the plan sets (fragments refuse it: engine/config.py)
    outer step k             covers fragment (k - 1) % fragments (the whole model when fragments = 1)

A Schedule is pure (torch-free: engine/train.py asks it before torch is imported); the live round, its deadline and
its tokens, is the RoundClock it builds (rounds.py), on the wall clock it is given.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from engine.outer.rounds import RoundClock


class Schedule:
    def __init__(self, diloco: Any):
        """diloco: the config's DilocoConfig slice."""
        self.enabled = bool(diloco.enabled)
        self.kind: str = diloco.round  # "steps" | "time"
        self.h: int = diloco.inner_steps  # inner steps in which every fragment is synced once (DiLoCo's H)
        self.parts: int = diloco.fragments  # the model synced in this many fragments, one per outer step
        self.seconds: float = diloco.round_seconds  # time rounds: a round's length
        self.every = self.h // self.parts  # inner steps between two outer steps (step rounds)

    @property
    def timed(self) -> bool:
        return self.kind == "time"

    def round_clock(self, clock: Callable[[], float] = time.time) -> RoundClock:
        """The round under way, on `clock` (injected: tests and the golden table run it on a virtual one)."""
        return RoundClock(self, clock)

    # ---- what an outer step covers ------------------------------------------------------------------------------

    def fragment_of(self, outer_step: int) -> int:
        """The fragment outer step `outer_step` (1, 2, ...) syncs: the same on every member (0: the whole model)."""
        return (outer_step - 1) % self.parts

    # ---- step rounds --------------------------------------------------------------------------------------------

    def due_at(self, step: int) -> bool:
        """Step rounds: an outer step is due after inner step `step`."""
        return step % self.every == 0

    def boundaries_before(self, step: int) -> int:
        """Step rounds: the outer steps due up to inner step `step`."""
        return step // self.every

    def step_of_boundary(self, outer_step: int) -> int:
        """Step rounds: the inner step at which outer step `outer_step` is due."""
        return outer_step * self.every

    # ---- the run's length and its end ---------------------------------------------------------------------------

    def rounds(self, max_steps: int) -> int:
        """Time rounds: the run's length in rounds, the same on every node (max_steps / inner_steps, at least 1)."""
        return max(1, math.ceil(max_steps / self.h))

    def whole_rounds(self, max_steps: int) -> int:
        """Rounds of inner_steps that fit in max_steps (how many times each parameter is synced)."""
        return max_steps // self.h

    def ends_agreed(self, max_steps: int) -> bool:
        """Whether every node of the run ends on its agreed model: DiLoCo whose last step is a boundary (time rounds
        end at one; fragments sync every fragment at the run's last step; step rounds when H divides max_steps)."""
        return self.enabled and (self.timed or self.parts > 1 or max_steps % self.h == 0)

    def unsynced_tail(self, max_steps: int) -> int:
        """Step rounds cut short: the last steps, never averaged (0: none)."""
        return 0 if not self.enabled or self.ends_agreed(max_steps) else max_steps % self.h

    def lr_step(self, rounds_done: float) -> int:
        """Time rounds: the LR schedule's step after `rounds_done` rounds (H per round), the same on every node."""
        return int(self.h * rounds_done)
