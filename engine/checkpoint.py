"""Checkpoints (torch.distributed.checkpoint), the `latest` pointer, keep-last-K, and transformers export.

Layout of ckpt.dir (default <run.dir>/checkpoints; one node's, whose ranks write it together):

    step-00000100/          one complete checkpoint
        .metadata, *.distcp   model + optimizer (DCP: each rank writes its own shards)
        rank-0.pt ...         per-rank state: scheduler, scaler, data position, RNG, Progress, outer state
        owner                 "HOST PID" of the rank 0 that wrote it (what tells a stale .tmp folder from a live one)
        meta.json             step, world size, strategy, config digest, data position; written last
    latest                  the name of the newest complete checkpoint

Commit protocol: every rank writes into `.step-N.tmp/`; when all of them say they succeeded, rank 0 writes
meta.json, renames the folder to `step-N/` and only then replaces `latest` (write `latest.tmp`, fsync, rename) and
prunes. Each phase ends in an agreement of the node's ranks (an all-gather of each one's error), not a bare
barrier: a rank that fails (a full disk, a DCP write error) makes every rank raise CheckpointFailed at the same
point, the partial folder is removed and nothing of it is committed. A crash at any point leaves `latest` naming
the previous complete checkpoint (or, between the rename and the pointer, a complete step-N that a resume of
`latest` takes); the first save of a process removes every `.step-*.tmp` left by a crash, but not one that a live
process of this host is writing.

Nothing is overwritten and nothing is deleted: a fresh run (no ckpt.resume) that finds an older run's checkpoints
in ckpt.dir moves that folder to `<its parent>/_archive/<time>/` first (as the console archives a node's folder),
a save refuses an existing step folder, and export refuses a non-empty export_dir. The move comes last in start-up
(plan_start() checks, engine.session.build moves once everything else is built): a bad input leaves the folder as it
was.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import os
import random
import shutil
import sys
import time
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from engine.config import CkptConfig
from engine.errors import CheckpointFailed
from engine.toml_text import toml_value
from engine.world import World

POINTER = "latest"
OWNER = "owner"
ARCHIVE = "_archive"  # an older run's checkpoints, moved aside by a fresh run
META = "meta.json"
EXTRA_KEYS = {"scheduler", "scaler", "data", "progress", "rng", "outer"}


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _step_of(folder: Path) -> int:
    """The step of a step-N folder's name (-1 for another name: older than any)."""
    digits = folder.name[5:]
    return int(digits) if folder.name.startswith("step-") and digits.isdigit() else -1


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


DCP_INDEX = ".metadata"  # what dcp.save writes beside the shards; dcp.load reads it first
FULL_DISK_BYTES = 16 * 2**20  # less free than this where a save failed: say the disk is full


def _reason(e: BaseException) -> str:
    """The underlying error in one short line (DCP wraps each rank's exception with its traceback)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:200]}"


class Checkpointer:
    """`device` and `group` may be given later (before load/save): plan_start() needs neither, so that a bad folder
    is refused before the process group exists."""

    def __init__(self, cfg: CkptConfig, run_dir: str, world: World, config_digest: str, strategy: str,
                 device: torch.device | None = None, group: dist.ProcessGroup | None = None,
                 max_steps: int | None = None, settings: dict[str, Any] | None = None):
        self.cfg, self.world, self.digest, self.strategy = cfg, world, config_digest, strategy
        self.settings = settings  # what the digest covers, flat: a refused resume names the settings that differ
        self.device, self.group = device, group
        self.max_steps = max_steps  # train.max_steps, kept in meta.json: a resume can tell the schedule changed
        self.dir = Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"
        self.last_saved_step: int | None = None
        self.older_run = False  # plan_start found an older run's checkpoints where a fresh run starts
        self.resume_meta: dict[str, Any] | None = None  # meta.json of the checkpoint plan_start chose
        self.archived: Path | None = None  # where check_start moved an older run's checkpoints (for a warning)
        self.notes: list[str] = []  # plan_start's warnings (a resume that took a newer folder than `latest`)
        self.failed_step: int | None = None  # the step whose save every rank agreed had failed
        self.swept = False  # the first save removed the .step-*.tmp folders that crashed processes left

    # ------------------------------------------------------------------------------------------ checks
    def steps_on_disk(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name[5:]) for p in self.dir.glob("step-*") if p.is_dir() and p.name[5:].isdigit())

    def check_start(self) -> Path | None:
        """Before any work: the checkpoint to resume from (or None), refusing to mix two runs in one folder; a fresh
        run moves an older run's checkpoints aside. plan_start(), then move_older_run_aside()."""
        path = self.plan_start()
        self.move_older_run_aside()
        return path

    def plan_start(self) -> Path | None:
        """The checks of check_start, changing nothing on disk: the checkpoint to resume from, or None for a fresh
        start (then older_run says whether move_older_run_aside() has something to move)."""
        if self.cfg.export_dir:
            export = Path(self.cfg.export_dir)
            if export.exists() and (not export.is_dir() or any(export.iterdir())):
                raise ValueError(f"ckpt.export_dir: {export} exists and is not empty (refusing to overwrite)")
        on_disk = self.steps_on_disk()
        resume = self.cfg.resume
        if resume == "auto":  # continue this folder's run if it has one, else start fresh (console launches)
            resume = "latest" if (self.dir / POINTER).is_file() or self._newest_complete() else None
        if not resume:
            self.older_run = bool(on_disk) or (self.dir / POINTER).exists()
            return None
        path = self.resolve(resume)
        self.resume_meta = self.read_meta(path)
        step = self.resume_meta["step"]
        if path.parent.resolve() != self.dir.resolve() and (on_disk or (self.dir / POINTER).exists()):
            raise ValueError(f"ckpt.dir: {self.dir} already holds checkpoints of another run (resuming from "
                             f"{path}); choose another ckpt.dir")
        later = [s for s in on_disk if s > step]
        if later:
            raise ValueError(f"ckpt.resume: {path} is older than {self.dir / _step_name(later[-1])}; resuming "
                             f"there would overwrite newer checkpoints (use another ckpt.dir)")
        return path

    def move_older_run_aside(self) -> None:
        """A fresh start where plan_start found an older run: its checkpoints go to _archive/ (collective)."""
        if self.older_run:
            self.archived = self._move_aside()
            self.older_run = False

    def _move_aside(self) -> Path:
        """A fresh run where an older one left checkpoints: move them to <parent>/_archive/<time>/<name> (rank 0,
        between barriers: every rank has looked at the folder before it moves, and none goes on before it has)."""
        self._barrier()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.dir.parent / ARCHIVE / stamp / self.dir.name
        if self.world.rank == 0:
            for n in range(1, 1000):  # two fresh runs in one second: a second folder, never a merge
                if not target.exists():
                    break
                target = self.dir.parent / ARCHIVE / f"{stamp}-{n}" / self.dir.name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.dir, target)
        self._barrier()
        return target

    def resolve(self, resume: str) -> Path:
        """The folder that ckpt.resume names. `latest` is the pointer's folder, or a complete step folder newer
        than it: a save that crashed after its rename and before the pointer's update is whole (meta.json was
        written before the rename), and resuming anywhere older would be refused as overwriting it."""
        if resume != "latest":
            return self._named(resume)
        pointer = self.dir / POINTER
        named = self.dir / pointer.read_text().strip() if pointer.is_file() else None
        newest = self._newest_complete()
        if newest is not None and (named is None or _step_of(named) < _step_of(newest)):
            said = f"{POINTER} names {named.name}" if named is not None else f"there is no {POINTER} pointer"
            self.notes.append(f"ckpt.resume: {said}, but {newest.name} is complete and newer (a save ended between "
                              f"its commit and the pointer's update): resuming from {newest}")
            return newest
        if named is None:
            raise ValueError(f"ckpt.resume: no checkpoint to resume in {self.dir} (no {POINTER} pointer)")
        if not named.exists():  # the folder was removed by hand: "not a complete checkpoint" sent one looking inside
            older = f"; {newest} is the newest complete one: name it in ckpt.resume" if newest is not None else ""
            raise ValueError(f"ckpt.resume: {POINTER} points to {named}, which is gone{older}")
        return named

    @staticmethod
    def _named(resume: str) -> Path:
        """A folder ckpt.resume names itself: one that does not exist is said so, and a word close to `latest` or
        `auto` (a typo) is asked about, rather than "not a complete checkpoint (no meta.json)"."""
        path = Path(resume)
        if path.exists():
            if not path.is_dir():
                raise ValueError(f"ckpt.resume: {path} is a file, not a checkpoint folder")
            return path
        close = difflib.get_close_matches(resume.lower(), [POINTER, "auto"], n=1, cutoff=0.6)
        if close and "/" not in resume:
            raise ValueError(f"ckpt.resume: {resume!r} is not a checkpoint folder, {POINTER!r} or 'auto': did you "
                             f"mean {close[0]!r}?")
        raise ValueError(f"ckpt.resume: no such folder: {path}")

    def _newest_complete(self) -> Path | None:
        """The newest step folder with its meta.json, or None."""
        for step in reversed(self.steps_on_disk()):
            if (self.dir / _step_name(step) / META).is_file():
                return self.dir / _step_name(step)
        return None

    def read_meta(self, path: Path) -> dict[str, Any]:
        meta_file = path / META
        if not meta_file.is_file():
            raise ValueError(f"ckpt.resume: {path} is not a complete checkpoint (no {META})")
        if not (path / DCP_INDEX).is_file():  # else found after the model was built, under two torch tracebacks
            raise ValueError(f"ckpt.resume: {path} is not a complete checkpoint (no {DCP_INDEX}: the index of its "
                             "model and optimizer shards)")
        try:
            meta = json.loads(meta_file.read_text())
            int(meta["step"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"ckpt.resume: {meta_file} is corrupt") from None
        if meta.get("world_size") != self.world.world_size:
            raise ValueError(f"ckpt.resume: {path} was written by {meta.get('world_size')} processes per node, "
                             f"this run has {self.world.world_size}")
        if meta.get("strategy") != self.strategy:
            raise ValueError(f"ckpt.resume: {path} was written with inner.strategy {meta.get('strategy')}, "
                             f"this run uses {self.strategy}")
        if meta.get("config_digest") != self.digest:
            raise ValueError(f"ckpt.resume: {path} was written with another config: "
                             + (_differences(meta.get("config_settings"), self.settings)
                                or f"digest {meta.get('config_digest')} there, {self.digest} here (the model, "
                                   "data.seq_len and the diloco settings must be those of the run)"))
        return meta

    # ------------------------------------------------------------------------------------------ save / load
    def save(self, step: int, inner, data, progress, outer) -> tuple[Path, float]:
        """Collective: every rank of the node calls it. Returns (folder, seconds). A failure on any rank raises
        CheckpointFailed on every rank (see _agreed), with `latest` left as it was and the partial folder removed."""
        assert self.device is not None, "Checkpointer: the device is given before the first save"
        t0 = time.monotonic()
        final, tmp = self.dir / _step_name(step), self.dir / f".{_step_name(step)}.tmp"
        if final.exists():
            raise ValueError(f"ckpt.dir: {final} already exists (refusing to overwrite)")
        try:
            with self._agreed(step, "preparing its folder"):
                if self.world.rank == 0:
                    self._prepare(tmp)
            with self._agreed(step, "writing"):
                state = inner.state_dict()
                dcp.save({"model": state["model"], "optim": state["optim"]}, checkpoint_id=str(tmp))
                extras = {"scheduler": state["scheduler"], "scaler": state["scaler"],
                          "data": data.train.state_dict(), "progress": progress.state_dict(),
                          "rng": rng_state(self.device), "outer": outer.state_dict()}
                with open(tmp / f"rank-{self.world.rank}.pt", "wb") as fh:
                    torch.save(extras, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            with self._agreed(step, "committing"):  # the other ranks wait here for rank 0's commit
                if self.world.rank == 0:
                    # data: the layout-free position (sequences of the global order read), the dataset and its
                    # fingerprint; each rank-N.pt holds the same, and resume checks the fingerprint against the data
                    meta = {"step": step, "world_size": self.world.world_size, "strategy": self.strategy,
                            "config_digest": self.digest, "config_settings": self.settings,
                            "time": time.time(), "progress": progress.state_dict(),
                            "data": data.train.state_dict(), "max_steps": self.max_steps}
                    _write_atomic(tmp / META, json.dumps(meta, indent=1))
                    os.rename(tmp, final)
                    _fsync_dir(self.dir)
                    _write_atomic(self.dir / POINTER, final.name + "\n")  # only now is the new checkpoint "latest"
        except CheckpointFailed:
            if self.world.rank == 0 and self._owner(tmp) == self._me():  # every rank is past writing into it
                shutil.rmtree(tmp, ignore_errors=True)  # of no use, and a full disk wants the space back
            raise
        self.last_saved_step = step
        if self.world.rank == 0:
            self._prune()  # after the commit: a cleanup that fails is no failed save
        return final, time.monotonic() - t0

    @contextlib.contextmanager
    def _agreed(self, step: int, doing: str):
        """Run the block on every rank, then agree on whether it failed anywhere (a collective, in place of a bare
        barrier): if it did, every rank raises CheckpointFailed here, naming the first failing rank's error (rank 0
        reports for the node). A rank that raised alone left the others in a barrier that its next collective
        paired with: rank 0 committed a checkpoint missing rank 1's file, and both ranks hung. DCP's
        CheckpointException is a BaseException: caught here, or it would escape every handler of engine/train.py."""
        error: BaseException | None = None
        try:
            yield
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - told to every rank, then raised on each
            error = e
        reasons = self._gathered(_reason(error) if error is not None else None)
        failed = [rank for rank, reason in enumerate(reasons) if reason is not None]
        if not failed:
            return
        self.failed_step = step
        pointer = self.dir / POINTER
        now = f"{POINTER} names {pointer.read_text().strip()}" if pointer.is_file() else f"no {POINTER} checkpoint"
        raise CheckpointFailed(f"checkpoint {_step_name(step)} failed on rank {', '.join(map(str, failed))} while "
                               f"{doing}: {reasons[failed[0]]}{self._space_note(reasons[failed[0]])}; {now}") \
            from error

    def _space_note(self, reason: str) -> str:
        """A full disk said as one: DCP's writer reported it as "unexpected pos 704 vs 598", the OSError lost."""
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            return ""
        if free >= FULL_DISK_BYTES or "No space left" in reason:
            return ""
        return f" ({self.dir} has {free / 2**20:.1f} MiB free: the disk is full)"

    def _gathered(self, mine: str | None) -> list[str | None]:
        """Every rank's value, in rank order, on every rank (an object collective: gloo, also beside NCCL)."""
        if not (dist.is_initialized() and self.world.world_size > 1):
            return [mine]
        every: list[str | None] = [None] * self.world.world_size
        dist.all_gather_object(every, mine, group=self.group)
        return every

    def _prepare(self, tmp: Path) -> None:
        """Rank 0: the empty temporary folder of this save, marked as this process's. The first save of the process
        first removes the temporary folders that crashed saves left, of any step. The folder is this node's: the
        processes that could write there run on this host, where the owner's pid tells whether it still runs (a run
        started twice on one folder keeps its folder; one of this step stops this save at mkdir). Another host's
        (ckpt.dir on a shared filesystem, the node moved) is kept: nothing here can tell whether it is alive."""
        if not self.swept:
            for left in self.dir.glob(".step-*.tmp"):
                if self._stale(left):
                    shutil.rmtree(left)
            self.swept = True
        if tmp.exists() and self._stale(tmp):
            shutil.rmtree(tmp)  # an earlier failed save of this step in this process, left where rmtree failed
        tmp.mkdir(parents=True)
        (tmp / OWNER).write_text(self._me() + "\n")

    def _me(self) -> str:
        return f"{self.world.hostname} {self.world.pid}"

    @staticmethod
    def _owner(tmp: Path) -> str | None:
        try:
            return (tmp / OWNER).read_text().strip()
        except OSError:
            return None

    def _stale(self, tmp: Path) -> bool:
        """No live process writes into this temporary folder: its owner is this process, or a process of this host
        that is gone; or it has no owner (a crash between its mkdir and the owner file, or an older engine's)."""
        owner = self._owner(tmp)
        if owner is None or owner == self._me():
            return True
        host, _, pid = owner.rpartition(" ")
        return host == self.world.hostname and pid.isdigit() and not psutil.pid_exists(int(pid))

    def _prune(self) -> None:
        for step in self.steps_on_disk()[:-self.cfg.keep]:
            try:
                shutil.rmtree(self.dir / _step_name(step))
            except OSError as e:  # the next save tries again
                print(f"warning: ckpt.keep: could not remove {_step_name(step)}: {e}", file=sys.stderr, flush=True)

    def load(self, path: Path, inner, data, progress, outer) -> int:
        """Restore everything saved by save(); returns the step. Errors are ValueErrors naming the folder."""
        assert self.device is not None, "Checkpointer: the device is given before a load"
        self.read_meta(path)
        rank_file = path / f"rank-{self.world.rank}.pt"
        try:
            extras = torch.load(rank_file, weights_only=False, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - unreadable/truncated file of any kind: report, don't crash
            raise ValueError(f"ckpt.resume: {rank_file} is missing or corrupt ({type(e).__name__})") from None
        if not isinstance(extras, dict) or not EXTRA_KEYS <= extras.keys():
            raise ValueError(f"ckpt.resume: {rank_file} is corrupt (expected keys {sorted(EXTRA_KEYS)})")
        state = inner.state_dict()
        try:
            dcp.load({"model": state["model"], "optim": state["optim"]}, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure here means a bad checkpoint
            raise ValueError(f"ckpt.resume: {path}: cannot load model/optimizer: {_reason(e)}") from None
        state["scheduler"], state["scaler"] = extras["scheduler"], extras["scaler"]
        inner.load_state_dict(state)
        data.train.load_state_dict(extras["data"])
        progress.load_state_dict(extras["progress"])
        outer.load_state_dict(extras["outer"])
        set_rng_state(extras["rng"], self.device)
        self.last_saved_step = progress.step
        return progress.step

    def _barrier(self) -> None:
        if dist.is_initialized() and self.world.world_size > 1:
            dist.barrier(group=self.group)


def export(inner, hf_config, tokenizer, export_dir: str, world: World, group=None, *, agreed: bool = False) -> Path:
    """Final weights as a transformers folder (AutoModelForCausalLM.from_pretrained loads it). Collective.
    The folder is what `model.save_pretrained()` of the trained model gives: fp32 weights (the training weights, so
    a model.path whose config says bfloat16 is exported in fp32, and its config says float32: a transformers user
    gets what was trained, and casts at load with `dtype=torch.bfloat16` if wanted; a silent bf16 cast would drop
    the low bits that small fine-tuning updates live in), and `use_cache` on, which training turns off
    (engine/model.py): generate() on the export keeps a KV cache.
    Nodes of one DiLoCo run (agreed: every node ends on the run's agreed model) that share the folder (one host, a
    shared filesystem) each write their own temporary folder; the first to finish moves it into place, and the
    others drop theirs, once they find the same weights there (a node that was never in the others' last outer
    step keeps its own folder, and that is the path returned). Without DiLoCo a folder written meanwhile by another
    process is an error that names where this run's export was left."""
    from transformers import AutoModelForCausalLM
    full = inner.full_model_state_dict()  # every rank takes part (FSDP gathers the shards)
    target = Path(export_dir)
    if world.rank == 0:
        prefix = f".{target.name}.tmp-{world.hostname}-"
        tmp = target.with_name(f"{prefix}{world.pid}")
        for left in target.parent.glob(f"{glob_escape(prefix)}*"):  # left by an export of this host that crashed
            pid = left.name[len(prefix):]
            if pid.isdigit() and (int(pid) == world.pid or not psutil.pid_exists(int(pid))):
                shutil.rmtree(left, ignore_errors=True)
        hf_config = hf_config.__class__.from_dict(hf_config.to_dict())
        hf_config.bos_token_id, hf_config.eos_token_id = tokenizer.bos_id, tokenizer.eos_id
        hf_config.use_cache = True  # also into generation_config.json, which save_pretrained derives from it
        # on CPU: buffers (rotary) must be real tensors; fp32 whatever dtype the config names (see above)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        model.load_state_dict(full, strict=True)
        model.save_pretrained(tmp)
        if hasattr(tokenizer, "tok"):
            tokenizer.tok.save_pretrained(tmp)
        else:  # the byte tokenizer has no transformers class: describe it for whoever loads the folder
            (tmp / "byte_tokenizer.json").write_text(json.dumps(
                {"type": "utf-8 bytes", "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
                 "eos_id": tokenizer.eos_id}))
        try:
            if target.exists():
                with contextlib.suppress(FileNotFoundError):  # another node's rmdir came first
                    target.rmdir()  # checked empty at start; rmdir fails rather than delete anything
            os.rename(tmp, target)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not agreed:
                raise ValueError(f"ckpt.export_dir: {target} was written by another process during this run; "
                                 f"this run's export is in {tmp}") from None
            if _same_weights(target, full):
                shutil.rmtree(tmp)  # another node of the run exported into this folder first: the same agreed model
            else:  # a node that was never in this node's last outer step (its run ended before this one joined):
                # kept under a name the next export's sweep of crashed exports' folders does not match
                kept = target.with_name(f"{target.name}-{world.hostname}-{world.pid}")
                os.rename(tmp, kept)
                target = kept
    if dist.is_initialized() and world.world_size > 1:
        dist.barrier(group=group)
    return target


def _same_weights(folder: Path, full: dict[str, torch.Tensor]) -> bool:
    """Whether an export folder holds exactly these weights (the tensors it saved; a tied one it left out)."""
    from safetensors.torch import load_file
    files = sorted(folder.glob("*.safetensors"))
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update(load_file(f))
    return bool(saved) and all(k in full and torch.equal(v, full[k].to(v.dtype)) for k, v in saved.items())


def _differences(there: Any, here: dict[str, Any] | None, most: int = 4) -> str:
    """"model.n_layers = 4 there, 2 here; ..." for the settings a checkpoint and this run disagree on; "" when
    either side does not say (a checkpoint from before the settings were kept)."""
    if not isinstance(there, dict) or not here:
        return ""
    here = json.loads(json.dumps(here))  # as meta.json holds it: a tuple is a list there

    def value(side: dict[str, Any], key: str) -> str:  # a setting one side's engine did not keep: "absent"
        return toml_value(side[key]) if key in side else "absent"
    out = [f"{key} = {value(there, key)} there, {value(here, key)} here"
           for key in sorted(set(there) | set(here)) if value(there, key) != value(here, key)]
    if len(out) > most:
        out[most:] = [f"and {len(out) - most} more"]
    return "; ".join(out)
