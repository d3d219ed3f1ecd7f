"""Telemetry sinks for the places people look for curves: TensorBoard event files and Weights & Biases (offline).

    sinks = metric_sinks(cfg.telemetry, run_dir=cfg.run.dir, run_name=cfg.run.name, node=node, warn=print)

Each sink is a callable taking a validated event dict (engine.telemetry.Telemetry calls it after writing the JSON
line, which stays the contract with the console): the scalars below are picked from the events, nothing is
computed twice. The x axis is the node's inner step everywhere, so eval and outer-step points line up with the
training curve (in W&B, whose steps may not fall, an outer step run in the background goes at the step where it
became known).

    event        tag                     value
    step         train/loss              loss (mean over the node's ranks)
                 train/lr                lr
                 train/tokens_per_s      tokens_per_s
                 train/grad_norm         grad_norm (when computed)
    eval         eval/loss               loss
    outer_step   outer/pgrad_norm        pgrad_norm (norm of the averaged pseudo-gradient)
                 outer/bytes_sent        bytes_sent
                 outer/allreduce_s       allreduce_s
                 outer/contributors      len(contributors)

TensorBoard (`telemetry.tensorboard_dir`): one run folder per node, `<tensorboard_dir>/<node>`, written by the
process that emits events (local rank 0; every rank with telemetry.all_ranks, then `<node>/rank<r>`). W&B
(`telemetry.wandb`): offline mode under `<run.dir>/wandb` (sync later with `wandb sync`); when the package is not
installed the run goes on without it and says so in one warning event.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

Sink = Callable[[dict[str, Any]], None]


def scalars(event: dict[str, Any]) -> list[tuple[str, float]]:
    """(tag, value) pairs worth plotting in one event; [] for events without any."""
    t = event["type"]
    if t == "step":  # a loss or norm that was not finite is null: nothing to plot
        out = [("train/loss", event["loss"]), ("train/lr", event["lr"]), ("train/tokens_per_s", event["tokens_per_s"]),
               ("train/grad_norm", event["grad_norm"])]
        return [(tag, v) for tag, v in out if v is not None]
    if t == "eval":
        return [("eval/loss", event["loss"])] if event["loss"] is not None else []
    if t == "outer_step":
        return [("outer/pgrad_norm", event["pgrad_norm"]), ("outer/bytes_sent", event["bytes_sent"]),
                ("outer/allreduce_s", event["allreduce_s"]),
                ("outer/contributors", len(event.get("contributors", event["members"])))]
    return []


class TensorBoardSink:
    """Scalars into TensorBoard event files; closed (flushed) at run_end."""

    def __init__(self, logdir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ModuleNotFoundError as e:  # tensorboard is a dependency; a broken install is bad input
            raise ValueError(f"telemetry.tensorboard_dir: the tensorboard package is not installed ({e}); "
                             f"pip install tensorboard") from None
        try:
            Path(logdir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"telemetry.tensorboard_dir: cannot create {logdir} ({e.strerror})") from None
        # a short flush interval: a run watched live shows its curves within seconds, not minutes
        self.writer = SummaryWriter(log_dir=str(logdir), flush_secs=10)
        self.logdir = Path(logdir)
        self.closed = False

    def __call__(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        step = event.get("step")
        for tag, value in scalars(event):
            self.writer.add_scalar(tag, float(value), global_step=step, walltime=event["ts"])
        if event["type"] in ("eval", "outer_step"):
            self.writer.flush()  # rare and worth seeing at once
        elif event["type"] == "run_end":
            self.writer.close()
            self.closed = True


class WandbSink:
    """The same scalars into an offline Weights & Biases run; finished at run_end."""

    def __init__(self, wandb: Any, run_dir: str | Path, run_name: str, node: str):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        # console "off": wandb must not wrap stdout, where the JSON lines are the console's contract; silent: no
        # "wandb: ..." lines of its own. It writes into <dir>/wandb/offline-run-*.
        settings = wandb.Settings(console="off", silent=True)
        self.run = wandb.init(mode="offline", dir=str(run_dir), project=run_name, name=node, group=run_name,
                              settings=settings)
        self.closed = False
        self.step = 0  # the highest step logged: W&B ignores (quietly, silent=True) a point at a lower one

    def __call__(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        values = dict(scalars(event))
        if values:
            # an outer step run in the background (diloco.overlap, fragment_delay) is told after later inner steps
            # were logged: its point goes at the latest step, where it became known, instead of being dropped
            self.step = max(self.step, int(event.get("step") or 0))
            self.run.log(values, step=self.step)
        if event["type"] == "run_end":
            self.run.finish()
            self.closed = True


def metric_sinks(cfg: Any, *, run_dir: str, run_name: str, node: str, rank: int, all_ranks: bool,
                 warn: Callable[[str], None]) -> list[Sink]:
    """The sinks telemetry.tensorboard_dir and telemetry.wandb ask for (cfg is the telemetry section)."""
    sinks: list[Sink] = []
    suffix = f"rank{rank}" if all_ranks else ""
    if cfg.tensorboard_dir:
        sinks.append(TensorBoardSink(os.path.join(cfg.tensorboard_dir, node, suffix)))
    if cfg.wandb:
        try:
            import wandb
        except ModuleNotFoundError:
            warn("telemetry.wandb: the wandb package is not installed; running without Weights & Biases "
                 "(pip install wandb)")
        else:
            sinks.append(WandbSink(wandb, run_dir, run_name, node + (f"-{suffix}" if suffix else "")))
    return sinks
