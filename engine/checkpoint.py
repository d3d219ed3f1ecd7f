"""Checkpoints (torch.distributed.checkpoint), the `latest` pointer, keep-last-K, and transformers export.

Layout of ckpt.dir (default <run.dir>/checkpoints):

    step-00000100/          one complete checkpoint
        .metadata, *.distcp   model + optimizer (DCP: each rank writes its own shards)
        rank-0.pt ...         per-rank state: scheduler, scaler, data position, RNG, Progress, outer state
        meta.json             step, world size, strategy, config digest, data position; written last
    latest                  the name of the newest complete checkpoint

Commit protocol: every rank writes into `.step-N.tmp/`; after a barrier rank 0 writes meta.json, renames the
folder to `step-N/` and only then replaces `latest` (write `latest.tmp`, fsync, rename). A crash at any point
leaves `latest` naming the previous complete checkpoint; a stale `.tmp` folder is removed by the next save.

Nothing is overwritten and nothing is deleted: a fresh run (no ckpt.resume) that finds an older run's checkpoints
in ckpt.dir moves that folder to `<its parent>/_archive/<time>/` first (as the console archives a node's folder),
a save refuses an existing step folder, and export refuses a non-empty export_dir. The move comes last in start-up
(plan_start() checks, engine.session.build moves once everything else is built): a bad input leaves the folder as it
was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
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
from engine.world import World

POINTER = "latest"
ARCHIVE = "_archive"  # an older run's checkpoints, moved aside by a fresh run
META = "meta.json"
EXTRA_KEYS = {"scheduler", "scaler", "data", "progress", "rng", "outer"}


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


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
                 max_steps: int | None = None):
        self.cfg, self.world, self.digest, self.strategy = cfg, world, config_digest, strategy
        self.device, self.group = device, group
        self.max_steps = max_steps  # train.max_steps, kept in meta.json: a resume can tell the schedule changed
        self.dir = Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"
        self.last_saved_step: int | None = None
        self.older_run = False  # plan_start found an older run's checkpoints where a fresh run starts
        self.resume_meta: dict[str, Any] | None = None  # meta.json of the checkpoint plan_start chose
        self.archived: Path | None = None  # where check_start moved an older run's checkpoints (for a warning)

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
            resume = "latest" if (self.dir / POINTER).is_file() else None
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
        if resume == "latest":
            pointer = self.dir / POINTER
            if not pointer.is_file():
                raise ValueError(f"ckpt.resume: no checkpoint to resume in {self.dir} (no {POINTER} pointer)")
            return self.dir / pointer.read_text().strip()
        return Path(resume)

    def read_meta(self, path: Path) -> dict[str, Any]:
        meta_file = path / META
        if not meta_file.is_file():
            raise ValueError(f"ckpt.resume: {path} is not a complete checkpoint (no {META})")
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
            raise ValueError(f"ckpt.resume: {path} was written with a different model/data/diloco config "
                             f"(digest {meta.get('config_digest')} != {self.digest})")
        return meta

    # ------------------------------------------------------------------------------------------ save / load
    def save(self, step: int, inner, data, progress, outer) -> tuple[Path, float]:
        """Collective: every rank of the node calls it. Returns (folder, seconds)."""
        assert self.device is not None, "Checkpointer: the device is given before the first save"
        t0 = time.monotonic()
        final, tmp = self.dir / _step_name(step), self.dir / f".{_step_name(step)}.tmp"
        if final.exists():
            raise ValueError(f"ckpt.dir: {final} already exists (refusing to overwrite)")
        if self.world.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a crash during an earlier save: never pointed to
            tmp.mkdir(parents=True)
        self._barrier()
        state = inner.state_dict()
        dcp.save({"model": state["model"], "optim": state["optim"]}, checkpoint_id=str(tmp))
        extras = {"scheduler": state["scheduler"], "scaler": state["scaler"], "data": data.train.state_dict(),
                  "progress": progress.state_dict(), "rng": rng_state(self.device), "outer": outer.state_dict()}
        with open(tmp / f"rank-{self.world.rank}.pt", "wb") as fh:
            torch.save(extras, fh)
            fh.flush()
            os.fsync(fh.fileno())
        self._barrier()
        if self.world.rank == 0:
            # data: the layout-free position (sequences of the global order read), the dataset and its
            # fingerprint; each rank-N.pt holds the same, and resume checks the fingerprint against the data
            meta = {"step": step, "world_size": self.world.world_size, "strategy": self.strategy,
                    "config_digest": self.digest, "time": time.time(), "progress": progress.state_dict(),
                    "data": data.train.state_dict(), "max_steps": self.max_steps}
            _write_atomic(tmp / META, json.dumps(meta, indent=1))
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            _write_atomic(self.dir / POINTER, final.name + "\n")  # only now is the new checkpoint "latest"
            self._prune()
        self._barrier()
        self.last_saved_step = step
        return final, time.monotonic() - t0

    def _prune(self) -> None:
        for step in self.steps_on_disk()[:-self.cfg.keep]:
            shutil.rmtree(self.dir / _step_name(step))

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
    Nodes of one DiLoCo run (agreed: every node ends on the run's agreed model) that share the folder (one host, a
    shared filesystem) each write their own temporary folder; the first to finish moves it into place, and the
    others drop theirs, the same model. Without DiLoCo a folder written meanwhile by another process is an error
    that names where this run's export was left."""
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
        model = AutoModelForCausalLM.from_config(hf_config)  # on CPU: buffers (rotary) must be real tensors
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
            shutil.rmtree(tmp)  # another node of the run exported into this folder first: the same agreed model
    if dist.is_initialized() and world.world_size > 1:
        dist.barrier(group=group)
    return target
