"""Headless training on one host: `python -m engine.train CONFIG.toml [--section.key=value ...]`.

    python -m engine.train configs/debug.toml                                  # one process, CPU or one GPU
    torchrun --nproc_per_node=2 -m engine.train configs/debug.toml --optim.lr=1e-3 --data.path=corpus/
    python -m engine.train configs/150m.toml --ckpt.resume=latest              # continue a run

The story: read the world and the config; check what needs no process group (the batch arithmetic of this node's
workers, the folders to write, the data, the checkpoint to resume), so that a bad input is one line and changes
nothing; build model, inner (DDP/FSDP2/ZeRO), outer (none or DiLoCo) and the checkpointer; restore a checkpoint
if asked; run inner steps until max_steps, a stop signal, or a drain; save, export, and shut down cleanly.

Telemetry: JSON events on stdout (local rank 0, or every rank with telemetry.all_ranks), a human line per event
on stderr, and TensorBoard / offline W&B scalars when telemetry.tensorboard_dir / telemetry.wandb ask for them
(engine/metrics.py). Signals: SIGUSR1 or the appearance of mesh.drain_file -> drain (the outer loop decides when
to stop); SIGTERM/SIGINT -> stop after the current step, checkpoint, run_end "stopped". All ranks of the node agree
on a stop or drain through a tiny all-reduce after every step, so they leave the loop at the same step. Inside the
outer loop's waits (the mesh, the collectives) the outer loop polls Signals.requested(): a stop ends the wait
within a poll (checkpoint, run_end "stopped", exit 0); a drain ends it only where the node has nothing to
contribute (a join), and otherwise lets the round commit and leaves right after it (run_end "drained").

Exit codes: 0 completed, drained or stopped; 2 bad input (one `error: ...` line on stderr for the node, and no
closing lines after it; a bad config or command line is that line alone; plus an "error" event); 1 crash or mesh
failure ("error" event, run_end "failed"; a traceback on stderr for a crash, one line for a mesh failure). A
failure after training started saves a checkpoint first: no trained step is lost.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from engine.checkpoint import Checkpointer, export
from engine.config import Config, digest, grad_accum_steps, load_config
from engine.data import Data, TokenStream, build_data, dataset_name
from engine.mesh.protocol import MeshError, Stopped
from engine.model import build_model, count_params, model_config
from engine.outer import Diverged, Outer, Progress, build_outer
from engine.inner.ddp_fsdp import build_inner, setup_distributed
from engine.inner.optim import lr_factor
from engine.resources import ResourceMonitor
from engine.telemetry import Telemetry, format_human
from engine.world import World, read_world

__all__ = ["Progress", "main", "cli", "train_step"]


class Signals:
    """Flags set by signal handlers (or the drain file) and agreed on by all ranks of the node."""

    def __init__(self, drain_file: str | None):
        self.drain_file = drain_file
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
        if self.drain or (self.drain_file and os.path.exists(self.drain_file)):
            return "drained"
        return None

    def poll(self, world: World, group) -> tuple[bool, bool]:
        """(stop, drain), the same on every rank. A collective when the node has several ranks."""
        # one rank looks at the file (it may sit on a network filesystem); the MAX below tells the others
        drain = self.drain or bool(self.drain_file and world.rank == 0 and os.path.exists(self.drain_file))
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


def human_line(event: dict) -> None:
    """The progress line on stderr; errors are left out because main() prints them as one `error: ...` line."""
    text = format_human(event) if event["type"] != "error" else None
    if text is not None:
        print(text, file=sys.stderr, flush=True)


def warning_line(event: dict) -> None:
    """ZERO_BAND_LOG_LEVEL=WARNING: only warnings reach stderr as progress lines."""
    if event["type"] == "warning":
        human_line(event)


def events_out(cfg: Config | None, node: str, rank: int, speaks: bool) -> TextIO | None:
    """Where the JSON events go: stdout (the console's contract: it reads stdout redirected to a file), unless
    stdout is a terminal, where a person wants the readable lines only: then into RUN_DIR/events-NODE.jsonl, said
    once on stderr (before a config is read there is no run folder: the events of a bad command line go nowhere)."""
    if not sys.stdout.isatty() or not speaks:
        return None
    if cfg is None:
        return open(os.devnull, "w")
    path = Path(cfg.run.dir) / f"events-{node}{f'-{rank}' if rank else ''}.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = open(path, "a", buffering=1)
    except OSError:
        return None  # an unwritable run folder is reported later, once; the events stay on stdout meanwhile
    print(f"[{node}:{rank}] JSON events -> {path} (stdout is a terminal; pipe stdout to get them there)",
          file=sys.stderr, flush=True)
    return out


def make_telemetry(cfg: Config | None, world: World) -> Telemetry:
    node = (cfg.mesh.node_id if cfg is not None else None) or world.default_node_id()
    speaks = world.rank == 0 or (cfg is not None and cfg.telemetry.all_ranks)
    human = cfg is None or cfg.telemetry.human
    # ZERO_BAND_LOG_LEVEL: DEBUG and INFO print every progress line, WARNING only warnings, ERROR none (main()
    # prints the one `error:` line whatever the level); the JSON events on stdout are never filtered
    line = {"WARNING": warning_line, "ERROR": None}.get(world.log_level, human_line)
    human_sinks: list = [line] if human and line else []
    sinks: list = []
    notes: list[str] = []
    if cfg is not None and speaks and (cfg.telemetry.tensorboard_dir or cfg.telemetry.wandb):
        from engine.metrics import metric_sinks  # imports torch's tensorboard writer only when asked for
        sinks += metric_sinks(cfg.telemetry, run_dir=cfg.run.dir, run_name=cfg.run.name, node=node,
                              rank=world.rank, all_ranks=cfg.telemetry.all_ranks, warn=notes.append)
    telemetry = Telemetry(node, world.rank, enabled=speaks, extra_sinks=sinks, human_sinks=human_sinks,
                          json_out=events_out(cfg, node, world.rank, speaks))
    for note in notes:
        telemetry.emit("warning", message=note)
    return telemetry


@dataclass
class Inputs:
    """What read_inputs() read and checked: the same on every rank of the node, and nothing written yet."""
    data: Data
    hf_config: Any
    ckpt: Checkpointer
    resume_from: Path | None


class SameOnEveryRank(ValueError):
    """Bad input found by checks that every rank of the node runs alike, on the same inputs: local rank 0 alone
    reports it (main). Not so for the device and rendezvous of setup_distributed or a rank's own checkpoint file."""


@contextlib.contextmanager
def same_on_every_rank():
    try:
        yield
    except SameOnEveryRank:
        raise
    except ValueError as e:
        raise SameOnEveryRank(str(e)) from None


def read_inputs(cfg: Config, world: World, telemetry: Telemetry) -> Inputs:
    """The data, the model's shape and the checkpoint to resume, read and checked before this rank does anything of
    its own (no process group, no device, nothing written)."""
    telemetry.emit("state", state="starting")
    with same_on_every_rank():
        data = build_data(cfg.data, world, cfg.train.seed)
        hf_config = model_config(cfg.model, data.vocab_size, cfg.data.seq_len)
        ckpt = Checkpointer(cfg.ckpt, cfg.run.dir, world, digest(cfg), cfg.inner.strategy,
                            max_steps=cfg.train.max_steps)
        resume_from = ckpt.plan_start()  # before the expensive part: refuse bad folders early
    for note in data.notes:
        telemetry.emit("warning", message=note)
    return Inputs(data, hf_config, ckpt, resume_from)


def build(cfg: Config, world: World, telemetry: Telemetry, inputs: Inputs) -> Session:
    data, ckpt = inputs.data, inputs.ckpt
    device, group = setup_distributed(cfg.inner, world)
    ckpt.device, ckpt.group = device, group
    with same_on_every_rank():  # the strategies' rules (offload, precision, overlap) on the same config and device
        model = build_model(cfg.model, data.vocab_size, cfg.data.seq_len, device, seed=cfg.train.seed)
        params = count_params(model)  # before sharding: ZeRO-3 empties the partitioned tensors
        inner = build_inner(model, cfg.inner, cfg.train, cfg.optim, world, device)
        outer = build_outer(cfg, world, inner, telemetry, local_group=group)
    ckpt.move_older_run_aside()  # only now that every input was accepted: a bad one leaves the folder as it was
    if ckpt.archived is not None:
        telemetry.emit("warning", message=f"ckpt.dir: an older run's checkpoints moved to {ckpt.archived}")
    signals = Signals(cfg.mesh.drain_file)
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


def schedule_note(cfg: Config, meta: dict[str, Any]) -> str | None:
    """A resume under another train.max_steps than the checkpoint's run moves the LR schedule under the steps to
    come (a raised max_steps takes a cosine back up): say so, once."""
    before, step = meta.get("max_steps"), int(meta.get("step", 0))
    if before is None or before == cfg.train.max_steps or cfg.optim.schedule == "constant":
        return None
    was, now = (cfg.optim.lr * lr_factor(step, cfg.optim, n) for n in (before, cfg.train.max_steps))
    how = "stretched" if cfg.train.max_steps > before else "shortened"
    return (f"train.max_steps is {cfg.train.max_steps}, the checkpoint's run had {before}: the {cfg.optim.schedule} "
            f"LR schedule is {how} to {cfg.train.max_steps} steps (lr at step {step}: {now:.2e}, was {was:.2e})")


def train_step(inner, stream: TokenStream, micro_batch_size: int, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `accum` micro-batches: (mean micro-batch loss, grad norm), both on device."""
    losses = []
    for i in range(accum):
        input_ids, labels = stream.next_batch(micro_batch_size)
        losses.append(inner.micro_step(input_ids, labels, last=i == accum - 1))
    grad_norm = inner.optimizer_step()
    return torch.stack(losses).mean(), grad_norm


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


def save(s: Session) -> None:
    s.outer.flush()  # diloco.overlap: the outer update in flight lands in the weights before they are saved
    if s.ckpt.last_saved_step == s.progress.step:
        return
    path, seconds = s.ckpt.save(s.progress.step, s.inner, s.data, s.progress, s.outer)
    s.telemetry.emit("checkpoint", step=s.progress.step, path=str(path), seconds=seconds)


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
    cfg, progress = s.cfg, s.progress
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    before = progress.step
    try:
        s.outer.start(progress)
    except Stopped as e:  # stopped while waiting to form or join: nothing trained in this process yet
        return e.reason
    s.training = True
    if progress.step != before:
        follow_handoff(s)
    s.telemetry.emit("state", state="training", step=progress.step, **s.facts)
    status, last_log, last_log_step = "completed", time.monotonic(), progress.step
    loss = None
    while not s.outer.finished(progress, cfg.train.max_steps):
        schedule_step = s.outer.step_for_schedule(progress)
        if schedule_step is not None:  # DiLoCo time rounds: the LR follows the run's round clock
            s.inner.schedule_at(schedule_step)
        loss, grad_norm = train_step(s.inner, s.data.train, cfg.train.micro_batch_size, s.accum)
        progress.step += 1
        progress.tokens += tokens_per_step
        if progress.step % cfg.train.log_interval == 0 or progress.step == cfg.train.max_steps:
            mean_loss = node_mean(loss, s)  # a device sync point: only at log steps
            now = time.monotonic()
            rate = tokens_per_step * (progress.step - last_log_step) / max(now - last_log, 1e-9)
            s.telemetry.emit("step", step=progress.step, loss=finite_or_none(mean_loss), lr=s.inner.current_lr(),
                             tokens_per_s=rate, grad_norm=finite_or_none(float(grad_norm)), tokens=progress.tokens,
                             outer_step=progress.outer_step, epoch=s.data.train.epoch)
            last_log, last_log_step = now, progress.step
            if not math.isfinite(mean_loss):
                diverged(s, mean_loss)
        stop, drain = s.signals.poll(s.world, s.group)
        if drain and not s.draining:
            s.draining = True
            s.telemetry.emit("state", state="draining")
            s.outer.request_drain()
        step = progress.step
        try:
            left = s.outer.after_inner_step(progress)
        except Stopped as e:  # a stop or drain inside the outer step's waits: this round is saved, not sent
            status = e.reason
            break
        if progress.step != step:  # re-joined mid-run (left out, or behind at a re-formation): a new position
            follow_handoff(s)
        # after the outer step: at a DiLoCo boundary this evaluates the run's model, not this node's local drift
        # (with diloco.overlap or fragment_delay the mean is still in flight: the node's working weights)
        if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
            eval_loss = evaluate(s)
            if eval_loss is not None:
                s.telemetry.emit("eval", step=step, loss=finite_or_none(eval_loss))
        if left:
            status = "drained"
            break
        if stop:
            status = "stopped"
            break
        if cfg.ckpt.interval and progress.step % cfg.ckpt.interval == 0:
            check_finite(s, loss)
            save(s)
    check_finite(s, loss)
    save(s)
    if status == "completed" and cfg.ckpt.export_dir:
        path = export(s.inner, s.hf_config, s.data.tokenizer, cfg.ckpt.export_dir, s.world, s.group)
        s.telemetry.emit("export", step=progress.step, path=str(path))
    return status


def finite_or_none(value: float) -> float | None:
    """A figure for the JSON lines: JSON has no NaN or infinity, and a diverged step must still be reported."""
    return value if math.isfinite(value) else None


def diverged(s: Session, value: float) -> None:
    """The loss is NaN or infinite. Under DiLoCo this node's round is lost, not the run: its pseudo-gradient will not
    be counted and it takes the run's weights at the next outer step (engine/outer/diloco.py). Alone, the run stops here,
    and these weights are not saved over the last good checkpoint."""
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
    the model and data state are intact in memory, and a checkpoint mid-round resumes exactly."""
    if s is None or not s.training:
        return
    try:
        save(s)
    except Exception as e:  # noqa: BLE001 - reported; the run is failing already and must still end cleanly
        print(f"error: checkpoint before exit failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        s.telemetry.emit("error", message=f"checkpoint before exit failed: {type(e).__name__}: {e}")


USAGE = "usage: python -m engine.train CONFIG.toml [--section.key=value ...]"
# a rank other than 0 whose error every rank shares waits this long at most for torchrun to end it (leave_quietly)
REPORT_GRACE_S = 30.0


def usage() -> str:
    """--help: the usage line, this module's examples, and where the keys are."""
    examples = __doc__.split("\n\n")[1]
    return (f"{USAGE}\n\n{examples}\n\nsections: {', '.join(Config.model_fields)} (engine/config.py lists every key, "
            f"configs/*.toml set them)\nexit codes: 0 completed, drained or stopped; 2 bad input; 1 crash or mesh "
            f"failure")


def split_args(argv: list[str]) -> tuple[str, list[str]]:
    if not argv or argv[0].startswith("--"):
        raise ValueError(USAGE)
    return argv[0], argv[1:]


def preflight(cfg: Config, world: World, source: str) -> None:
    """What the config alone cannot check, before anything is read or written: the batch arithmetic of this node's
    worker count, and the folders the run will write into (a /proc path trained, then failed at the first
    checkpoint with four tracebacks)."""
    grad_accum_steps(cfg.train, world.world_size, source=source)
    check_writable(Path(cfg.run.dir), "run.dir")
    if cfg.ckpt.dir:
        check_writable(Path(cfg.ckpt.dir), "ckpt.dir")
    if cfg.ckpt.export_dir:
        check_writable(Path(cfg.ckpt.export_dir).parent, "ckpt.export_dir")


def check_writable(folder: Path, key: str) -> None:
    """`folder` takes new files, or can be created. Probed by writing (and removing what was written), since
    os.access() passes root everywhere, /proc included."""
    existing = folder
    while not existing.exists() and existing != existing.parent:  # the nearest part of the path that exists
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{key}: {folder}: {existing} is a file, not a folder")
    try:
        if existing == folder:
            tempfile.TemporaryFile(dir=folder).close()
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as e:
        doing = "cannot write into it" if existing == folder else f"cannot create a folder in {existing}"
        raise ValueError(f"{key}: {folder}: {doing} ({e.strerror or e})") from None


def leave_quietly() -> None:
    """A rank other than 0 with the error every rank of the node found: local rank 0 reports it, once. This rank
    must not exit first, though: torchrun stops the other workers as soon as one exits, and rank 0, stopped before
    it printed, would leave the run without its error line. torchrun's SIGTERM (or REPORT_GRACE_S) ends the wait."""
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # taken by sigtimedwait below, not by the default handler
    try:
        signal.sigtimedwait(stops, REPORT_GRACE_S)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


def main(argv: list[str] | None = None) -> int:
    """Run one training process; returns the exit code (0 completed/drained/stopped, 2 bad input, 1 crash).
    argv defaults to the process's command line; the process itself ends through cli()'s exit path."""
    if argv is None:
        argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        print(usage())
        return 0
    try:
        world = read_world()
    except ValueError as e:  # a bad RANK or WORLD_SIZE: one line, as for any bad input (no traceback)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    telemetry = make_telemetry(None, world)
    session: Session | None = None
    status, code = "failed", 1
    try:
        with same_on_every_rank():
            config_path, overrides = split_args(argv)
            cfg = load_config(config_path, overrides, environ=world.env)
            preflight(cfg, world, config_path)
        telemetry = make_telemetry(cfg, world)
        telemetry.emit("run_start", pid=world.pid, host=world.hostname, world_size=world.world_size,
                       config_digest=digest(cfg), strategy=cfg.inner.strategy, max_steps=cfg.train.max_steps,
                       run=cfg.run.name, diloco=cfg.diloco.enabled, dataset=dataset_name(cfg.data))
        inputs = read_inputs(cfg, world, telemetry)
        session = build(cfg, world, telemetry, inputs)
        status = run(session)
        code = 0
    except Diverged as e:  # NaN or inf without DiLoCo: one line, and nothing saved over the last good checkpoint
        print(f"error: {e}", file=sys.stderr, flush=True)
        telemetry.emit("error", message=str(e))
    except ValueError as e:  # bad input: config, files, data, checkpoint
        code = 2
        if isinstance(e, SameOnEveryRank) and world.rank > 0:  # one line for the node, from local rank 0
            leave_quietly()
        else:
            print(f"error: {e}", file=sys.stderr, flush=True)
        telemetry.emit("error", message=str(e))
    except MeshError as e:  # the mesh said no: bad input before training (store, id, digest), a failure after
        code = 1 if session is not None and session.training else 2
        print(f"error: {e}", file=sys.stderr, flush=True)
        telemetry.emit("error", message=str(e))
        save_before_failing(session)
    except Exception as e:  # noqa: BLE001 - a crash: report it as an event too, then exit 1
        traceback.print_exc()
        telemetry.emit("error", message=f"{type(e).__name__}: {e}")
        save_before_failing(session)
    finally:
        telemetry.human = code != 2  # after bad input the `error:` line says it all; the JSON lines still close
        shutdown(session, telemetry, status, clean=code == 0)
    return code


def shutdown(session: Session | None, telemetry: Telemetry, status: str, clean: bool) -> None:
    """Close the outer loop, report, then tear down in the order that avoids gloo's exit-time abort:
    drop model/optimizer references, collect, barrier, destroy the process group, flush."""
    step = session.progress.step if session else 0
    if session is not None:
        try:
            session.outer.close(status)
        finally:
            if session.resources is not None:
                session.resources.stop()
    telemetry.emit("state", state="left")
    telemetry.emit("run_end", status=status, step=step)
    if session is not None:
        session.inner = session.outer = None
        del session
    gc.collect()
    if dist.is_initialized():
        if clean and dist.get_world_size() > 1:
            dist.barrier()  # only when every rank is healthy: after a failure a peer may never arrive
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def cli() -> None:
    """Entry point: exit without running C++ static destructors, where gloo's exit-time abort lives
    (torch 2.13: ~1 run in 5 aborted with "terminate called without an active exception").
    The ~360k objects that importing torch and transformers made are frozen first: they live as long as the process,
    and every full collection walked them (1-2 s of each short run on a VM whose page walks are slow)."""
    gc.freeze()
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
