"""A training session on one process, once its command line and config were accepted (engine/train.py): read and
check the inputs, build model, inner strategy, outer loop and checkpointer, train, save, export, close.

    inputs = read_inputs(cfg, world, telemetry)     # data, model shape, checkpoint to resume: checked, nothing written
    s = build(cfg, world, telemetry, inputs)        # process group, device, model, inner, outer; resume
    status = run(s)                                 # inner steps until max_steps, a stop or a drain; save; export
    close(s, status); teardown(clean=True)          # the outer loop, the resource sampler, then the process group

This is the half of the engine's entry that imports torch, transformers and the strategies (about 6 s of a process
start on a loaded CPU): engine/train.py imports it only after the config and the command line were checked, so a
bad one is reported at once.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from engine.checkpoint import Checkpointer, export
from engine.config import Config, grad_accum_steps
from engine.digests import digest, flat_settings, shared_settings
from engine.data import Data, TokenStream, build_data, dataset_name
from engine.errors import same_on_every_rank
from engine.mesh.protocol import Stopped
from engine.model import build_model, count_params, model_config, tokenizer_note
from engine.outer import Diverged, Outer, Progress, build_outer
from engine.outer.schedule import Schedule
from engine.inner.ddp_fsdp import build_inner, setup_distributed
from engine.inner.optim import lr_factor
from engine.inner.transforms import first_step
from engine.resources import ResourceMonitor
from engine.telemetry import Telemetry
from engine.world import World

__all__ = ["Inputs", "Progress", "Session", "build", "close", "dataset_name", "read_inputs", "run",
           "save_before_failing", "teardown", "train_step"]


def _file_id(path: str | None) -> tuple[int, int, int] | None:
    """(device, inode, mtime in ns) of a file; None when there is none."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:  # absent (or gone as it was read)
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


class Signals:
    """Flags set by signal handlers (or the drain file) and agreed on by all ranks of the node. A drain file found
    at start-up that is older than the process is a request to an earlier run (a job submitted again, a node
    restarted by hand): ignored until it is touched again. A touch is told by the file's identity and mtime
    changing, not by a clock (a network filesystem's mtimes come from the server's)."""

    def __init__(self, drain_file: str | None, found: tuple[int, int, int] | None = None):
        self.drain_file = drain_file
        self.found = found  # a stale drain file as read_inputs found it (None: none)
        self.stop = False
        self.drain = False
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_drain)

    def _on_stop(self, signum, frame) -> None:
        self.stop = True

    def _on_drain(self, signum, frame) -> None:
        self.drain = True

    def requested(self) -> str | None:
        """"stopped" or "drained" if asked for, else None. This rank's own view, no collective: polled by the
        outer loop's waits (every rank of a node receives the signal; the mesh answer reaches all of them)."""
        if self.stop:
            return "stopped"
        if self.drain or self._drain_file_says():
            return "drained"
        return None

    @staticmethod
    def stale(drain_file: str | None) -> tuple[int, int, int] | None:
        """The drain file as found at start-up, when it predates this process (None otherwise: absent, or made
        since the process started, which is a request to this one)."""
        st = _file_id(drain_file)
        if st is None or st[2] / 1e9 >= psutil.Process().create_time():
            return None
        return st

    def _drain_file_says(self) -> bool:
        """There, and not the stale file found at start-up as it was found (created, replaced or touched since)."""
        now = _file_id(self.drain_file)
        return now is not None and now != self.found

    def stale_drain_file(self) -> bool:
        """The drain file was there as this process started and was not touched since (one warning says so)."""
        return self.found is not None and not self._drain_file_says()

    def poll(self, world: World, group) -> tuple[bool, bool]:
        """(stop, drain), the same on every rank. A collective when the node has several ranks."""
        # one rank looks at the file (it may sit on a network filesystem); the MAX below tells the others
        drain = self.drain or (world.rank == 0 and self._drain_file_says())
        if world.world_size == 1:
            return self.stop, drain
        flags = torch.tensor([float(self.stop), float(drain)])  # CPU tensor: gloo (or NCCL's gloo side)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return bool(flags[0]), bool(flags[1])


@dataclass
class Session:
    cfg: Config
    world: World
    telemetry: Telemetry
    device: torch.device
    group: Any
    data: Data
    hf_config: Any
    inner: Any
    outer: Outer
    ckpt: Checkpointer
    signals: Signals
    resources: ResourceMonitor | None
    progress: Progress = field(default_factory=Progress)
    accum: int = 1
    draining: bool = False
    training: bool = False  # outer.start() succeeded: a mesh error from now on is a failure, not bad input
    facts: dict[str, Any] = field(default_factory=dict)  # shown once on the "training" state event
    diverged_round: int = -1  # the outer step whose round last said its loss was not finite (one warning a round)


@dataclass
class Inputs:
    """What read_inputs() read and checked: the same on every rank of the node, and nothing written yet."""
    data: Data
    hf_config: Any
    ckpt: Checkpointer
    resume_from: Path | None
    stale_drain: tuple[int, int, int] | None = None  # a drain file of an earlier run, found at start-up


def read_inputs(cfg: Config, world: World, telemetry: Telemetry) -> Inputs:
    """The data, the model's shape and the checkpoint to resume, read and checked before this rank does anything of
    its own (no process group, no device, nothing written)."""
    telemetry.emit("state", state="starting")
    stale_drain = Signals.stale(cfg.mesh.drain_file)  # early: a drain asked for from now on is this run's
    with same_on_every_rank():
        data = build_data(cfg.data, world, cfg.train.seed)
        hf_config = model_config(cfg.model, data.vocab_size, cfg.data.seq_len)
        ckpt = Checkpointer(cfg.ckpt, cfg.run.dir, world, digest(cfg), cfg.inner.strategy,
                            max_steps=cfg.train.max_steps, settings=flat_settings(shared_settings(cfg)))
        resume_from = ckpt.plan_start()  # before the expensive part: refuse bad folders early
    for note in [*data.notes, *ckpt.notes, tokenizer_note(cfg.model.path, cfg.data.tokenizer, cfg.data.fake),
                 unsynced_tail_note(cfg), eval_off_note(cfg, data)]:
        if note:
            telemetry.emit("warning", message=note)
    return Inputs(data, hf_config, ckpt, resume_from, stale_drain)


def build(cfg: Config, world: World, telemetry: Telemetry, inputs: Inputs) -> Session:
    data, ckpt = inputs.data, inputs.ckpt
    device, group = setup_distributed(cfg.inner, world)
    ckpt.device, ckpt.group = device, group
    with same_on_every_rank():  # the strategies' rules (offload, precision, overlap) on the same config and device
        init_seed = cfg.train.seed if cfg.train.init_seed is None else cfg.train.init_seed
        model = build_model(cfg.model, data.vocab_size, cfg.data.seq_len, device, seed=init_seed)
        params = count_params(model)  # before sharding: ZeRO-3 empties the partitioned tensors
        inner = build_inner(model, cfg.inner, cfg.train, cfg.optim, world, device)
        outer = build_outer(cfg, world, inner, telemetry, local_group=group)
    ckpt.move_older_run_aside()  # only now that every input was accepted: a bad one leaves the folder as it was
    if ckpt.archived is not None:
        telemetry.emit("warning", message=f"ckpt.dir: an older run's checkpoints moved to {ckpt.archived}")
    signals = Signals(cfg.mesh.drain_file, inputs.stale_drain)
    if signals.stale_drain_file():
        telemetry.emit("warning", message=f"mesh.drain_file {cfg.mesh.drain_file} is older than this process (an "
                                          f"earlier run's drain request?): ignored; touch it again to drain")
    outer.interrupt = signals.requested  # the outer loop's waits end on a stop or drain
    session = Session(cfg, world, telemetry, device, group, data, inputs.hf_config, inner, outer, ckpt, signals,
                      resources=None, accum=grad_accum_steps(cfg.train, world.world_size))
    session.facts = {"params": params, "device": str(device), "grad_accum": session.accum}
    if inputs.resume_from is not None:
        ckpt.load(inputs.resume_from, inner, data, session.progress, outer)
        session.facts.update(resumed_from=str(inputs.resume_from), resumed_step=session.progress.step)
        note = schedule_note(cfg, ckpt.resume_meta or {})
        if note:
            telemetry.emit("warning", message=note)
    if telemetry.enabled:  # started last: nothing after it can fail and leave the thread running
        # local rank 0 samples every GPU of the node; with telemetry.all_ranks each rank samples its own
        gpus = [] if device.type != "cuda" else [device.index] if cfg.telemetry.all_ranks \
            else list(range(world.world_size))
        session.resources = ResourceMonitor(lambda **f: telemetry.emit("resource", **f),
                                            cfg.telemetry.resource_interval, gpus, world.visible_gpus).start()
        if session.resources.fallback_reason:
            telemetry.emit("warning", message=session.resources.fallback_reason)
    return session


def ends_agreed(cfg: Config) -> bool:
    """Whether every node of the run ends on its agreed model: DiLoCo whose last step is a boundary (time rounds
    end at one; fragments sync every fragment at the run's last step; step rounds when H divides max_steps): the
    schedule's rule (engine/outer/schedule.py)."""
    return Schedule(cfg.diloco).ends_agreed(cfg.train.max_steps)


def unsynced_tail_note(cfg: Config) -> str | None:
    """Step rounds whose last round is cut short: its steps are never averaged."""
    schedule, m = Schedule(cfg.diloco), cfg.train.max_steps
    tail = schedule.unsynced_tail(m)
    if not tail:
        return None
    return (f"train.max_steps ({m}) is not a multiple of diloco.inner_steps ({schedule.h}): the last {tail} steps "
            f"are never averaged, and each node ends on its own weights (checkpoint, export)")


def schedule_note(cfg: Config, meta: dict[str, Any]) -> str | None:
    """A resume under another train.max_steps than the checkpoint's run moves the LR schedule under the steps to
    come (a raised max_steps takes a cosine back up): say so, once."""
    before, step = meta.get("max_steps"), int(meta.get("step", 0))
    if before is None or before == cfg.train.max_steps or cfg.optim.schedule == "constant":
        return None
    where = f"step {step}"
    schedule = Schedule(cfg.diloco)
    if schedule.enabled and schedule.timed:  # the LR schedule follows the round clock, not the steps
        rounds = int(meta.get("progress", {}).get("outer_step", 0))
        step, where = schedule.lr_step(rounds), f"round {rounds}"
    was, now = (cfg.optim.lr * lr_factor(step, cfg.optim, n) for n in (before, cfg.train.max_steps))
    how = "stretched" if cfg.train.max_steps > before else "shortened"
    return (f"train.max_steps is {cfg.train.max_steps}, the checkpoint's run had {before}: the {cfg.optim.schedule} "
            f"LR schedule is {how} to {cfg.train.max_steps} steps (lr at {where}: {now:.2e}, was {was:.2e})")


def eval_off_note(cfg: Config, data: Data) -> str | None:
    """train.eval_interval asks for eval, and the data holds nothing out (data.eval_percent = 0, here or at prepare
    time): no eval event would come, and nothing said why. (Too few held-out tokens has its own note.)"""
    if not cfg.train.eval_interval or data.eval is not None or any("eval is off" in n for n in data.notes):
        return None
    return (f"train.eval_interval = {cfg.train.eval_interval}, but the data holds nothing out for eval "
            f"(data.eval_percent = 0, or the prepared folder's): eval is off")


def train_step(inner, stream: TokenStream, micro_batch_size: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `accum` micro-batches: (mean micro-batch loss, grad norm), both on device. A step
    that fails part way (a CUDA OOM in its second micro-batch) did not happen: the data position goes back to its
    start, so the checkpoint saved before exit reads those sequences again (it skipped them on resume)."""
    consumed = stream.consumed
    try:
        losses = []
        for i in range(accum):
            input_ids, labels = stream.next_batch(micro_batch_size)
            losses.append(inner.micro_step(input_ids, labels, last=i == accum - 1))
        grad_norm = inner.optimizer_step()
    except BaseException:
        stream.consumed = consumed
        raise
    return torch.stack(losses).mean(), grad_norm


def first_compiled_step(s: Session, compiled) -> tuple[torch.Tensor, torch.Tensor]:
    """The step that compiles (engine/inner/transforms.py first_step), then what it took: a state event with its
    seconds for the console, or one warning when the compiler failed and the run goes on eager."""
    def undo() -> None:  # what a failed forward may leave: gradients, FSDP2's gathered layers
        s.inner.optimizer.zero_grad(set_to_none=True)
        if hasattr(s.inner, "reshard"):
            s.inner.reshard()
    step = lambda: train_step(s.inner, s.data.train, s.cfg.train.micro_batch_size, s.accum)  # noqa: E731
    out = first_step(compiled, step, undo)
    if compiled.fallback:
        s.telemetry.emit("warning", message=f"train.compile: compiling the first step failed ({compiled.fallback}); "
                                            f"training on eager (train.compile = false skips the attempt)")
    s.telemetry.emit("state", state="training", step=s.progress.step + 1, compile_s=round(compiled.seconds, 3),
                     compiled=compiled.fallback is None)
    return out


def node_mean(value: torch.Tensor | float, s: Session) -> float:
    """The mean of a scalar over the node's ranks (a collective when there are several)."""
    t = torch.as_tensor(value, dtype=torch.float32).detach().reshape(1).cpu()
    if s.world.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=s.group)  # gloo has no AVG
        t /= s.world.world_size
    return float(t)


def evaluate(s: Session) -> float | None:
    """Held-out loss over train.eval_batches micro-batches from the start of the eval split (same every time)."""
    if s.data.eval is None:
        return None
    s.data.eval.reset()
    total = torch.zeros((), device=s.device)
    for _ in range(s.cfg.train.eval_batches):
        total += s.inner.eval_loss(*s.data.eval.next_batch(s.cfg.train.micro_batch_size)).float()
    return node_mean(total / s.cfg.train.eval_batches, s)


def save(s: Session) -> str | None:
    """A checkpoint of this step (once). The outer step in flight (diloco.overlap, fragment_delay) lands in the
    weights first; when it met a stop or drain in its waits instead, nothing of it landed, its round is saved unsent
    (as a synchronous round stopped in its waits is), and the reason is returned: the run ends with it."""
    interrupted = None
    try:
        s.outer.flush()
    except Stopped as e:
        interrupted = e.reason
    if s.ckpt.last_saved_step != s.progress.step:
        path, seconds = s.ckpt.save(s.progress.step, s.inner, s.data, s.progress, s.outer)
        s.telemetry.emit("checkpoint", step=s.progress.step, path=str(path), seconds=seconds)
    return interrupted


def follow_handoff(s: Session) -> None:
    """A joiner was handed the mesh's progress in outer.start: read data and follow the LR schedule from there,
    as if it had trained all along (the weights and outer state came with the hand-off)."""
    step = s.progress.step
    s.data.train.consumed = step * s.cfg.train.micro_batch_size * s.accum
    sched = s.inner.scheduler
    sched.last_epoch = step
    for group, base_lr, factor in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base_lr * factor(step)


def run(s: Session) -> str:
    """The training loop. Returns the run_end status."""
    status = begin(s)
    if status is not None:
        return status
    status, loss = train(s)
    return finish(s, status, loss)


def begin(s: Session) -> str | None:
    """Form or join the mesh (a joiner is handed the mesh's progress) and say so: None, or the run_end status of a
    process stopped before it trained anything."""
    before = s.progress.step
    try:
        s.outer.start(s.progress)
    except Stopped as e:  # stopped while waiting to form or join: nothing trained in this process yet
        return "completed" if e.reason == "ended" else e.reason
    s.training = True
    if s.progress.step != before:
        follow_handoff(s)
    compiled = getattr(s.inner, "compiled", None)  # torch.compile'd layers: the first step compiles them
    s.telemetry.emit("state", state="training", step=s.progress.step, **s.facts,
                     **({"compiling": True} if compiled is not None else {}))
    return None


@dataclass
class LogClock:
    """When the last step line was written, and at which step: tokens/s is the rate between two step lines."""
    at: float
    step: int

    def restart(self, step: int) -> None:
        self.at, self.step = time.monotonic(), step


def train(s: Session) -> tuple[str, torch.Tensor | None]:
    """Inner steps, each followed by what comes between two steps, until the run ends or this node leaves or
    stops: (the run_end status, the last step's loss)."""
    clock = LogClock(time.monotonic(), s.progress.step)
    loss = None
    while True:
        try:  # fragments: a run resumed at its last boundary syncs its other fragments here (outer steps)
            if s.outer.finished(s.progress, s.cfg.train.max_steps):
                return "completed", loss
        except Stopped as e:
            return e.reason, loss
        loss, grad_norm = inner_step(s)
        report_step(s, loss, grad_norm, clock)
        status = between_steps(s, loss, clock)
        if status is not None:
            return status, loss


def inner_step(s: Session) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step of the inner strategy (the first one compiles, where layers are compiled)."""
    progress = s.progress
    schedule_step = s.outer.step_for_schedule(progress)
    if schedule_step is not None:  # DiLoCo time rounds: the LR follows the run's round clock
        s.inner.schedule_at(schedule_step)
    compiled = getattr(s.inner, "compiled", None)
    if compiled is not None and compiled.pending:
        loss, grad_norm = first_compiled_step(s, compiled)
    else:
        loss, grad_norm = train_step(s.inner, s.data.train, s.cfg.train.micro_batch_size, s.accum)
    progress.step += 1
    progress.tokens += s.cfg.train.batch_size * s.cfg.data.seq_len
    return loss, grad_norm


def report_step(s: Session, loss: torch.Tensor, grad_norm: torch.Tensor, clock: LogClock) -> None:
    """At log steps (and the last): the node's mean loss, the LR and the rate as a step line; a NaN stops here."""
    cfg, progress = s.cfg, s.progress
    if not (progress.step % cfg.train.log_interval == 0 or progress.step == cfg.train.max_steps):
        return
    mean_loss = node_mean(loss, s)  # a device sync point: only at log steps
    now = time.monotonic()
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    rate = tokens_per_step * (progress.step - clock.step) / max(now - clock.at, 1e-9)
    s.telemetry.emit("step", step=progress.step, loss=finite_or_none(mean_loss), lr=s.inner.current_lr(),
                     tokens_per_s=rate, grad_norm=finite_or_none(float(grad_norm)), tokens=progress.tokens,
                     outer_step=progress.outer_step, epoch=s.data.train.epoch)
    clock.at, clock.step = now, progress.step
    if not math.isfinite(mean_loss):
        diverged(s, mean_loss)


def between_steps(s: Session, loss: torch.Tensor, clock: LogClock) -> str | None:
    """Signals, the outer step (at a boundary), evaluation and checkpoint after an inner step: None to go on, or the
    run_end status (drained, stopped, or the reason an outer step's wait was stopped)."""
    cfg, progress = s.cfg, s.progress
    stop, drain = s.signals.poll(s.world, s.group)
    if drain and not s.draining:
        s.draining = True
        s.telemetry.emit("state", state="draining")
        s.outer.request_drain()
    step = progress.step
    try:
        left = s.outer.after_inner_step(progress)
    except Stopped as e:  # a stop or drain inside the outer step's waits: this round is saved, not sent
        return e.reason
    if progress.step != step:  # re-joined mid-run (left out, or behind at a re-formation): a new position
        follow_handoff(s)
        # tokens/s counts the steps this node trained, not the ones handed over (50,000 tok/s for 5,000)
        clock.restart(progress.step)
    # after the outer step: at a DiLoCo boundary this evaluates the run's model, not this node's local drift
    # (with diloco.overlap or fragment_delay the mean is still in flight: the node's working weights)
    if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
        eval_loss = evaluate(s)
        if eval_loss is not None:
            s.telemetry.emit("eval", step=step, loss=finite_or_none(eval_loss))
    if left:
        return "drained"
    if stop:
        return "stopped"
    if cfg.ckpt.interval and progress.step % cfg.ckpt.interval == 0:
        check_finite(s, loss)
        return save(s)  # None, or the reason a stop interrupted the save's outer step
    return None


def finish(s: Session, status: str, loss: torch.Tensor | None) -> str:
    """Save the last checkpoint and export the run's model where this node holds it: the run_end status."""
    cfg = s.cfg
    check_finite(s, loss)
    interrupted = save(s)
    if interrupted and status == "completed":  # the last round's outer step was stopped: no agreed model to export
        status = interrupted
    # "ended" (in any wait above, an outer step in flight's too): the run completed while this node waited to
    # re-join it. It completed too, but its weights are not the run's final model
    behind = status == "ended"
    status = "completed" if behind else status
    if behind and cfg.ckpt.export_dir:
        s.telemetry.emit("warning", message=f"ckpt.export_dir: nothing exported to {cfg.ckpt.export_dir}: this node "
                         f"missed the run's last outer steps (export the model of a node that finished)")
    elif status == "completed" and cfg.ckpt.export_dir:
        path = export(s.inner, s.hf_config, s.data.tokenizer, cfg.ckpt.export_dir, s.world, s.group,
                      agreed=ends_agreed(cfg))
        if path != Path(cfg.ckpt.export_dir):
            s.telemetry.emit("warning", message=f"ckpt.export_dir: {cfg.ckpt.export_dir} holds another model (a node "
                             f"that did not end in this node's last outer step); this node's export is in {path}")
        s.telemetry.emit("export", step=s.progress.step, path=str(path))
    return status


def finite_or_none(value: float) -> float | None:
    """A figure for the JSON lines: JSON has no NaN or infinity, and a diverged step must still be reported."""
    return value if math.isfinite(value) else None


def diverged(s: Session, value: float) -> None:
    """The loss is NaN or infinite. Under DiLoCo this node's round is lost, not the run: its pseudo-gradient will not
    be counted and it takes the run's weights at the next outer step (engine/outer/diloco.py). Alone, the run stops
    here, and these weights are not saved over the last good checkpoint."""
    step = s.progress.step
    if s.outer.repairs_divergence:
        if s.diverged_round != s.progress.outer_step:  # once per round
            s.diverged_round = s.progress.outer_step
            s.telemetry.emit("warning", message=f"loss is {value} at step {step}: this node's round diverged; it is "
                                                f"not counted at the next outer step, where the node takes the "
                                                f"run's weights")
        return
    raise Diverged(f"loss is {value} at step {step}: the run diverged. Nothing was saved over the last good "
                   f"checkpoint; resume from it (--ckpt.resume=latest) with a lower optim.lr or a tighter "
                   f"optim.clip_norm")


def check_finite(s: Session, loss: torch.Tensor | None) -> None:
    """Before a checkpoint: the last step's loss is finite (weights that went NaN make it NaN), or diverged()."""
    if loss is None:  # no step ran in this process (a finished run resumed)
        return
    value = node_mean(loss, s)
    if not math.isfinite(value):
        diverged(s, value)


def save_before_failing(s: Session | None) -> None:
    """A failure after training started (the mesh gave up, a crash in the outer loop) keeps the trained steps:
    the model and data state are intact in memory, and a checkpoint mid-round resumes exactly. Not when the failure
    was this step's save: every rank of the node raised it at the same point, having agreed it failed
    (Checkpointer.save), so every rank skips this alike. Another try would write the same step again to the disk
    that just refused it; a try from the failing rank alone once paired its barrier with rank 0's and hung both."""
    if s is None or not s.training or s.ckpt.failed_step == s.progress.step:
        return
    try:
        save(s)
    except Exception as e:  # noqa: BLE001 - reported; the run is failing already and must still end cleanly
        print(f"error: checkpoint before exit failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        s.telemetry.emit("error", message=f"checkpoint before exit failed: {type(e).__name__}: {e}")


def close(s: Session, status: str) -> None:
    """Close the outer loop (with the run_end status) and stop the resource sampler."""
    try:
        s.outer.close(status)
    finally:
        if s.resources is not None:
            s.resources.stop()


def teardown(clean: bool) -> None:
    """Tear down in the order that avoids gloo's exit-time abort: collect what the session left (model and
    optimizer, once the caller dropped its references), barrier, destroy the process group."""
    gc.collect()
    if dist.is_initialized():
        if clean and dist.get_world_size() > 1:
            dist.barrier()  # only when every rank is healthy: after a failure a peer may never arrive
        dist.destroy_process_group()
