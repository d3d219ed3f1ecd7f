"""The outer loop's factory and its seam: `build_outer` (NoOuter, or a DiLoCo loop built of parts from the config),
the `Outer` protocol it returns, `NoOuter` and `Diverged`.

The outer loop wraps the inner loop; the inner loop never asks whether DiLoCo is on. Plain DDP/FSDP training is
DiLoCo with a no-op boundary (`NoOuter`). Life cycle, called on every local rank in this order:

    outer.start(progress)                   once, before the first inner step (a joiner may rewrite progress)
    stop = outer.after_inner_step(progress) after every inner optimizer step; True: leave the loop ("drained")
    outer.request_drain()                   any time from the training thread (signal or drain file seen)
    outer.flush()                           before a checkpoint or the export: any outer update still in flight
                                            (diloco.overlap) lands in the parameters
    outer.state_dict() / load_state_dict()  checkpointed with the inner state
    outer.close(status)                     once, last; status is a run_end status
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from engine.config import Config

from engine.digests import mesh_settings, run_digest
from engine.outer.progress import Progress
from engine.outer.schedule import Schedule


class Diverged(RuntimeError):
    """The loss of a run without DiLoCo stopped being finite: the weights in memory are NaN, and nothing is saved
    over the last good checkpoint. (Under DiLoCo a diverged node is repaired at the next outer step, and a step
    where every member diverged ends as a MeshError holding the last committed weights: engine/outer/diloco.py.)"""


@runtime_checkable
class Outer(Protocol):
    @property
    def repairs_divergence(self) -> bool:
        """Whether a non-finite loss is this node's round's to lose (it is repaired at the next outer step), not
        the run's (engine/train.py stops the run)."""

    def start(self, progress: Progress) -> None: ...

    def after_inner_step(self, progress: Progress) -> bool: ...

    def finished(self, progress: Progress, max_steps: int) -> bool:
        """Whether training is over (steps: this node's max_steps; DiLoCo time rounds: the run's rounds)."""

    def step_for_schedule(self, progress: Progress) -> int | None:
        """The LR schedule's step where it is not the node's own step count (time rounds), else None."""

    def request_drain(self) -> None: ...

    def flush(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self, status: str) -> None: ...


class NoOuter:
    """No outer step. A drain request stops training at the next inner step (the caller reports "drained")."""

    repairs_divergence = False  # alone, a diverged run has nothing to take good weights from

    def __init__(self, telemetry=None) -> None:
        self.telemetry = telemetry
        self._drain = False
        self.interrupt = None  # session.Signals.requested; nothing here waits, so nothing polls it

    def start(self, progress: Progress) -> None:
        pass

    def finished(self, progress: Progress, max_steps: int) -> bool:
        return progress.step >= max_steps

    def step_for_schedule(self, progress: Progress) -> int | None:
        return None

    def after_inner_step(self, progress: Progress) -> bool:
        if self._drain and self.telemetry is not None:
            self.telemetry.emit("drained", outer_step=progress.outer_step, step=progress.step)
        return self._drain

    def request_drain(self) -> None:
        self._drain = True

    def flush(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self, status: str) -> None:
        pass


def build_outer(cfg: Config, world, inner, telemetry, local_group=None) -> Outer:
    """NoOuter unless diloco.enabled; then engine.outer.diloco.DilocoOuter, whose parts (landing, codec, cover,
    outer optimizer) build_parts picks from diloco.* (imported only when asked for: it needs torch)."""
    if not cfg.diloco.enabled:
        return NoOuter(telemetry)
    from engine.outer.diloco import DilocoOuter
    note = short_run_note(cfg)
    if note and telemetry is not None:
        telemetry.emit("warning", message=note)
    return DilocoOuter(cfg.diloco, cfg.mesh, world, inner, telemetry, config_digest=run_digest(cfg),
                       settings=mesh_settings(cfg), local_group=local_group)


# Outer momentum needs many outer steps to pay off: in every run docs/learning.md measured (6 to 80 outer steps) it
# lost to plain averaging, and the DiLoCo paper's gains come from runs of 176 outer steps and more.
SHORT_RUN_OUTER_STEPS = 100


def short_run_note(cfg: Config) -> str | None:
    """A warning for outer momentum in a run too short for it to pay off, or None."""
    d = cfg.diloco
    rounds = Schedule(d).whole_rounds(cfg.train.max_steps)
    if d.outer_optimizer == "average" or d.outer_momentum < 0.5 or rounds >= SHORT_RUN_OUTER_STEPS:
        return None
    return (f"diloco: {rounds} outer steps (train.max_steps / diloco.inner_steps) with diloco.outer_momentum "
            f"{d.outer_momentum:g}: outer momentum lost to plain averaging in every run of under "
            f"{SHORT_RUN_OUTER_STEPS} outer steps measured (docs/learning.md); consider outer_lr 1.0, "
            f"outer_momentum 0")
