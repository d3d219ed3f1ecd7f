"""Headless training on one host: `python -m engine.train CONFIG.toml [--section.key=value ...]`.

    python -m engine.train configs/debug.toml                                  # one process, CPU or one GPU
    torchrun --nproc_per_node=2 -m engine.train configs/debug.toml --optim.lr=1e-3 --data.path=corpus/
    python -m engine.train configs/150m.toml --ckpt.resume=latest              # continue a run
    python -m engine.train configs/1b.toml --dry-run --train.micro_batch_size=4   # the memory estimate, no run

The story: read the world and the config; check what needs no process group (the batch arithmetic of this node's
workers, the folders to write, the data, the checkpoint to resume), so that a bad input is one line and changes
nothing; build model, inner (DDP/FSDP2/ZeRO), outer (none or DiLoCo) and the checkpointer; restore a checkpoint
if asked; run inner steps until max_steps, a stop signal, or a drain; save, export, and shut down cleanly. This
module is the story's first half, the command line, the config and the run's folders, and imports no torch: a bad
input there is reported in a fraction of a second. The rest (engine/session.py) imports torch, transformers and the
strategies, about 6 s of a process start on a loaded CPU, once the config passed.

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
failure after training started saves a checkpoint first: no trained step is lost. Under torchrun the node's line
comes first, from local rank 0; torchrun then closes with its own ChildFailedError summary (a traceback of
torchrun's frames, exit 1) for any worker that exits non-zero, which no worker can prevent: the summary's root
cause is the engine's line (tell_torchrun), not a link to torch's docs.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TextIO

from engine.config import Config, grad_accum_steps, load_config

from engine.digests import digest
from engine.errors import CheckpointFailed, SameOnEveryRank, first_line, same_on_every_rank
from engine.mesh.protocol import MeshError
from engine.outer.build import Diverged
from engine.outer.schedule import Schedule
from engine.telemetry import Telemetry, format_human
from engine.world import World, read_world

if TYPE_CHECKING:
    from engine.session import Session

__all__ = ["main", "cli"]


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


def check_node_setup(cfg: Config, world: World, source: str) -> None:
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


def main(argv: list[str] | None = None, *, freeze: bool = False) -> int:
    """Run one training process; returns the exit code (0 completed/drained/stopped, 2 bad input, 1 crash).
    argv defaults to the process's command line; the process itself ends through cli()'s exit path. The command
    line and the config are checked before torch is imported (engine/session.py): a bad one is reported in a
    fraction of a second. freeze: gc.freeze() the objects those imports made (cli())."""
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
    if "--dry-run" in argv:
        return dry_run([a for a in argv if a != "--dry-run"], world)
    telemetry = make_telemetry(None, world)
    training: ModuleType | None = None  # engine.session, once the config passed
    session: Session | None = None
    status, code = "failed", 1
    reason: str | None = None  # why this process fails, for torchrun's summary (tell_torchrun)
    try:
        with same_on_every_rank():
            config_path, overrides = split_args(argv)
            cfg = load_config(config_path, overrides, environ=world.env)
            check_node_setup(cfg, world, config_path)
        telemetry = make_telemetry(cfg, world)
        training = import_session()  # torch, transformers and the strategies: seconds of imports
        if freeze:
            gc.freeze()
        telemetry.emit("run_start", pid=world.pid, host=world.hostname, world_size=world.world_size,
                       config_digest=digest(cfg), strategy=cfg.inner.strategy, max_steps=cfg.train.max_steps,
                       run=cfg.run.name, diloco=cfg.diloco.enabled, dataset=training.dataset_name(cfg.data),
                       **time_rounds(cfg))
        inputs = training.read_inputs(cfg, world, telemetry)
        session = training.build(cfg, world, telemetry, inputs)
        status = training.run(session)
        code = 0
    except Diverged as e:  # NaN or inf without DiLoCo: one line, and nothing saved over the last good checkpoint
        reason = error_line(e)
        telemetry.emit("error", message=str(e))
    except ValueError as e:  # bad input: config, files, data, checkpoint
        code = 2
        if isinstance(e, SameOnEveryRank) and world.rank > 0:  # one line for the node, from local rank 0
            reason = REPORTED_BY_RANK_0
            leave_quietly()
        else:
            reason = error_line(e)
        telemetry.emit("error", message=str(e))
    except CheckpointFailed as e:  # every rank agreed its save failed: one line (rank 0's says which rank and why)
        reason = error_line(e) if world.rank == 0 else REPORTED_BY_RANK_0
        telemetry.emit("error", message=str(e))
    except MeshError as e:  # the mesh said no: bad input before training (store, id, digest), a failure after
        code = 1 if session is not None and session.training else 2
        if world.rank == 0 or not getattr(e, "node_wide", False):  # every local rank has a node-wide one: once
            reason = error_line(e)
        else:
            reason = REPORTED_BY_RANK_0
        telemetry.emit("error", message=str(e))
        if session is not None:
            training.save_before_failing(session)
    except Exception as e:  # noqa: BLE001 - a crash: report it as an event too, then exit 1
        traceback.print_exc()
        reason = traceback.format_exc()
        telemetry.emit("error", message=f"{type(e).__name__}: {e}")
        if session is not None:
            training.save_before_failing(session)
    finally:
        if code != 0:
            tell_torchrun(world, reason)
        telemetry.human = code != 2  # after bad input the `error:` line says it all; the JSON lines still close
        shutdown(session, telemetry, status, clean=code == 0, training=training)
    return code


def dry_run(argv: list[str], world: World) -> int:
    """--dry-run: the memory estimate of this process (engine/memory.py) for the config and this node's workers
    (torchrun's WORLD_SIZE, as a real start reads it), printed as a table ending in `per GPU: N GiB ...`; nothing is
    imported of torch, no process group or store is made, nothing is written. 2 on bad input, as a start."""
    from engine.memory import estimate
    try:
        config_path, overrides = split_args(argv)
        cfg = load_config(config_path, overrides, environ=world.env)
        grad_accum_steps(cfg.train, world.world_size, source=config_path)
        est = estimate(cfg, workers=world.world_size, device=dry_run_device(cfg.inner.device))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print("\n".join(est.lines()), flush=True)
    return 0


def dry_run_device(device: str) -> str:
    """inner.device for the estimate without importing torch: auto is cuda where the NVIDIA driver is loaded."""
    if device == "auto":
        return "cuda" if os.path.exists("/proc/driver/nvidia/version") else "cpu"
    return device


# what a rank that leaves its node's error to local rank 0 tells torchrun's summary
REPORTED_BY_RANK_0 = "the same error as local rank 0, which reports it once for the node"


def error_line(err: BaseException) -> str:
    """The one `error: ...` line on stderr; returns its text."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    return str(err)


def tell_torchrun(world: World, reason: str | None) -> None:
    """Under torchrun, write why this worker failed into its error file (TORCHELASTIC_ERROR_FILE, the file torch's
    @record writes), so that torchrun's closing summary names the engine's reason where it said "To enable traceback
    see: <link>", which sent a person after a traceback that a bad input does not have. torchrun itself still ends
    with that summary, as a traceback of its own, and exit code 1, whatever its workers do: its launcher raises
    ChildFailedError for any worker that exits non-zero, and nothing a worker does changes that."""
    if not world.error_file or not reason:
        return
    data = {"message": {"message": reason.strip().splitlines()[-1],
                        "extraInfo": {"py_callstack": reason.rstrip("\n"), "timestamp": str(int(time.time()))}}}
    try:
        Path(world.error_file).write_text(json.dumps(data))
    except OSError:
        pass  # torchrun's summary falls back to its own words; the error line above has said it all


def time_rounds(cfg: Config) -> dict[str, int]:
    """run_start's `rounds`: with time rounds the run lasts that many outer steps, each node taking its own count of
    steps (a fast node's passes max_steps), so the console follows the outer steps for the run's progress."""
    schedule = Schedule(cfg.diloco)
    if not (schedule.enabled and schedule.timed):
        return {}
    return {"rounds": schedule.rounds(cfg.train.max_steps)}


def import_session() -> ModuleType:
    """engine.session, which imports torch, transformers and the strategies. A library this host's Python cannot
    import (missing, or a version without what the engine uses) is bad input of the host: one line naming it and
    the interpreter, exit 2, from local rank 0 only. A failed import inside the engine's own modules is a bug, and
    stays a traceback."""
    try:
        from engine import session
    except ImportError as e:
        name = e.name or ""
        if name == "engine" or name.startswith("engine."):
            raise
        raise SameOnEveryRank(f"this host's Python ({sys.executable}) cannot import {name or 'a library'}: "
                              f"{first_line(e, 200)}. Install the engine's environment there: scripts/setup.sh, "
                              f"or `zeroband-console PROFILE sync`") from None
    return session


def shutdown(session: Session | None, telemetry: Telemetry, status: str, clean: bool,
             training: ModuleType | None) -> None:
    """Close the outer loop, report, then tear down in the order that avoids gloo's exit-time abort: drop
    model/optimizer references, collect, barrier, destroy the process group (none before the session's imports)."""
    step = session.progress.step if session else 0
    if session is not None:
        training.close(session, status)
    telemetry.emit("state", state="left")
    telemetry.emit("run_end", status=status, step=step)
    if session is not None:
        session.inner = session.outer = None
        del session
    if training is not None:
        training.teardown(clean)
    sys.stdout.flush()
    sys.stderr.flush()


def cli() -> None:
    """Entry point: exit without running C++ static destructors, where gloo's exit-time abort lives
    (torch 2.13: ~1 run in 5 aborted with "terminate called without an active exception").
    The ~360k objects that importing torch and transformers made are frozen once imported: they live as long as the
    process, and every full collection walked them (1-2 s of each short run on a VM whose page walks are slow)."""
    code = main(sys.argv[1:], freeze=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
