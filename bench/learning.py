"""Learning study: does DiLoCo learn? Held-out eval loss of single-worker, DDP-equivalent and DiLoCo arms,
side by side in one run, on the same data order and the same held-out batches.

    python bench/learning.py                           # CPU-sized default arms, real engines and store (~15 min)
    python bench/learning.py --corpus stdlib           # the larger corpus (corpus-large/, built by scripts/setup.sh)
    python bench/learning.py --engine sim --sweep      # the outer-lr x momentum x H x k sweep (in-process)
    python bench/learning.py --engine sim --sweep-h    # H = 10, 50, 200 over 400 inner steps (in-process)
    python bench/learning.py --overlap --seeds 1337,7      # synchronous and overlapped DiLoCo at H = 5 and 20
    python bench/learning.py --fragments --seeds 1337,7    # synchronous and streaming DiLoCo (diloco.fragments)
    python bench/learning.py --poison --seeds 1337,7   # one of 4 nodes sends x100 or sign-flipped pseudo-gradients
    python bench/learning.py --engine sim --optimizer muon --seeds 1337,7,11,23   # Muon as the inner optimizer
    python bench/learning.py --engine sim --optimizer muon --tune --seeds 1337,7,11,23   # the same, each arm tuned
    python bench/learning.py --engine sim --seeds 1337,7,11,23 --arms single,ddp,diloco   # the seed spread
    python bench/learning.py --engine sim --sparse --seeds 1337,7,11,23    # sparse (SparseLoCo) vs dense DiLoCo
    python bench/learning.py --engine sim --sparse-sweep --sparse-h 5     # density x bits, loss against bytes
    python bench/learning.py --engine sim --sparse --tune --seeds 1337,7,11,23   # both arms tuned on 101,102
    python bench/learning.py --preset 15m --seq-len 256 --micro-batch 16 --steps 1000 --device cuda   # GPU-sized

Arms (every worker runs --steps inner steps of --micro-batch sequences; the same seed, model init and schedule):
    single     one worker, shard 0 of 1: the data order every other arm is cut from
    ddp        one worker with a k-times batch (gradient accumulation): exactly what DDP on k workers computes,
               reading exactly the sequences the k DiLoCo nodes read at the same step (engine/data.py sharding)
    diloco     k nodes, outer step every H inner steps (outer optimizer, lr, momentum, warm-up, compression)

Studies of their own (real engines only, each arm against its baseline arm of the same seed):
    --overlap  at each H of --overlap-h (5, 20): sync H (synchronous DiLoCo); overlap H (diloco.overlap landing
               --overlap-delay steps into the next round, the node training on from its own weights meanwhile);
               eager H (the same with diloco.overlap_update = eager); projected H (projected: the node's own
               progress scaled by the fit of the last landed outer step); round-late H (landing at the next
               boundary); with --overlap-lrs, overlap H lrX (delayed at outer lr X); with --overlap-after (in-process
               only), overlap H afterN (delayed, the outer steps up to inner step N synchronous). Then, per H,
               each seed's ratios to its synchronous run and their mean, standard error, min and max. Last line:
                   overlap/sync eval-loss ratio R; eager R'; a round late R''
               R: overlap H's ratio to the synchronous run, the mean over the seeds, the worse of the H values.
    --fragments  at each H of --fragments-h (20): sync H; fragments P H for each P of --fragments-p (2, 4): the
               model synced in P fragments in turn, one every H / P steps (diloco.fragments), mixed with
               --fragment-alpha (diloco.fragment_alpha, 0). Last line:
                   fragments/sync eval-loss ratio R
               R: the worst fragments arm's ratio to the synchronous run of its H, the mean over the seeds.
    --poison   synchronous DiLoCo (the default arm's settings); node --poison-node sends its pseudo-gradient x100
               or sign-flipped for the outer steps --poison-rounds, with the sentinel on (the engine's default) and
               off (diloco.sentinel_ratio = 0). The poison is injected here, not in the engine: that node runs a
               `python -c` wrapper that scales what OuterStep.pseudo_gradient returns (the node's own weights
               and working state stay clean). Last line:
                   poisoned/clean eval-loss ratio R with the sentinel; R' without
               R (R'): the worse of x100 and sign flip, the mean over the seeds.
    --optimizer muon  data-parallel AdamW (ddp-adamw, the baseline), data-parallel Muon (ddp-muon), and at each H of
               --muon-h (5, 20) DiLoCo with AdamW (diloco-adamw H) and with Muon (diloco-muon H) as the inner
               optimizer (optim.name), k nodes, the same tokens. At the shipped settings (optim.lr --lr, the shipped
               outer settings), or with --tune: each arm takes the best of a grid (--tune-lrs; DiLoCo arms also
               --tune-outer, outer lr/momentum pairs) by its mean eval loss over --tune-seeds, then runs on --seeds
               (keep them apart from the tuning seeds). Last line:
                   muon: diloco-muon/ddp-adamw eval-loss ratio R1; ddp-muon/ddp-adamw R2
               R1: the worse of the H values, each the mean over the seeds of the ratio within a seed.
    --sparse   (--engine sim; issue 43) at each H of --sparse-h (5, 20): dense H (synchronous DiLoCo, compression
               none, the shipped outer settings) and sparse H (SimSparse: per worker an ErrorFeedback accumulator of
               engine/outer/sparse.py over the model's tensors, the real encoded message, the real gathered_mean,
               outer lr --sparse-outer-lr times the mean, no outer momentum unless --sparse-outer-momentum), at
               --density, --sparse-bits, --sparse-beta, --sparse-chunk (default: the codec's). Its own scale unless
               flags say otherwise: 400 inner steps per worker, micro-batch 4 x 64. --sparse-sweep: every density x
               bits of --sparse-densities x --sparse-bits-sweep (--sparse-axes: each density at --sparse-bits and
               each bits at --density), each beta of --sparse-betas at --density and --sparse-bits, and
               learning-sparse-sweep.png (eval loss against the bytes of one node's message per outer step).
               --tune: both arms on one grid of outer settings on --tune-seeds (--tune-outer-lrs x --tune-momenta
               for dense, x --tune-betas for sparse). Last line:
                   sparse/dense eval-loss ratio R (bytes ratio B)
               R: the worse over the H values of the mean over the seeds of sparse H / dense H within a seed (the
               sweep: of the best point with B <= 0.01); B: bytes of node 0's message / (4 x values it covers).
Every mesh run counts the contributors the sentinel left out (outer_step events' left_out) in its clean arms
(goal: 0) and prints `sentinel: N contributors left out of M outer steps in the clean arms`.

Engines:
    mesh (default)  every arm is `python -m engine.train` (DiLoCo: k engines and `python -m engine.store`, the
                    real mesh, real gloo); the final model is the engine's transformers export
    sim             the same training in one process: the engine's own model, data, AdamW, schedule and
                    OuterOptimizer, with workers stepped in turn and compression applied exactly as
                    engine.outer.allreduce.weighted_mean applies it. Used for sweeps (no process start-up cost);
                    docs/learning.md shows that both engines agree on the default arms. --jobs N runs N arms
                    at once, each in a process (and a session: a scheduler share) of its own; the same results.

Eval: every arm's final model on the same --eval-batches held-out micro-batches (the engine's held-out split, shard
0 of 1), here in this process. Curves (eval loss against tokens and against wall time) come from the engines'
eval events (mesh) or periodic evals (sim). Outputs: a JSON of results and a PNG next to it (--out). Last line:

    diloco/ddp eval-loss ratio R1; diloco/single R2

for the default DiLoCo arm (the shipped configs/debug-diloco.toml outer settings unless flags say otherwise).
With --seeds, every arm runs once per seed (init, data order and held-out split all follow the seed), a table per
seed and then the mean and spread of each arm's ratios are printed, and R1 and R2 are the means over the seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ranks import at_least  # bench/ is the script's folder, first on sys.path

if TYPE_CHECKING:
    from engine.outer.sparse import SparseSpec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CORPORA = {"docstrings": ROOT / "corpus", "stdlib": ROOT / "corpus-large"}
OVERLAP_DELAY = 1  # --overlap: diloco.overlap_delay (a fixed step, so that the arms are reproducible)


@dataclass(frozen=True)
class Poison:
    """Node `node` sends its pseudo-gradient times `scale` at its rounds first..last (1-based, inclusive)."""
    node: int
    scale: float
    first: int
    last: int


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # single | ddp | diloco
    k: int = 1
    inner_steps: int = 25  # H
    outer_optimizer: str = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_warmup: int = 0
    compression: str = "none"
    overlap: bool = False  # diloco.overlap: the outer step of round t runs while round t+1 trains (mesh only)
    overlap_update: str = "eager"  # diloco.overlap_update, with overlap: eager | delayed | projected
    overlap_delay: int = 1  # diloco.overlap_delay: inner steps into the next round at which the round lands (H: at
    # the next boundary; the in-process engine cannot model 0, "once it is done", so the arms take fixed steps)
    overlap_after: int = 0  # with overlap, in-process only: the outer steps at inner steps up to this one are
    # synchronous (the mean lands at its boundary), the later ones overlap; the engine's diloco.overlap_after is the
    # same rule counted in outer steps (N here is diloco.overlap_after = N // inner_steps there)
    fragments: int = 1  # diloco.fragments: the model synced in this many fragments in turn (1: all at once)
    fragment_alpha: float = 0.0  # diloco.fragment_alpha: the node's own share of a synced fragment
    fragment_delay: int = 0  # diloco.fragment_delay: inner steps a fragment's outer step overlaps
    sentinel_ratio: float | None = None  # diloco.sentinel_ratio (None: the engine's default; 0: off)
    poison: Poison | None = None  # one node sends a scaled pseudo-gradient for a stretch of rounds (mesh only)
    baseline: str = ""  # a study's arm: the arm of the same seed its ratio is taken against
    optimizer: str = "adamw"  # optim.name: the inner optimizer
    lr: float | None = None  # optim.lr of this arm (None: --lr)
    sparse: SparseSpec | None = None  # compression "sparse" (sim only): the codec's settings (SimSparse)

    def overrides(self) -> dict[str, object]:
        out: dict[str, object] = {
            "diloco.enabled": True, "diloco.inner_steps": self.inner_steps,
            "diloco.outer_optimizer": self.outer_optimizer, "diloco.outer_lr": self.outer_lr,
            "diloco.outer_momentum": self.outer_momentum, "diloco.compression": self.compression,
            "diloco.min_nodes": self.k, "diloco.overlap": self.overlap}
        if self.overlap:
            out["diloco.overlap_update"] = self.overlap_update
            out["diloco.overlap_delay"] = self.overlap_delay
        if self.fragments > 1:
            out["diloco.fragments"] = self.fragments
            out["diloco.fragment_alpha"] = self.fragment_alpha
            out["diloco.fragment_delay"] = self.fragment_delay
        if self.sentinel_ratio is not None:
            out["diloco.sentinel_ratio"] = self.sentinel_ratio
        return out


@dataclass
class Result:
    arm: Arm
    eval_loss: float
    wall_s: float
    tokens: int  # tokens trained on, all workers together
    bytes_sent: int = 0  # DiLoCo: bytes node 0 put on the wire
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (tokens, wall_s, eval loss)
    seed: int = 0
    outer_steps: int = 0  # DiLoCo on real engines: outer steps node 0 committed
    left_out: list[tuple[int, str]] = field(default_factory=list)  # (outer step, node) the sentinel left out
    failed: str = ""  # a study's arm whose engines failed (a poisoned run may): why; eval_loss is nan
    bytes_ratio: float = 0.0  # sparse: B, the bytes of node 0's encoded message / (4 x the values it covers)


def shipped_outer() -> dict[str, object]:
    """The DiLoCo settings configs/debug-diloco.toml ships (H and the outer optimizer): the default arm uses them."""
    from engine.config import load_config
    d = load_config(ROOT / "configs" / "debug-diloco.toml").diloco
    return {"inner_steps": d.inner_steps, "outer_optimizer": d.outer_optimizer, "outer_lr": d.outer_lr,
            "outer_momentum": d.outer_momentum}


def default_arms(args) -> list[Arm]:
    base = Arm("diloco", "diloco", k=args.k, **{**shipped_outer(), **args.outer})
    arms = [Arm("single", "single"), Arm("ddp", "ddp", k=args.k), base]
    arms += [replace(base, name=f"diloco-{c}", compression=c) for c in args.compressions]
    # the setting shipped before this study (the DiLoCo paper's, for runs of 100+ outer steps)
    arms += [replace(base, name="paper 0.7/0.9", outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)]
    return arms


def overlap_arms(args) -> list[Arm]:
    """diloco.overlap's learning cost: at each H, synchronous DiLoCo; overlap landing --overlap-delay steps into the
    next round, the node training on from its own weights meanwhile (the engine's default update, "delayed") and
    with the eager update; and delayed overlap landing a whole round late (diloco.overlap_delay = H)."""
    arms = []
    for h in args.overlap_h:
        sync = Arm(f"sync H{h}", "diloco", k=args.k, **{**shipped_outer(), **args.outer, "inner_steps": h})
        ovl = replace(sync, name=f"overlap H{h}", overlap=True, overlap_update="delayed", baseline=sync.name,
                      overlap_delay=min(args.overlap_delay, h))
        arms += [sync, ovl, replace(ovl, name=f"eager H{h}", overlap_update="eager"),
                 replace(ovl, name=f"projected H{h}", overlap_update="projected"),
                 replace(ovl, name=f"round-late H{h}", overlap_delay=h)]
        # eager at other outer lrs, against the same synchronous run (does eager overshoot with the plain mean?)
        arms += [replace(ovl, name=f"eager H{h} lr{lr:g}", overlap_update="eager", outer_lr=lr)
                 for lr in args.eager_lrs]
        # delayed at other outer lrs, against the synchronous run at the shipped one (issue 46: does the overlapped
        # run want an outer lr of its own?)
        arms += [replace(ovl, name=f"overlap H{h} lr{lr:g}", outer_lr=lr) for lr in args.overlap_lrs]
        # delayed with the rounds up to step N synchronous (issue 46: the cost accrues early)
        arms += [replace(ovl, name=f"overlap H{h} after{n}", overlap_after=n) for n in args.overlap_after]
    return arms


def fragment_arms(args) -> list[Arm]:
    """Streaming DiLoCo's learning cost: at each H, synchronous DiLoCo and the model synced in P fragments."""
    arms = []
    for h in args.fragments_h:
        sync = Arm(f"sync H{h}", "diloco", k=args.k, **{**shipped_outer(), **args.outer, "inner_steps": h})
        arms += [sync] + [replace(sync, name=f"fragments {p} H{h}", fragments=p, fragment_alpha=args.fragment_alpha,
                                  fragment_delay=min(args.fragment_delay, h // p), baseline=sync.name)
                          for p in args.fragments_p]
    return arms


def poison_arms(args) -> list[Arm]:
    """The sentinel's study: one node's pseudo-gradient x100 or sign-flipped for a stretch of rounds, with the
    sentinel on (the engine's default) and off, against the clean run."""
    clean = Arm("clean", "diloco", k=args.k, **{**shipped_outer(), **args.outer})
    rounds = args.steps // clean.inner_steps
    # by default the middle half of the run's rounds: after the warm-up, and with rounds left to recover in
    first, last = args.poison_rounds or (rounds // 4 + 1, rounds - rounds // 4)
    if not (1 <= first <= last <= rounds) or not 0 <= args.poison_node < args.k:
        raise SystemExit(f"learning: --poison-rounds {first}-{last} / --poison-node {args.poison_node}: the run has "
                         f"rounds 1-{rounds} and nodes 0-{args.k - 1}")
    arms = [clean]
    for off in (False, True):
        for label, scale in (("x100", 100.0), ("flip", -1.0)):
            arms.append(replace(clean, name=f"{label} sentinel {'off' if off else 'on'}", baseline=clean.name,
                                poison=Poison(args.poison_node, scale, first, last),
                                sentinel_ratio=0.0 if off else None))
    return arms


def muon_arms(args) -> list[Arm]:
    """Muon as the inner optimizer (optim.name): data-parallel AdamW (the baseline), data-parallel Muon, and at each
    H DiLoCo with AdamW and with Muon, at the shipped settings (--tune: tune_arms picks each arm's)."""
    ddp = Arm("ddp-adamw", "ddp", k=args.k)
    arms = [ddp, replace(ddp, name="ddp-muon", optimizer="muon", baseline=ddp.name)]
    for h in args.muon_h:
        diloco = Arm(f"diloco-adamw H{h}", "diloco", k=args.k, baseline=ddp.name,
                     **{**shipped_outer(), **args.outer, "inner_steps": h})
        arms += [diloco, replace(diloco, name=f"diloco-muon H{h}", optimizer="muon")]
    return arms


def muon_plot(per_seed: list[list[Result]], path: Path, title: str) -> None:
    """--optimizer muon: each arm's eval loss against tokens, the mean over the seeds (left), and each seed's eval-loss
    ratio to ddp-adamw of that seed, with their mean (right)."""
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    names = list(dict.fromkeys(r.arm.name for rs in per_seed for r in rs))  # a seed cut short lacks some arms
    for name in names:
        curves = [r.curve for rs in per_seed for r in rs if r.arm.name == name]
        ax1.plot([c[0] / 1e6 for c in curves[0]], [statistics.fmean(c[i][2] for c in curves)
                                                   for i in range(len(curves[0]))], marker=".",
                 label=f"{name} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
    ax1.set_xlabel("tokens trained (millions, all workers)")
    ax1.set_ylabel("held-out eval loss, mean over the seeds")
    for x, name in enumerate(names):
        ratios = [by[name].eval_loss / by["ddp-adamw"].eval_loss for by in ({r.arm.name: r for r in rs}
                                                                              for rs in per_seed)
                  if name in by and "ddp-adamw" in by]
        ax2.scatter([x] * len(ratios), ratios, color="grey", s=14)
        ax2.scatter([x], [statistics.fmean(ratios)], color="black", marker="_", s=400)
    ax2.axhline(1.0, color="red", lw=0.8)
    ax2.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax2.set_ylabel("eval loss / ddp-adamw's, same seed (dots: seeds, bar: mean)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tune_grid(args, arm: Arm, lrs: list[float] | None = None) -> list[Arm]:
    """--tune: the grid of one arm (lrs: --tune-lrs unless given), every point named
    `<arm> lr<lr>[ outer<lr>/<momentum>]`."""
    outer = args.tune_outer if arm.kind == "diloco" else [(arm.outer_lr, arm.outer_momentum)]
    return [replace(arm, name=f"{arm.name} lr{lr:g}" + (f" outer{o_lr:g}/{o_m:g}" if arm.kind == "diloco" else ""),
                    lr=lr, outer_lr=o_lr, outer_momentum=o_m, baseline="")
            for lr in (lrs or args.tune_lrs) for o_lr, o_m in outer]


def load_results(path: Path) -> list[Result]:
    """The results a study saved to its JSON (save() in main)."""
    return results_of(json.loads(path.read_text()))


def results_of(saved: dict) -> list[Result]:
    """The Results of a study's parsed JSON."""
    out = []
    for r in saved["results"]:
        a = r["arm"]
        arm = Arm(**{**a, "poison": Poison(**a["poison"]) if a.get("poison") else None})
        out.append(Result(**{**r, "arm": arm, "curve": [tuple(c) for c in r["curve"]],
                             "left_out": [tuple(x) for x in r["left_out"]]}))
    return out


def tune_arms(args, arms: list[Arm], save) -> list[Arm]:
    """--tune: every arm's grid on --tune-seeds; each arm takes the point of lowest mean eval loss. Prints the grid's
    table and the choices; returns the arms at their chosen settings (names unchanged).

    --tune-staged: the DDP arms over --tune-lrs first; then each DiLoCo arm over --tune-outer at the lr the DDP arm of
    its optimizer chose (its lr is not tuned on its own: 12 points instead of 20 at 2 lrs and 2 outer pairs).
    --tune-from: a (point, seed) an earlier run's -tune.json holds is taken from it, not run again (so a second
    tuning seed runs only its own)."""
    import statistics
    tune_args = argparse.Namespace(**{**vars(args), "seeds": args.tune_seeds})
    earlier = {(r.arm.name, r.seed): r for r in (load_results(args.tune_from) if args.tune_from else [])}
    kept: list[Result] = []

    def run(points: list[Arm]) -> dict[str, float]:
        reused = [(a, s) for s in args.tune_seeds for a in points if (a.name, s) in earlier]
        kept.extend(earlier[(a.name, s)] for a, s in reused)
        print(f"tuning on seeds {', '.join(map(str, args.tune_seeds))}: {len(points)} points"
              + (f" ({len(reused)} of their {len(points) * len(args.tune_seeds)} runs taken from {args.tune_from})"
                 if args.tune_from else ""), flush=True)
        # the seeds that lack the same points run together (every seed, when nothing is taken); the others in turn
        todo: dict[tuple[str, ...], list[int]] = {}
        for s in args.tune_seeds:
            missing = tuple(a.name for a in points if (a.name, s) not in earlier)
            if missing:
                todo.setdefault(missing, []).append(s)
        for names, seeds in todo.items():
            before = list(kept)
            per_seed = run_study_arms(argparse.Namespace(**{**vars(tune_args), "seeds": seeds}),
                                      [a for a in points if a.name in names], lambda results: save(before + results))
            kept.extend(r for rs in per_seed for r in rs)
        save(kept)
        return {a.name: statistics.fmean(r.eval_loss for r in kept if r.arm.name == a.name) for a in points}

    def pick(arm: Arm, grid: list[Arm], mean: dict[str, float]) -> Arm:
        best = min(grid, key=lambda a: mean[a.name])
        print(f"  {arm.name:<20} best {best.name[len(arm.name) + 1:]:<22} mean eval {mean[best.name]:.4f} (grid: "
              + ", ".join(f"{a.name[len(arm.name) + 1:]} {mean[a.name]:.4f}" for a in grid) + ")", flush=True)
        return replace(best, name=arm.name, baseline=arm.baseline)

    chosen: dict[str, Arm] = {}
    stages = [[a for a in arms if a.kind != "diloco"], [a for a in arms if a.kind == "diloco"]] \
        if args.tune_staged else [arms]
    for stage in stages:
        lr_of = {c.optimizer: c.lr for c in chosen.values()}  # staged: each optimizer's lr, from its DDP arm
        grids = {a.name: tune_grid(args, a, [lr_of[a.optimizer]] if a.optimizer in lr_of else None) for a in stage}
        mean = run([a for g in grids.values() for a in g])
        chosen.update({a.name: pick(a, grids[a.name], mean) for a in stage})
    return [chosen[a.name] for a in arms]


def sweep_arms(args) -> list[Arm]:
    """The sweep of docs/learning.md: outer lr x momentum at H=20, k=4; then H, k and an outer-lr warm-up."""
    arms = [Arm("single", "single"), Arm("ddp", "ddp", k=4), Arm("ddp k2", "ddp", k=2)]
    for mom in (0.0, 0.5, 0.9):
        for lr in (0.1, 0.3, 0.5, 0.7, 1.0, 1.5):
            arms.append(Arm(f"nesterov lr{lr:g} m{mom:g}", "diloco", k=4, inner_steps=20, outer_lr=lr,
                            outer_momentum=mom))
    arms.append(Arm("nesterov lr0.7 m0.9 warm-up 3", "diloco", k=4, inner_steps=20, outer_lr=0.7,
                    outer_momentum=0.9, outer_warmup=3))
    for h in (1, 5, 40):
        arms.append(Arm(f"mean H{h}", "diloco", k=4, inner_steps=h, outer_lr=1.0, outer_momentum=0.0))
    arms.append(Arm("nesterov lr0.7 m0.9 H5", "diloco", k=4, inner_steps=5, outer_lr=0.7, outer_momentum=0.9))
    arms.append(Arm("mean k2", "diloco", k=2, inner_steps=20, outer_lr=1.0, outer_momentum=0.0))
    arms.append(Arm("nesterov lr0.7 m0.9 k2", "diloco", k=2, inner_steps=20, outer_lr=0.7, outer_momentum=0.9))
    return arms


def h_sweep_arms(args) -> list[Arm]:
    """H = 10, 50, 200 (the issue's grid) for the plain mean and the paper's 0.7 / 0.9: a run long enough for H = 200
    to mean two outer steps (--steps 400 by default here)."""
    arms = [Arm("single", "single"), Arm("ddp", "ddp", k=4)]
    for h in (10, 50, 200):
        arms.append(Arm(f"mean H{h}", "diloco", k=4, inner_steps=h, outer_lr=1.0, outer_momentum=0.0))
        arms.append(Arm(f"nesterov lr0.7 m0.9 H{h}", "diloco", k=4, inner_steps=h, outer_lr=0.7,
                        outer_momentum=0.9))
    return arms


# ---------------------------------------------------------------------------------------------- shared pieces

def engine_overrides(args, arm: Arm) -> dict[str, object]:
    micro = args.micro_batch
    batch = micro * (arm.k if arm.kind == "ddp" else 1)
    out: dict[str, object] = {
        "model.preset": args.preset, "data.path": str(args.data), "data.seq_len": args.seq_len,
        "train.micro_batch_size": micro, "train.batch_size": batch, "train.max_steps": args.steps,
        "train.eval_interval": args.eval_interval, "train.eval_batches": args.eval_batches,
        "train.log_interval": max(1, args.steps // 20), "train.seed": args.seed,
        "optim.lr": arm.lr or args.lr, "optim.warmup_steps": args.warmup, "optim.schedule": "cosine",
        "optim.name": arm.optimizer,
        "inner.device": args.device, "telemetry.human": False, "telemetry.resource_interval": 60.0,
    }
    if arm.kind == "diloco":
        out.update(arm.overrides())
    return out


def held_out(args):
    """The engine's held-out split, shard 0 of 1: the same batches for every arm."""
    from engine.config import DataConfig
    from engine.data import build_data
    from engine.world import World
    world = World(rank=0, world_size=1, local_rank=0, hostname="bench", pid=0)
    data = build_data(DataConfig(path=str(args.data), seq_len=args.seq_len), world, args.seed)
    if data.eval is None:
        raise SystemExit(f"learning: {args.data} has no held-out split large enough for eval")
    return data


def eval_model(model, eval_stream, args) -> float:
    import torch

    from engine.model import causal_lm_loss
    eval_stream.reset()
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(args.eval_batches):
            x, y = eval_stream.next_batch(args.micro_batch)
            total += float(causal_lm_loss(model, x.to(args.device), y.to(args.device)))
    model.train()
    return total / args.eval_batches


# ---------------------------------------------------------------------------------------------- in-process engine

def run_sim(args, arm: Arm) -> Result:
    """Train an arm in this process with the engine's own pieces (see the module docstring)."""
    import torch

    from engine.config import DataConfig, ModelConfig, OptimConfig
    from engine.data import build_data
    from engine.outer.optimizer import build_outer_optimizer
    from engine.model import build_model, causal_lm_loss
    from engine.inner.optim import lr_factor, make_optimizer
    from engine.world import World

    k = arm.k if arm.kind == "diloco" else 1
    accum = arm.k if arm.kind == "ddp" else 1
    ocfg = OptimConfig(lr=arm.lr or args.lr, warmup_steps=args.warmup, schedule="cosine", name=arm.optimizer)

    def worker(shard: int):
        world = World(rank=0, world_size=1, local_rank=0, hostname="sim", pid=0, global_rank=shard,
                      global_world_size=k)
        data = build_data(DataConfig(path=str(args.data), seq_len=args.seq_len), world, args.seed)
        model = build_model(ModelConfig(preset=args.preset), data.vocab_size, args.seq_len, args.device,
                            seed=args.seed)
        opt = make_optimizer(model, ocfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, ocfg, args.steps))
        return data.train, model, opt, sched

    workers = [worker(i) for i in range(k)]
    evals = held_out(args).eval
    params = [list(p for p in w[1].parameters()) for w in workers]
    flat = lambda ps: torch.cat([p.detach().reshape(-1) for p in ps])  # noqa: E731
    snapshot = flat(params[0]).clone()
    outer = build_outer_optimizer(arm.outer_optimizer, arm.outer_lr, arm.outer_momentum) if arm.kind == "diloco" else None
    overlap = SimOverlap(arm, outer, snapshot, k) if arm.overlap else None
    sparse = SimSparse(arm.sparse, [p.shape for p in params[0]], k, args.device) if arm.sparse else None
    fragments = SimFragments(arm, snapshot, k) if arm.fragments > 1 else None
    tokens_per_step = args.micro_batch * args.seq_len * accum * k
    start, curve, nbytes = time.perf_counter(), [], 0
    for step in range(1, args.steps + 1):
        for stream, model, opt, sched in workers:
            for _ in range(accum):
                x, y = stream.next_batch(args.micro_batch)
                (causal_lm_loss(model, x.to(args.device), y.to(args.device)) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        if overlap is not None and arm.overlap_delay and step % arm.inner_steps == arm.overlap_delay:
            overlap.land_inside(params, flat)
        if fragments is not None:
            fragments.land(params, flat, step)
        if fragments is not None and (step % fragments.every == 0 or step == args.steps):
            nbytes += fragments.step(params, flat, step, last=step == args.steps)
        elif overlap is not None and step % arm.inner_steps == 0:
            nbytes += sim_bytes(snapshot.numel(), k, arm.compression)
            overlap.boundary(params, flat, now=step == args.steps or step <= arm.overlap_after)
        elif outer is not None and step % arm.inner_steps == 0:
            pgrads = [snapshot - flat(ps) for ps in params]
            if sparse is not None:
                mean = sparse.mean(pgrads, [args.micro_batch * args.seq_len * arm.inner_steps] * k)
                nbytes += sparse.wire_bytes
            else:
                mean = sim_weighted_mean(pgrads, arm.compression)
                nbytes += sim_bytes(snapshot.numel(), k, arm.compression)
            if arm.outer_warmup:  # a linear outer-lr warm-up over the first outer steps (measured, not shipped)
                outer.lr = arm.outer_lr * min(1.0, (step // arm.inner_steps) / arm.outer_warmup)
            proposal = outer.propose(snapshot, mean)
            outer.commit(proposal)
            snapshot = proposal.params.clone()
            for ps in params:
                torch.nn.utils.vector_to_parameters(snapshot.clone(), ps)
        if args.eval_interval and step % args.eval_interval == 0 and step < args.steps:
            curve.append((step * tokens_per_step, time.perf_counter() - start,
                          eval_model(workers[0][1], evals, args)))
    wall = time.perf_counter() - start
    loss = eval_model(workers[0][1], evals, args)
    curve.append((args.steps * tokens_per_step, wall, loss))
    return Result(arm, loss, wall, args.steps * tokens_per_step, nbytes, curve, args.seed,
                  bytes_ratio=sparse.bytes_ratio if sparse is not None else 0.0)


class SimOverlap:
    """diloco.overlap in one process (engine/outer/landing.py, Overlapped): at boundary t each worker's pseudo-gradient is taken
    against its own anchor, round t-1's mean (in flight meanwhile) lands into the agreed weights through the outer
    optimizer, round t's mean goes in flight, and each worker trains on from the agreed weights minus u: the outer
    optimizer's step for its own pseudo-gradient / k (eager), that whole pseudo-gradient (delayed) or that times the
    worker's scale fitted at the last landing (projected). The run's last boundary lands at once (the engine's flush
    before its export), and so do those up to arm.overlap_after (synchronous outer steps)."""

    def __init__(self, arm: Arm, outer, snapshot, k: int):
        self.arm, self.outer, self.snapshot, self.k = arm, outer, snapshot, k
        self.anchors = [snapshot.clone() for _ in range(k)]
        self.in_flight = None
        self.sent = None  # projected: each worker's pseudo-gradient of the round in flight
        self.scale = [1.0] * k  # projected: each worker's stand-in scale (engine/outer/landing.py, projected_scale)

    def _land(self) -> None:
        if self.in_flight is not None:
            from engine.outer.landing import projected_scale
            proposal = self.outer.propose(self.snapshot, self.in_flight)
            self.outer.commit(proposal)
            if self.arm.overlap_update == "projected":
                self.scale = [projected_scale(g, self.snapshot, proposal.params, a) for g, a in zip(self.sent,
                                                                                                   self.scale)]
            self.snapshot, self.in_flight = proposal.params.clone(), None

    def land_inside(self, params, flat) -> None:
        """diloco.overlap_delay steps into a round: the mean in flight lands, each worker's progress since its
        anchor carried over onto the agreed weights, which become its anchor."""
        import torch
        if self.in_flight is None:
            return
        self._land()
        for i, ps in enumerate(params):
            moved = self.snapshot + (flat(ps) - self.anchors[i])
            self.anchors[i] = self.snapshot.clone()
            torch.nn.utils.vector_to_parameters(moved, ps)

    def boundary(self, params, flat, *, now: bool) -> None:
        import torch
        pgrads = [a - flat(ps) for a, ps in zip(self.anchors, params)]
        self._land()
        self.in_flight, self.sent = sim_weighted_mean(pgrads, self.arm.compression), pgrads
        if now:
            self._land()
        for i, (g, ps) in enumerate(zip(pgrads, params)):
            if now:  # landed at its boundary (the flush, or a synchronous round): every worker holds the agreed weights
                self.anchors[i] = self.snapshot.clone()
            elif self.arm.overlap_update == "eager":
                self.anchors[i] = self.snapshot - self.outer.preview(g / self.k, out=torch.empty_like(g))
            elif self.arm.overlap_update == "projected":
                self.anchors[i] = self.snapshot - self.scale[i] * g
            else:
                self.anchors[i] = self.snapshot - g
            torch.nn.utils.vector_to_parameters(self.anchors[i].clone(), ps)


class SimFragments:
    """diloco.fragments in one process (engine/outer/cover.py, landing.py): every H / P steps the next fragment (a
    contiguous range of the flat parameters) is averaged over the workers, stepped by an outer optimizer of its own
    (the engine's momentum is per element, so per fragment) and mixed into each worker's weights with fragment_alpha;
    at the run's last step the remaining fragments are synced too, whole (alpha 0), without training in between.
    With fragment_delay the mean is taken at the boundary and lands fragment_delay steps later, the steps trained
    meanwhile carried over (the engine's landing). step() returns the bytes node 0 sent."""

    def __init__(self, arm: Arm, snapshot, k: int):
        from engine.outer.cover import spans
        from engine.outer.optimizer import build_outer_optimizer
        self.arm, self.snapshot, self.k = arm, snapshot, k
        self.every = arm.inner_steps // arm.fragments
        self.spans = spans(snapshot.numel(), arm.fragments)
        self.opts = [build_outer_optimizer(arm.outer_optimizer, arm.outer_lr, arm.outer_momentum) for _ in self.spans]
        self.synced = 0  # outer steps so far: outer step n syncs fragment (n - 1) % P
        self.pending = None  # fragment_delay: (step it lands at, fragment, each worker's weights of it then)

    def _sync(self, params, flat, alpha: float, delay: int = 0, step: int = 0) -> int:
        import torch
        f = self.synced % self.arm.fragments
        self.synced += 1
        lo, hi = self.spans[f]
        mine = [flat(ps) for ps in params]
        mean = sim_weighted_mean([self.snapshot[lo:hi] - m[lo:hi] for m in mine], self.arm.compression)
        proposal = self.opts[f].propose(self.snapshot[lo:hi], mean)
        self.opts[f].commit(proposal)
        self.snapshot[lo:hi] = proposal.params
        if delay:
            self.pending = (step + delay, f, [m[lo:hi].clone() for m in mine])
        else:
            for m, ps in zip(mine, params):
                m[lo:hi] = torch.lerp(m[lo:hi], self.snapshot[lo:hi], 1.0 - alpha)
                torch.nn.utils.vector_to_parameters(m, ps)
        return sim_bytes(hi - lo, self.k, self.arm.compression)

    def land(self, params, flat, step: int, *, now: bool = False) -> None:
        """The fragment in flight lands (at its step, or now): params[f] += (1 - alpha) (agreed - weights then)."""
        import torch
        if self.pending is None or (step < self.pending[0] and not now):
            return
        _, f, then = self.pending
        self.pending = None
        lo, hi = self.spans[f]
        for old, ps in zip(then, params):
            m = flat(ps).clone()
            m[lo:hi] += (1.0 - self.arm.fragment_alpha) * (self.snapshot[lo:hi] - old)
            torch.nn.utils.vector_to_parameters(m, ps)

    def step(self, params, flat, step: int, *, last: bool) -> int:
        if not last:
            return self._sync(params, flat, self.arm.fragment_alpha, self.arm.fragment_delay, step)
        self.land(params, flat, step, now=True)
        return sum(self._sync(params, flat, 0.0) for _ in range(self.arm.fragments))  # this step's, then the rest


def sim_weighted_mean(xs, compression: str):
    """engine.outer.allreduce.weighted_mean's arithmetic without the wire (every weight 1): chunk j of every rank is
    cut into the engine's pieces; rank j sums its own exactly and the others' encoded and decoded (in rank order),
    divides by the number of ranks and encodes each piece once more for the all-gather."""
    import torch

    from engine.outer.allreduce import _pieces, decode, encode
    size, numel = len(xs), xs[0].numel()
    if size == 1 or compression == "none":
        return torch.stack(xs).mean(0)
    g = _pieces(numel, size, compression, torch.device("cpu"))
    codec = lambda rows: decode(*encode(rows, compression), compression)  # noqa: E731
    rows = []
    for x in xs:
        padded = torch.zeros(size * g.pieces * g.pc)
        padded[:numel] = x
        rows.append(padded.view(size, g.pieces, g.pc))
    chunks = []
    for j in range(size):
        acc = rows[j][j].clone()
        for i in range(size):
            if i != j:
                acc += codec(rows[i][j])
        chunks.append(codec(acc / size))
    return torch.cat(chunks).reshape(-1)[:numel]


def sim_bytes(numel: int, k: int, compression: str) -> int:
    """What weighted_mean's ReduceStats.bytes_sent counts for k ranks."""
    from engine.outer.allreduce import bytes_sent
    return bytes_sent(numel, k, compression)


# ---------------------------------------------------------------------------------------------- sparse (issue 43)

# The shipped defaults of compression "sparse" (docs/learning.md, "Sparse outer updates"): the codec's settings are
# SparseSpec's defaults (engine/outer/sparse.py); the outer step is the plain rule, outer lr times the mean of the
# sparse messages with no outer momentum (the accumulator plays its part).
SPARSE_OUTER_LR = 2.0  # tuned (docs/learning.md): at H = 20 1.013x dense, 1.049x at 1 (at H = 5 1.019x, 0.985x at 1)
SPARSE_STEPS, SPARSE_SEQ_LEN, SPARSE_MICRO_BATCH = 400, 64, 4  # the study's scale (parse_sparse)
SPARSE_SWEEP_DENSITIES = (0.005, 0.01, 0.02, 0.05, 0.10)
SPARSE_SWEEP_BITS = (2, 4, 8)


class SimSparse:
    """compression "sparse" in one process, with the engine's own parts (engine/outer/sparse.py, docs/sparse.md):
    per worker an ErrorFeedback accumulator in a ChunkLayout of the model's parameters (chunks never cross a tensor).
    At each boundary every worker stages its pseudo-gradient once (e' = beta * e + delta), encodes the top k of each
    chunk quantized to `bits` (the real message, its bytes the bytes counted), the messages' token-weighted mean is
    the real gathered_mean (decoded in rank order), and each worker commits what it sent (e = e' - sent, after
    quantization). Every worker is counted at every step here (no sentinel, no stragglers): commit, never abort."""

    def __init__(self, spec: SparseSpec, shapes, k: int, device: str = "cpu"):
        import torch

        from engine.outer.sparse import ChunkLayout, ErrorFeedback, SparseCodec
        self.layout = ChunkLayout(shapes, spec)
        self.codec = SparseCodec(spec, self.layout, device)
        self.feedback = [ErrorFeedback(self.codec) for _ in range(k)]
        self.out = torch.zeros(self.layout.padded, dtype=torch.float32, device=device)
        self.message_bytes = 0  # the length of node 0's last encoded message
        self.wire_bytes = 0  # what node 0 puts on the wire per outer step: its message and weight to k - 1 members
        self.bytes_ratio = 0.0  # B = message bytes / (4 x values covered)

    def mean(self, pgrads, weights):
        """The outer step's mean of the workers' sparse messages (a flat tensor like each pseudo-gradient)."""
        from engine.outer.sparse import gathered_mean
        messages, sent = [], []
        for i, (ef, g) in enumerate(zip(self.feedback, pgrads)):
            if not ef.stage(g):
                raise ArmFailed(f"sparse: worker {i}'s accumulator is not finite")
            msg, s = ef.encode()
            messages.append(msg)
            sent.append(s)
        gathered_mean(self.codec, messages, weights, self.out)
        for ef, s in zip(self.feedback, sent):
            ef.commit(s)
        self.message_bytes = int(messages[0].numel())
        self.wire_bytes = (len(messages) - 1) * (self.message_bytes + 4)  # the all-gather: 4 bytes of weight each
        self.bytes_ratio = self.message_bytes / (4 * self.layout.numel)
        return self.layout.unpack(self.out)


def sparse_spec(args, **change):
    from engine.outer.sparse import SparseSpec
    base = {"chunk": args.sparse_chunk, "density": args.density, "bits": args.sparse_bits, "beta": args.sparse_beta}
    try:
        return SparseSpec(**{**base, **change})
    except ValueError as e:
        raise SystemExit(f"learning: {e} (from --sparse-chunk/--density/--sparse-bits/--sparse-beta)") from None


def sparse_arm(args, h: int, dense: Arm, name: str = "", **change) -> Arm:
    """Sparse DiLoCo at H = h against `dense`: outer lr --sparse-outer-lr, momentum --sparse-outer-momentum (0: the
    paper's plain rule; above 0: Nesterov over the sparse mean)."""
    spec = sparse_spec(args, **change)
    return Arm(name or f"sparse H{h}", "diloco", k=args.k, inner_steps=h, outer_optimizer="nesterov",
               outer_lr=args.sparse_outer_lr, outer_momentum=args.sparse_outer_momentum, compression="sparse",
               baseline=dense.name, optimizer=args.optimizer, sparse=spec)


def sparse_arms(args) -> list[Arm]:
    """--sparse: at each H of --sparse-h, synchronous DiLoCo with compression none (dense H, the shipped outer
    settings) and sparse DiLoCo at the shipped sparse settings (sparse H); the inner optimizer --optimizer."""
    arms = []
    for h in args.sparse_h:
        dense = Arm(f"dense H{h}", "diloco", k=args.k, optimizer=args.optimizer,
                    **{**shipped_outer(), **args.outer, "inner_steps": h})
        arms += [dense, sparse_arm(args, h, dense)]
    return arms


def sparse_sweep_points(args) -> list[tuple[float, int, float]]:
    """--sparse-sweep's (density, bits, beta) points: every density x bits of --sparse-densities x
    --sparse-bits-sweep at --sparse-beta, or with --sparse-axes only the grid's two axes (each density at
    --sparse-bits, each bits at --density) and the point they cross at first (--density, --sparse-bits: the
    reference the others are read against, and the first to run); then each beta of --sparse-betas at --density
    and --sparse-bits. Without repeats, in that order (a study cut short has the first ones)."""
    if args.sparse_axes:
        grid = ([(args.density, args.sparse_bits)] + [(d, args.sparse_bits) for d in args.sparse_densities]
                + [(args.density, b) for b in args.sparse_bits_sweep])
    else:
        grid = [(d, b) for d in args.sparse_densities for b in args.sparse_bits_sweep]
    points = [(d, b, args.sparse_beta) for d, b in grid] + [(args.density, args.sparse_bits, beta)
                                                            for beta in args.sparse_betas]
    return list(dict.fromkeys(points))


def sparse_sweep_arms(args) -> list[Arm]:
    """--sparse-sweep: at each H of --sparse-h, dense DiLoCo and sparse at each point of sparse_sweep_points."""
    arms = []
    for h in args.sparse_h:
        dense = Arm(f"dense H{h}", "diloco", k=args.k, optimizer=args.optimizer,
                    **{**shipped_outer(), **args.outer, "inner_steps": h})
        arms.append(dense)
        arms += [sparse_arm(args, h, dense, f"sparse d{d * 100:g}% b{b}"
                            + (f" beta{beta:g}" if beta != args.sparse_beta else "") + f" H{h}",
                            density=d, bits=b, beta=beta)
                 for d, b, beta in sparse_sweep_points(args)]
    return arms


def sparse_tune(args, arms: list[Arm], save) -> list[Arm]:
    """--sparse --tune: both arms of each H on the same grid of outer settings on --tune-seeds: outer lr
    (--tune-outer-lrs) x momentum for dense (--tune-momenta, Nesterov) or beta for sparse (--tune-betas, no outer
    momentum). Each arm takes the point of lowest mean eval loss (the sparse arm among the points with B <= 0.01
    only: they all share its density and bits, so all or none). Returns the arms at their chosen settings."""
    import statistics
    grids = {}
    for arm in arms:
        if arm.sparse is None:
            grids[arm.name] = [replace(arm, name=f"{arm.name} outer{lr:g}/{m:g}", outer_lr=lr, outer_momentum=m)
                               for lr in args.tune_outer_lrs for m in args.tune_momenta]
        else:
            grids[arm.name] = [replace(arm, name=f"{arm.name} outer{lr:g} beta{b:g}", outer_lr=lr, baseline="",
                                       sparse=replace(arm.sparse, beta=b))
                               for lr in args.tune_outer_lrs for b in args.tune_betas]
    tune_args = argparse.Namespace(**{**vars(args), "seeds": args.tune_seeds})
    print(f"tuning on seeds {', '.join(map(str, args.tune_seeds))}: {sum(map(len, grids.values()))} points")
    per_seed = run_arms(tune_args, [a for g in grids.values() for a in g], save)
    mean = {name: statistics.fmean(r.eval_loss for rs in per_seed for r in rs if r.arm.name == name)
            for g in grids.values() for name in (a.name for a in g)}
    chosen = []
    for arm in arms:
        best = min(grids[arm.name], key=lambda a: mean[a.name])
        print(f"  {arm.name:<12} best {best.name[len(arm.name) + 1:]:<18} mean eval {mean[best.name]:.4f} (grid: "
              + ", ".join(f"{a.name[len(arm.name) + 1:]} {mean[a.name]:.4f}" for a in grids[arm.name]) + ")")
        chosen.append(replace(best, name=arm.name, baseline=arm.baseline))
    return chosen


def sparse_conclude(args, per_seed: list[list[Result]]) -> None:
    """Each sparse arm's ratio to the dense arm of its H and seed (per seed, mean, spread), B, the sweep's plot of
    eval loss against bytes per outer step, and the last line:
        sparse/dense eval-loss ratio R (bytes ratio B)
    R: the worse over the H values of the mean over the seeds (the headline arms at the settings run; for the sweep
    the best point with B <= 0.01 at each H)."""
    import math
    text, means = paired(per_seed)
    values = model_values(args)
    print(f"each sparse arm's eval loss / dense DiLoCo's of its H, same seed ({', '.join(map(str, args.seeds))}):")
    print(text)
    first = {r.arm.name: r for r in per_seed[0]}
    sparse = [n for n, r in first.items() if r.arm.sparse is not None]
    w = max([22] + [len(n) for n in sparse])
    print(f"{'arm':<{w}} {'density':>7} {'bits':>4} {'beta':>5} {'outer':>10} {'msg bytes':>10} {'B':>7} "
          f"{'1/B':>6} {'ratio':>7}")
    for n in sparse:
        r, s = first[n], first[n].arm.sparse
        print(f"{n:<{w}} {s.density:>7.4f} {s.bits:>4} {s.beta:>5.3g} "
              f"{r.arm.outer_lr:>5.3g}/{r.arm.outer_momentum:<4.3g} {round(r.bytes_ratio * 4 * values):>10} "
              f"{r.bytes_ratio:>7.4f} {1 / r.bytes_ratio:>6.0f} {means[n]:>7.4f}")
    if args.sparse_sweep:
        sparse_plot(args, per_seed, values)
    picks = []
    for h in args.sparse_h:
        at_h = [n for n in sparse if first[n].arm.inner_steps == h and first[n].bytes_ratio <= 0.01
                and math.isfinite(means[n])]
        if not at_h:
            continue
        best = min(at_h, key=lambda n: means[n])
        picks.append(best)
        if args.sparse_sweep:
            print(f"H = {h}: the best sparse point with B <= 0.01: {best} ({means[best]:.4f})")
    if not picks:
        print("sparse/dense eval-loss ratio nan (bytes ratio nan): no sparse arm with B <= 0.01 ran")
        return
    worst_name = max(picks, key=lambda n: means[n])
    b = max(first[n].bytes_ratio for n in picks)
    print(f"sparse/dense eval-loss ratio {means[worst_name]:.4f} (bytes ratio {b:.4f})")


def model_values(args) -> int:
    """The values of the study's model (what one node's dense fp32 message covers)."""
    from engine.config import ModelConfig
    from engine.model import build_model
    model = build_model(ModelConfig(preset=args.preset), held_out(args).vocab_size, args.seq_len, "cpu",
                        seed=args.seed)
    return sum(p.numel() for p in model.parameters())


def sparse_series(args, per_seed: list[list[Result]], values: int, h: int):
    """What sparse_plot draws at H = h, as (bytes of one node's message, mean eval loss over the seeds, label):
    dense DiLoCo's point (fp32, 4 bytes a value), a line per bits value through its densities at --sparse-beta
    (labels: the densities), and the points at other betas (labels: the betas)."""
    import statistics
    by_seed = [{r.arm.name: r for r in rs} for rs in per_seed]
    first = by_seed[0]
    loss = {n: statistics.fmean(by[n].eval_loss for by in by_seed) for n in first}
    at_h = [r for r in first.values() if r.arm.inner_steps == h and r.arm.sparse is not None]

    def point(r: Result, label: str) -> tuple[float, float, str]:
        return r.bytes_ratio * 4 * values, loss[r.arm.name], label

    dense = (4.0 * values, loss[f"dense H{h}"], "dense")
    lines = {b: sorted(point(r, f"{r.arm.sparse.density * 100:g}%") for r in at_h
                       if r.arm.sparse.bits == b and r.arm.sparse.beta == args.sparse_beta)
             for b in sorted({r.arm.sparse.bits for r in at_h})}
    betas = [point(r, f"beta {r.arm.sparse.beta:g}") for r in at_h if r.arm.sparse.beta != args.sparse_beta]
    return dense, {b: pts for b, pts in lines.items() if pts}, betas


def sparse_plot(args, per_seed: list[list[Result]], values: int) -> None:
    """Held-out eval loss (mean over the seeds) against the bytes of one node's message per outer step
    (sparse_series), one panel per H."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(args.sparse_h), figsize=(6.5 * len(args.sparse_h), 4.8), squeeze=False)
    for ax, h in zip(axes[0], args.sparse_h):
        dense, lines, betas = sparse_series(args, per_seed, values, h)
        ax.scatter([dense[0]], [dense[1]], marker="*", s=120, color="k", label="dense DiLoCo (fp32, compression none)")
        ax.axhline(dense[1], color="k", lw=0.6, ls=":")
        for b, pts in lines.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"sparse, {b} bits")
            for x, y, label in pts:
                ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if betas:
            ax.scatter([p[0] for p in betas], [p[1] for p in betas], marker="x", color="grey",
                       label=f"sparse at {args.density * 100:g}%, {args.sparse_bits} bits, other beta")
            for x, y, label in betas:
                ax.annotate(label, (x, y), fontsize=7, xytext=(-40, 3), textcoords="offset points")
        ax.axvline(0.01 * 4 * values, color="r", lw=0.6, ls="--", label="B = 0.01")
        ax.set_xscale("log")
        ax.set_xlabel("bytes of one node's message per outer step")
        ax.set_ylabel("held-out eval loss" + (f" (mean of {len(per_seed)} seeds)" if len(per_seed) > 1 else ""))
        ax.set_title(f"H = {h}, k = {args.k}, {args.steps} inner steps/worker")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = args.out / "learning-sparse-sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------- real engines

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class ArmFailed(RuntimeError):
    """An arm's engines failed (exited non-zero or ran past --arm-timeout)."""


# The poisoned node of --poison: engine.train with OuterStep.pseudo_gradient wrapped so that what the node sends
# is scaled at its rounds FIRST..LAST (its own weights and buffers stay clean). argv: SCALE FIRST LAST then
# engine.train's own arguments.
POISONED_ENGINE = """
import sys
from engine.outer.step import OuterStep
scale, first, last = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
clean, rounds = OuterStep.pseudo_gradient, [0]
def poisoned(self):
    pgrad = clean(self)
    rounds[0] += 1  # called once per round this node contributes to (a retried attempt reuses it)
    return pgrad * scale if first <= rounds[0] <= last else pgrad
OuterStep.pseudo_gradient = poisoned
import engine.train
sys.argv = ["engine.train"] + sys.argv[4:]
engine.train.cli()
"""


def run_mesh(args, arm: Arm, workdir: Path) -> Result:
    """Train an arm with real engine processes (DiLoCo: k nodes and a store). Raises ArmFailed when an engine
    fails."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per arm on stdout, not a bar per loaded model
    if arm.outer_warmup:
        raise SystemExit(f"learning: arm {arm.name}: an outer-lr warm-up is measured with --engine sim only (the "
                         f"engine ships none: docs/learning.md)")
    k = arm.k if arm.kind == "diloco" else 1
    run_dir = workdir / f"{arm.name.replace(' ', '_').replace('/', '-')}-seed{args.seed}"  # --seeds: one each
    env = {k_: v for k_, v in os.environ.items() if not k_.startswith(("ZERO_BAND_", "GLOBAL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + args.arm_timeout
    try:
        port = None
        if arm.kind == "diloco":
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "engine.store", "--host", "127.0.0.1",
                                           "--port", str(port)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, start_new_session=True))
            procs[0].stdout.readline()  # the "ready" line
        start = time.perf_counter()
        engines = []
        for i in range(k):
            over = {**engine_overrides(args, arm), "run.dir": str(run_dir / f"node-{i}"),
                    "ckpt.export_dir": str(run_dir / f"node-{i}" / "export")}
            if port is not None:
                # generous waits: on a loaded machine a node may reach a boundary long after the others, and a node
                # left out (the boundary waits mesh.store_timeout for it) would change what the arm measures
                over.update({"mesh.store_port": port, "mesh.node_id": f"node-{i}", "mesh.heartbeat_timeout": 30.0,
                             "mesh.start_timeout": 300.0, "mesh.store_timeout": 300.0,
                             "diloco.allreduce_timeout": 300.0})
            cmd = [sys.executable, "-m", "engine.train"]
            if arm.poison is not None and arm.poison.node == i:
                p_ = arm.poison
                cmd = [sys.executable, "-c", POISONED_ENGINE, str(p_.scale), str(p_.first), str(p_.last)]
            cmd += [str(ROOT / "configs" / "debug.toml")]
            cmd += [f"--{key}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
                    for key, v in over.items()]
            node_env = {**env, "GLOBAL_RANK": str(i), "GLOBAL_WORLD_SIZE": str(k)}
            # into files, not pipes: an engine whose pipe nobody reads (this loop waits on node-0 first) blocks on
            # its next event once ~64 KiB of them have piled up, misses its boundary and is left out of the run
            logs = (run_dir / f"node-{i}.out", run_dir / f"node-{i}.err")
            logs[0].parent.mkdir(parents=True, exist_ok=True)
            with open(logs[0], "w") as out_f, open(logs[1], "w") as err_f:
                engines.append((subprocess.Popen(cmd, env=node_env, cwd=ROOT, stdout=out_f, stderr=err_f,
                                                 text=True, start_new_session=True), logs))
        procs += [p for p, _ in engines]
        outs = []
        for i, (p, logs) in enumerate(engines):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ArmFailed(f"arm {arm.name} ran past --arm-timeout {args.arm_timeout}s") from None
            out, err = logs[0].read_text(), logs[1].read_text()
            if p.returncode != 0:
                said = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
                warned = [e.get("message", "") for e in said if e.get("type") == "warning"]
                log = args.out / f"failed-{run_dir.name}-node-{i}.log"  # its events and stderr, to read later
                log.write_text(out + "\n--- stderr\n" + err)
                raise ArmFailed(f"arm {arm.name}: node-{i} exited {p.returncode} (its output: {log}); its last "
                                f"warnings:\n" + "\n".join(warned[-5:]) + f"\n{err[-3000:]}")
            outs.append(out)
        wall = time.perf_counter() - start
    finally:
        _kill(procs)
    events = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    t0 = min(e["ts"] for e in events)
    accum = arm.k if arm.kind == "ddp" else 1
    tokens_per_step = args.micro_batch * args.seq_len * accum * k
    curve = [(e["step"] * tokens_per_step, e["ts"] - t0, e["loss"]) for e in events if e["type"] == "eval"]
    outer = [e for e in events if e["type"] == "outer_step"]
    nbytes = sum(e["bytes_sent"] for e in outer)
    # the sentinel's verdict is the same on every member: node 0's events name every node it left out
    left_out = [(e["outer_step"], m) for e in outer for m in e.get("left_out", [])]
    # every outer step has all k nodes as members: otherwise a node was left out of the mesh (late or lost) and the
    # arm measured something else than it says
    short = [e["outer_step"] for e in outer if len(e["members"]) < k]
    if short:
        raise ArmFailed(f"arm {arm.name}: outer steps {steps_text(short)} had fewer than {k} members (a node was "
                        f"left out of the mesh: a loaded machine?)")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "node-0" / "export", local_files_only=True,
                                                 dtype=torch.float32).to(args.device)
    loss = eval_model(model, held_out(args).eval, args)
    curve = [c for c in curve if c[0] < args.steps * tokens_per_step] + [(args.steps * tokens_per_step, wall, loss)]
    return Result(arm, loss, wall, args.steps * tokens_per_step, nbytes, curve, args.seed, len(outer), left_out)


# ---------------------------------------------------------------------------------------------- report

def table(results: list[Result], ddp: Result | None, single: Result | None) -> str:
    head = f"{'arm':<30} {'k':>2} {'H':>4} {'outer':>20} {'comp':>5} {'eval':>7} {'/ddp':>6} {'/single':>7} " \
           f"{'tokens':>9} {'wall s':>7} {'MB wire':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        a = r.arm
        warmup = f" w{a.outer_warmup}" if a.outer_warmup else ""
        outer = f"{a.outer_optimizer} {a.outer_lr:g}/{a.outer_momentum:g}{warmup}" if a.kind == "diloco" else ""
        vs_ddp = f"{r.eval_loss / ddp.eval_loss:.3f}" if ddp else "-"
        vs_single = f"{r.eval_loss / single.eval_loss:.3f}" if single else "-"
        lines.append(f"{a.name:<30} {a.k:>2} {a.inner_steps if a.kind == 'diloco' else '-':>4} {outer:>20} "
                     f"{a.compression if a.kind == 'diloco' else '-':>5} {r.eval_loss:>7.4f} {vs_ddp:>6} "
                     f"{vs_single:>7} {r.tokens:>9} {r.wall_s:>7.1f} {r.bytes_sent / 1e6:>8.1f}")
    return "\n".join(lines)


def spread(per_seed: list[list[Result]]) -> tuple[str, dict[str, tuple[float, float]]]:
    """Each arm's ratios to DDP and to the single worker over the seeds: a table, and {arm: (mean /ddp, mean
    /single)} (a ratio is taken within one seed, where the arms share init, data order and held-out batches)."""
    import statistics
    names = [r.arm.name for r in per_seed[0]]
    head = f"{'arm':<30} {'seeds':>5} {'eval mean':>9} {'/ddp mean':>9} {'sd':>6} {'min':>6} {'max':>6} " \
           f"{'/single mean':>12} {'sd':>6}"
    lines, means = [head, "-" * len(head)], {}
    for name in names:
        runs = [{r.arm.name: r for r in rs} for rs in per_seed]
        vs_ddp = [b[name].eval_loss / b["ddp"].eval_loss for b in runs if "ddp" in b]
        vs_single = [b[name].eval_loss / b["single"].eval_loss for b in runs if "single" in b]
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
        mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
        means[name] = (mean(vs_ddp), mean(vs_single))
        lines.append(f"{name:<30} {len(runs):>5} {mean([b[name].eval_loss for b in runs]):>9.4f} "
                     f"{mean(vs_ddp):>9.3f} {sd(vs_ddp):>6.3f} {min(vs_ddp, default=float('nan')):>6.3f} "
                     f"{max(vs_ddp, default=float('nan')):>6.3f} {mean(vs_single):>12.3f} {sd(vs_single):>6.3f}")
    return "\n".join(lines), means


def paired(per_seed: list[list[Result]]) -> tuple[str, dict[str, float]]:
    """A study's arms against their baselines: each arm's eval-loss ratio to its baseline arm of the same seed, over
    the seeds: a table, and {arm: mean ratio} (nan where a run failed or diverged)."""
    import math
    import statistics
    names = [r.arm.name for r in per_seed[0] if r.arm.baseline]
    w = max([22] + [len(n) for n in names])
    head = f"{'arm':<{w}} {'against':<10} {'seeds':>5} {'ratio mean':>10} {'sd':>6} {'min':>6} {'max':>6}  per seed"
    lines, means = [head, "-" * len(head)], {}
    for name in names:
        ratios = []
        for rs in per_seed:
            by = {r.arm.name: r for r in rs}
            ratios.append(by[name].eval_loss / by[by[name].arm.baseline].eval_loss)
        finite = all(math.isfinite(x) for x in ratios)
        means[name] = statistics.fmean(ratios) if finite else float("nan")
        sd = statistics.stdev(ratios) if finite and len(ratios) > 1 else 0.0
        lo, hi = (min(ratios), max(ratios)) if finite else (float("nan"),) * 2
        lines.append(f"{name:<{w}} {by[name].arm.baseline:<10} "
                     f"{len(ratios):>5} {means[name]:>10.4f} {sd:>6.4f} {lo:>6.4f} {hi:>6.4f}  "
                     f"{' '.join(f'{x:.4f}' for x in ratios)}")
    return "\n".join(lines), means


def overlap_spread(per_seed: list[list[Result]], hs: list[int]) -> str:
    """--overlap, per H: each seed's losses and ratios to the synchronous run of that seed (overlap/sync,
    eager/sync, and any other arm of that H), then each ratio's mean, standard error, min and max over the seeds, so
    that one seed's luck shows beside the mean."""
    import math
    import statistics
    lines = []
    for h in hs:
        sync = f"sync H{h}"
        names = [r.arm.name for r in per_seed[0] if r.arm.baseline == sync]
        if not names:
            continue
        short = [n.replace(f" H{h}", "") for n in names]
        head = f"{'H = ' + str(h):<8} {'seed':>6} {'sync':>7}"
        head += "".join(f" {s:>10} {s + '/sync':>{len(s) + 5}}" for s in short)
        lines += [head, "-" * len(head)]
        ratios: dict[str, list[float]] = {n: [] for n in names}
        for rs in per_seed:
            by = {r.arm.name: r for r in rs}
            row = f"{'':<8} {rs[0].seed:>6} {by[sync].eval_loss:>7.4f}"
            for n, s in zip(names, short):
                ratios[n].append(by[n].eval_loss / by[sync].eval_loss)
                row += f" {by[n].eval_loss:>10.4f} {ratios[n][-1]:>{len(s) + 5}.4f}"
            lines.append(row)
        for label in ("mean", "se", "min", "max"):
            row = f"{'':<8} {label:>6} {'':>7}"
            for n, s in zip(names, short):
                xs = ratios[n]
                if not all(math.isfinite(x) for x in xs):
                    v = float("nan")
                elif label == "mean":
                    v = statistics.fmean(xs)
                elif label == "se":  # the standard error of the mean: sd / sqrt(seeds); 0 with one seed
                    v = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
                else:
                    v = (min if label == "min" else max)(xs)
                row += f" {'':>10} {v:>{len(s) + 5}.4f}"
            lines.append(row)
    return "\n".join(lines)


def steps_text(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    runs: list[list[int]] = []
    for s in sorted(steps):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def sentinel_report(results: list[Result]) -> str:
    """Who the sentinel left out: each poisoned arm's verdicts, then the count over the clean DiLoCo arms."""
    lines = []
    for r in results:
        if r.arm.poison is not None and not r.failed:
            nodes = sorted({m for _, m in r.left_out})
            said = "; ".join(f"{m} at outer steps {steps_text([s for s, n in r.left_out if n == m])}" for m in nodes)
            lines.append(f"  {r.arm.name} (seed {r.seed}, node-{r.arm.poison.node} poisoned at its rounds "
                         f"{r.arm.poison.first}-{r.arm.poison.last}): left out: {said or 'nobody'}")
    clean = [r for r in results if r.arm.kind == "diloco" and r.arm.poison is None]
    count = sum(len(r.left_out) for r in clean)
    lines.append(f"sentinel: {count} contributors left out of {sum(r.outer_steps for r in clean)} outer steps in the "
                 f"clean arms ({len(clean)} runs)")
    for r in clean:
        if r.left_out:
            lines.append(f"  {r.arm.name} (seed {r.seed}): " + ", ".join(f"{m} at {s}" for s, m in r.left_out))
    return "\n".join(lines)


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    seeds = sorted({r.seed for r in results})
    for r in results:
        toks = [c[0] / 1e6 for c in r.curve]
        label = r.arm.name if len(seeds) == 1 else f"{r.arm.name} (seed {r.seed})"
        ax1.plot(toks, [c[2] for c in r.curve], marker=".", label=label)
        ax2.plot([c[1] for c in r.curve], [c[2] for c in r.curve], marker=".", label=label)
    ax1.set_xlabel("tokens trained (millions, all workers)")
    ax2.set_xlabel("wall-clock seconds")
    for ax in (ax1, ax2):
        ax.set_ylabel("held-out eval loss")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("mesh", "sim"), default="mesh")
    ap.add_argument("--corpus", choices=sorted(CORPORA), default="docstrings")
    ap.add_argument("--data", type=Path, help="a corpus path (overrides --corpus)")
    ap.add_argument("--preset", default="debug")
    # 2,048 tokens per worker step (sequences of the shipped debug-diloco length): below ~1k, DDP's k-times batch
    # still pays off in full and no outer setting keeps up with it (docs/learning.md, "Batch per worker")
    ap.add_argument("--seq-len", type=at_least(1), default=128)
    ap.add_argument("--micro-batch", type=at_least(1), default=16)
    ap.add_argument("--steps", type=at_least(1), help="inner steps per worker (default 120; 400 with --sweep-h)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--seeds", help="comma-separated seeds: every arm once per seed, and the spread (overrides --seed)")
    ap.add_argument("--arms", help="comma-separated arm names to run (default: every arm of the chosen set)")
    ap.add_argument("--k", type=at_least(1), default=4, help="DiLoCo nodes (and the DDP-equivalent batch multiple)")
    ap.add_argument("--inner-steps", type=at_least(1),
                    help="H of the default DiLoCo arm (default: the shipped config's)")
    ap.add_argument("--outer-optimizer"), ap.add_argument("--outer-lr", type=float)
    ap.add_argument("--outer-momentum", type=float), ap.add_argument("--outer-warmup", type=int)
    ap.add_argument("--compressions", default="int8", help="extra DiLoCo arms with these compressions")
    ap.add_argument("--eval-interval", type=int, default=40)
    ap.add_argument("--eval-batches", type=at_least(1), default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    ap.add_argument("--arm-timeout", type=float, default=1800.0)
    ap.add_argument("--jobs", type=at_least(1), default=1,
                    help="--engine sim: run this many arms at once, each in a process of its own")
    sweeps = ap.add_mutually_exclusive_group()
    sweeps.add_argument("--sweep", action="store_true", help="the docs/learning.md sweep instead of the default arms")
    sweeps.add_argument("--sweep-h", action="store_true", help="H = 10, 50, 200 over 400 inner steps per worker")
    sweeps.add_argument("--overlap", action="store_true",
                        help="synchronous, eager-overlap and delayed-overlap DiLoCo at each --overlap-h (mesh only)")
    sweeps.add_argument("--fragments", action="store_true",
                        help="synchronous and streaming DiLoCo (diloco.fragments) at each --fragments-h")
    sweeps.add_argument("--poison", action="store_true",
                        help="one node sends x100 or sign-flipped pseudo-gradients, sentinel on and off (mesh only)")
    sweeps.add_argument("--sparse", action="store_true",
                        help="sparse DiLoCo (SparseLoCo, issue 43) against dense DiLoCo at each --sparse-h (sim only)")
    sweeps.add_argument("--sparse-sweep", action="store_true",
                        help="--sparse at every density x bits of --sparse-densities x --sparse-bits-sweep")
    ap.add_argument("--sparse-h", default="5,20", help="--sparse: the H values (comma-separated)")
    ap.add_argument("--sparse-chunk", type=int, help="--sparse: the chunk (default: engine/outer/sparse.py's)")
    ap.add_argument("--density", type=float, help="--sparse: the fraction of each chunk sent (default: the codec's)")
    ap.add_argument("--sparse-bits", type=int, help="--sparse: bits of a kept value (default: the codec's)")
    ap.add_argument("--sparse-beta", type=float, help="--sparse: the accumulator's decay (default: the codec's)")
    ap.add_argument("--sparse-outer-lr", type=float, default=SPARSE_OUTER_LR,
                    help="--sparse: the sparse arm's outer lr")
    ap.add_argument("--sparse-outer-momentum", type=float, default=0.0,
                    help="--sparse: the sparse arm's outer momentum (0: the paper's plain rule; > 0: Nesterov)")
    ap.add_argument("--sparse-densities", default=",".join(f"{d:g}" for d in SPARSE_SWEEP_DENSITIES),
                    help="--sparse-sweep: the densities")
    ap.add_argument("--sparse-bits-sweep", default=",".join(map(str, SPARSE_SWEEP_BITS)),
                    help="--sparse-sweep: the bits")
    ap.add_argument("--sparse-axes", action="store_true",
                    help="--sparse-sweep: only the grid's two axes (each density at --sparse-bits, each bits at "
                         "--density), not every density x bits")
    ap.add_argument("--sparse-betas", default="",
                    help="--sparse-sweep: also sparse at these betas (at --density and --sparse-bits)")
    ap.add_argument("--tune-outer-lrs", default="0.7,1,1.4", help="--sparse --tune: the outer lrs of both arms")
    ap.add_argument("--tune-momenta", default="0,0.5", help="--sparse --tune: dense DiLoCo's outer momenta")
    ap.add_argument("--tune-betas", default="0.9,0.95", help="--sparse --tune: sparse DiLoCo's betas")
    ap.add_argument("--overlap-h", default="5,20", help="--overlap: the H values (comma-separated)")
    ap.add_argument("--overlap-delay", type=at_least(0), default=OVERLAP_DELAY,
                    help="--overlap: diloco.overlap_delay of the overlapped arms (inner steps into the next round)")
    ap.add_argument("--eager-lrs", default="", help="--overlap: also eager overlap at these outer lrs (against the "
                                                    "synchronous run at the default one)")
    ap.add_argument("--overlap-lrs", default="", help="--overlap: also delayed overlap at these outer lrs (against "
                                                      "the synchronous run at the default one)")
    ap.add_argument("--overlap-after", default="", help="--overlap, --engine sim: also delayed overlap with the outer "
                                                        "steps up to these inner steps synchronous (comma-separated)")
    ap.add_argument("--fragments-h", default="20", help="--fragments: the H values (comma-separated)")
    ap.add_argument("--fragments-p", default="2,4", help="--fragments: the fragment counts (each must divide H)")
    ap.add_argument("--fragment-alpha", type=float, default=0.0, help="--fragments: diloco.fragment_alpha")
    ap.add_argument("--fragment-delay", type=int, default=0, help="--fragments: diloco.fragment_delay (at most H / P)")
    ap.add_argument("--poison-node", type=int, default=1, help="--poison: the node that sends the poison")
    ap.add_argument("--poison-rounds", help="--poison: its rounds FIRST-LAST (default: the middle half of the run)")
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                    help="muon: the study of Muon as the inner optimizer (DDP and DiLoCo, AdamW and Muon)")
    ap.add_argument("--muon-h", default="5,20", help="--optimizer muon: the H values of the DiLoCo arms")
    ap.add_argument("--tune", action="store_true",
                    help="--optimizer muon: tune every arm on --tune-seeds first (--tune-lrs, --tune-outer)")
    ap.add_argument("--tune-seeds", default="101,102", help="--tune: the tuning seeds (apart from --seeds)")
    ap.add_argument("--tune-staged", action="store_true",
                    help="--tune: the lr on each optimizer's DDP arm, then the DiLoCo arms' outer pairs at that lr")
    ap.add_argument("--reuse", type=Path, action="append", default=[], metavar="JSON",
                    help="take each (arm, seed) an earlier study's JSON holds at this study's settings instead of "
                         "running it again (a study cut short goes on; a new arm runs beside saved baselines); "
                         "repeatable")
    ap.add_argument("--tune-from", type=Path,
                    help="--tune: take the (point, seed) runs an earlier run's -tune.json holds")
    # 3e-2: at 20 steps Muon's best of 3e-3 and 1e-2 was the top one (docs/learning.md, "Muon")
    ap.add_argument("--tune-lrs", default="1e-3,3e-3,1e-2,3e-2", help="--tune: optim.lr values")
    ap.add_argument("--tune-outer", default="1.0/0,0.7/0.9,0.7/0.5",
                    help="--tune: the DiLoCo arms' outer lr/momentum pairs (nesterov)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "learning")
    args = ap.parse_args(argv)
    args.data = args.data or CORPORA[args.corpus]
    args.steps = args.steps or (400 if args.sweep_h else 120)
    if not args.data.exists():
        ap.error(f"--corpus {args.corpus}: {args.data} is missing (build it: python scripts/make_corpus.py "
                 f"--sources)")
    args.outer = {k: v for k, v in (("inner_steps", args.inner_steps), ("outer_optimizer", args.outer_optimizer),
                                    ("outer_lr", args.outer_lr),
                                    ("outer_momentum", args.outer_momentum), ("outer_warmup", args.outer_warmup))
                  if v is not None}
    args.compressions = [c for c in args.compressions.split(",") if c and c != "none"]
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else [args.seed]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if not args.seeds:
        ap.error("--seeds: no seed given")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    if args.poison and args.engine != "mesh":
        ap.error("--poison needs --engine mesh: the sentinel and the poisoned node are the engine's")
    if args.overlap and args.engine == "sim" and args.overlap_delay == 0:
        ap.error("--overlap-delay 0 (land when done) needs --engine mesh: the sim lands at a fixed step, 1 to H")
    try:
        args.overlap_h = [int(x) for x in args.overlap_h.split(",") if x.strip()]
        args.eager_lrs = [float(x) for x in args.eager_lrs.split(",") if x.strip()]
        args.overlap_lrs = [float(x) for x in args.overlap_lrs.split(",") if x.strip()]
        args.overlap_after = [int(x) for x in args.overlap_after.split(",") if x.strip()]
        args.fragments_h = [int(x) for x in args.fragments_h.split(",") if x.strip()]
        args.fragments_p = [int(x) for x in args.fragments_p.split(",") if x.strip()]
        first, _, last = (args.poison_rounds or "").partition("-")
        args.poison_rounds = (int(first), int(last or first)) if args.poison_rounds else None
    except ValueError:
        ap.error(f"--overlap-h {args.overlap_h!r} / --overlap-lrs / --overlap-after / --fragments-h / --fragments-p / "
                 f"--poison-rounds {args.poison_rounds!r}: expected numbers (5,20 and FIRST-LAST)")
    if args.overlap_after and args.engine != "sim":
        ap.error(f"--overlap-after {','.join(map(str, args.overlap_after))} needs --engine sim: it counts inner "
                 f"steps, a study of where overlap's cost accrues (the engine's diloco.overlap_after counts outer "
                 f"steps)")
    if args.jobs > 1 and args.engine != "sim":
        ap.error(f"--jobs {args.jobs} needs --engine sim (a mesh arm already runs k engine processes and a store)")
    if args.optimizer == "muon" and any((args.sweep, args.sweep_h, args.overlap, args.fragments, args.poison)):
        ap.error("--optimizer muon is a study of its own: without --sweep, --sweep-h, --overlap, --fragments, --poison")
    if args.tune and args.optimizer != "muon" and not args.sparse:
        ap.error("--tune needs --optimizer muon or --sparse")
    if (args.sparse_axes or args.sparse_betas) and not args.sparse_sweep:
        ap.error(f"{'--sparse-axes' if args.sparse_axes else '--sparse-betas'} goes with --sparse-sweep")
    args.sparse = args.sparse or args.sparse_sweep
    if (args.tune_staged or args.tune_from) and not args.tune:
        ap.error(f"--tune-{'staged' if args.tune_staged else 'from'} needs --tune")
    for path in args.reuse:
        if not path.is_file():
            ap.error(f"--reuse {path}: no such file (an earlier study's JSON)")
    if args.tune_from and not args.tune_from.is_file():
        ap.error(f"--tune-from {args.tune_from}: no such file (an earlier --tune run's -tune.json)")
    try:
        args.muon_h = [int(x) for x in args.muon_h.split(",") if x.strip()]
        args.tune_seeds = [int(x) for x in args.tune_seeds.split(",") if x.strip()]
        args.tune_lrs = [float(x) for x in args.tune_lrs.split(",") if x.strip()]
        args.tune_outer = [tuple(float(v) for v in pair.split("/")) for pair in args.tune_outer.split(",")
                           if pair.strip()]
    except ValueError:
        ap.error(f"--muon-h {args.muon_h!r} / --tune-seeds / --tune-lrs / --tune-outer {args.tune_outer!r}: expected "
                 f"comma-separated numbers (outer pairs as LR/MOMENTUM)")
    if args.tune and (set(args.tune_seeds) & set(args.seeds) or not args.tune_seeds):
        ap.error(f"--tune-seeds {','.join(map(str, args.tune_seeds))}: give tuning seeds apart from --seeds "
                 f"{','.join(map(str, args.seeds))} (a setting picked on a seed flatters it there)")
    if any(len(pair) != 2 for pair in args.tune_outer):
        ap.error(f"--tune-outer: expected LR/MOMENTUM pairs, got {args.tune_outer}")
    bad = [(h, p) for h in args.fragments_h for p in args.fragments_p if p < 2 or h % p]
    if args.fragments and bad:
        ap.error(f"--fragments-p: each fragment count must be at least 2 and divide every H of --fragments-h "
                 f"(not {bad[0][1]} for H = {bad[0][0]})")
    if args.sparse:
        parse_sparse(ap, args, argv if argv is not None else sys.argv[1:])
    return args


def parse_sparse(ap, args, argv) -> None:
    """--sparse / --sparse-sweep's flags, checked: one line naming the flag and the value. The study's scale unless
    flags say otherwise: 400 inner steps per worker (20 outer steps at H = 20), micro-batch 4 x 64 (half the scale of
    tests/test_learning.py; 4 arms of one seed take ~9 minutes of one idle core: 0.08 s a worker step)."""
    from engine.outer.sparse import SparseSpec
    given = {a.split("=")[0] for a in argv}
    args.steps = args.steps if "--steps" in given else SPARSE_STEPS
    args.seq_len = args.seq_len if "--seq-len" in given else SPARSE_SEQ_LEN
    args.micro_batch = args.micro_batch if "--micro-batch" in given else SPARSE_MICRO_BATCH
    if args.engine != "sim":
        ap.error("--sparse needs --engine sim: diloco.compression = \"sparse\" is not in the engine yet "
                 "(docs/sparse.md)")
    if args.tune and args.sparse_sweep:
        ap.error("--tune goes with --sparse (the headline arms), not --sparse-sweep")
    d = SparseSpec()
    for key, default in (("sparse_chunk", d.chunk), ("density", d.density), ("sparse_bits", d.bits),
                         ("sparse_beta", d.beta)):
        if getattr(args, key) is None:
            setattr(args, key, default)
    try:
        SparseSpec(args.sparse_chunk, args.density, args.sparse_bits, args.sparse_beta)
    except ValueError as e:
        ap.error(f"--sparse-chunk/--density/--sparse-bits/--sparse-beta: {e}")
    lists = {"--sparse-h": ("sparse_h", int), "--sparse-densities": ("sparse_densities", float),
             "--sparse-bits-sweep": ("sparse_bits_sweep", int), "--sparse-betas": ("sparse_betas", float),
             "--tune-outer-lrs": ("tune_outer_lrs", float),
             "--tune-momenta": ("tune_momenta", float), "--tune-betas": ("tune_betas", float)}
    for flag, (key, kind) in lists.items():
        raw = getattr(args, key)
        if not isinstance(raw, str):
            continue
        try:
            setattr(args, key, [kind(x) for x in raw.split(",") if x.strip()])
        except ValueError:
            ap.error(f"{flag} {raw!r}: expected comma-separated {kind.__name__} values")
        if not getattr(args, key) and key != "sparse_betas":
            ap.error(f"{flag}: no value given")
    if any(h < 1 or h > args.steps for h in args.sparse_h):
        ap.error(f"--sparse-h {args.sparse_h}: each H must be 1 to --steps {args.steps}")
    for dens in args.sparse_densities:
        for bits in args.sparse_bits_sweep:
            try:
                SparseSpec(args.sparse_chunk, dens, bits, args.sparse_beta)
            except ValueError as e:
                ap.error(f"--sparse-densities/--sparse-bits-sweep: {e}")
    for beta in args.sparse_betas:
        try:
            SparseSpec(args.sparse_chunk, args.density, args.sparse_bits, beta)
        except ValueError as e:
            ap.error(f"--sparse-betas: {e}")


def run_arms(args, arms: list[Arm], save, done=None) -> list[list[Result]]:
    """Every arm once per seed (those in done, by (name, seed), taken from it); save(results so far) after each
    arm, so a long study keeps what it measured."""
    per_seed: list[list[Result]] = []
    with tempfile.TemporaryDirectory(prefix="zb-learning-") as tmp:
        for seed in args.seeds:
            run_args = argparse.Namespace(**{**vars(args), "seed": seed})
            rs: list[Result] = []
            per_seed.append(rs)
            for arm in arms:
                taken = (done or {}).get((arm.name, seed))
                try:
                    r = taken if taken is not None else \
                        run_mesh(run_args, arm, Path(tmp)) if args.engine == "mesh" else run_sim(run_args, arm)
                except ArmFailed as e:
                    if arm.poison is None:
                        raise SystemExit(f"learning: {e}") from None
                    # a poisoned run without the sentinel may diverge: that is the damage it measures
                    print(f"learning: {e}", file=sys.stderr, flush=True)
                    r = Result(arm, float("nan"), 0.0, 0, seed=seed, failed=str(e).splitlines()[-1][:200])
                rs.append(r)
                print(f"  {arm.name:<30} seed {seed:<6} eval {r.eval_loss:.4f}  {r.wall_s:6.1f} s"
                      + (f"  failed: {r.failed}" if r.failed else ""), flush=True)
                save([r for rs_ in per_seed for r in rs_])
            by = {r.arm.name: r for r in rs}
            if len(args.seeds) > 1:
                print(f"seed {seed}:")
            print(table(rs, by.get("ddp") or by.get("ddp-adamw"), by.get("single")))
    return per_seed


def _job_init(threads: int) -> None:
    """--jobs: a worker of its own session (so its own scheduler autogroup: a share of the CPU beside the study's
    other workers, not a slice of one) at the study's autogroup nice (a study started deprioritised stays so: a new
    autogroup starts at nice 0), gone with the study (PR_SET_DEATHSIG), at the study's torch threads."""
    import ctypes

    import torch
    nice = _autogroup_nice()
    os.setsid()
    if nice:
        _set_autogroup_nice(nice)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    torch.set_num_threads(threads)


AUTOGROUP = Path("/proc/self/autogroup")  # the scheduler autogroup of the process that reads it


def _autogroup_nice() -> int:
    """This process's autogroup nice ("/autogroup-123 nice 10"); 0 where the kernel has no autogroups."""
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return 0


def _set_autogroup_nice(nice: int) -> None:
    """Set this process's autogroup nice; the kernel refuses changes closer than 0.1 s apart machine-wide (EAGAIN),
    so a few tries. Raising it needs no privilege; a kernel that refuses leaves the worker at nice 0 and says so."""
    import time
    for _ in range(20):
        try:
            AUTOGROUP.write_text(f"{nice}\n")
            return
        except BlockingIOError:
            time.sleep(0.11)
        except OSError as e:
            print(f"learning: --jobs worker: autogroup nice {nice} not set ({e})", file=sys.stderr, flush=True)
            return
    print(f"learning: --jobs worker: autogroup nice {nice} not set (busy)", file=sys.stderr, flush=True)


def _job(run_args, arm: Arm) -> Result:
    return run_sim(run_args, arm)


def run_arms_jobs(args, arms: list[Arm], save, done=None) -> list[list[Result]]:
    """run_arms for --engine sim with --jobs N: every (seed, arm) in a pool of N processes, at most N at once;
    what each arm computes does not depend on the process (its own seed, data order and init), so the results are
    run_arms's, in its order; each arm is printed and saved as it ends, each seed's table once all its arms have."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    per_seed: list[list[Result | None]] = [[(done or {}).get((arm.name, seed)) for arm in arms] for seed in args.seeds]
    save([r for rs in per_seed for r in rs if r is not None])
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_job_init,
                             initargs=(args.threads,)) as pool:
        futures = {pool.submit(_job, argparse.Namespace(**{**vars(args), "seed": seed}), arm): (i, j)
                   for i, seed in enumerate(args.seeds) for j, arm in enumerate(arms) if per_seed[i][j] is None}
        for future in as_completed(futures):
            i, j = futures[future]
            r = per_seed[i][j] = future.result()
            print(f"  {r.arm.name:<30} seed {r.seed:<6} eval {r.eval_loss:.4f}  {r.wall_s:6.1f} s", flush=True)
            save([r for rs in per_seed for r in rs if r is not None])
    for rs in per_seed:
        by = {r.arm.name: r for r in rs}
        if len(args.seeds) > 1:
            print(f"seed {rs[0].seed}:")
        print(table(rs, by.get("ddp") or by.get("ddp-adamw"), by.get("single")))
    return per_seed


# the study settings an arm's result depends on besides its Arm (--reuse compares them; threads: the order of a
# CPU matmul's sums)
RESULT_KEYS = ("engine", "data", "preset", "seq_len", "micro_batch", "steps", "lr", "warmup", "eval_interval",
               "eval_batches", "device", "threads")


def reusable(args) -> dict[tuple[str, int], Result]:
    """--reuse: the (arm name, seed) results earlier studies saved, refused in one line where a study setting an
    arm's result depends on differs (the file, the key, both values)."""
    out: dict[tuple[str, int], Result] = {}
    for path in args.reuse:
        saved = json.loads(path.read_text())
        for key in RESULT_KEYS:
            if saved["args"].get(key) != str(getattr(args, key)):
                raise SystemExit(f"learning: --reuse {path}: its {key} is {saved['args'].get(key)}, this study's "
                                 f"{getattr(args, key)}: its results are not this study's")
        out.update({(r.arm.name, r.seed): r for r in results_of(saved) if not r.failed})
    return out


def run_study_arms(args, arms: list[Arm], save) -> list[list[Result]]:
    """Every arm once per seed (--jobs: in a pool), an (arm, seed) that --reuse holds with the same Arm taken from
    it."""
    by_name = {a.name: a for a in arms}
    done = {key: r for key, r in reusable(args).items() if by_name.get(key[0]) == r.arm}
    if done:
        print(f"taking {len(done)} (arm, seed) results from {', '.join(map(str, args.reuse))}", flush=True)
    return run_arms_jobs(args, arms, save, done) if args.jobs > 1 else run_arms(args, arms, save, done)


def worst(means: dict[str, float], names: list[str]) -> float:
    """The largest of these arms' mean ratios; nan (a failed or diverged run) counts as the worst."""
    import math
    got = [means[n] for n in names if n in means]
    return float("nan") if not got or any(math.isnan(x) for x in got) else max(got)


def conclude(args, per_seed: list[list[Result]]) -> None:
    """The closing lines: a study's ratios to its baselines, the sentinel's count, and the last line."""
    if args.sparse:
        return sparse_conclude(args, per_seed)
    by = {r.arm.name: r for r in per_seed[-1]}
    results = [r for rs in per_seed for r in rs]
    ratios = None
    paired_study = args.overlap or args.poison or args.fragments or args.optimizer == "muon"
    if len(args.seeds) > 1 and not paired_study:
        text, ratios = spread(per_seed)
        print(f"over {len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}):")
        print(text)
    means: dict[str, float] = {}
    if paired_study:
        text, means = paired(per_seed)
        print(f"each arm's eval loss / its baseline's, same seed ({', '.join(map(str, args.seeds))}):")
        print(text)
    if args.engine == "mesh":
        print(sentinel_report(results))
    if args.overlap:
        print("each seed's ratio to the synchronous run of that seed, and their spread:")
        print(overlap_spread(per_seed, args.overlap_h))
        for h in args.overlap_h:  # the arms this study ran: the updates, then the levers (lr, after N)
            named = {f"overlap H{h}": "overlap/sync", f"eager H{h}": "eager/sync", f"projected H{h}": "projected/sync",
                     f"round-late H{h}": "landing a round late"}
            levers = [n for n in means if n.startswith((f"overlap H{h} ", f"eager H{h} "))]
            print(f"H = {h}, landing {min(args.overlap_delay, h)} step(s) in: "
                  + ", ".join([f"{label} {means[n]:.4f}" for n, label in named.items() if n in means]
                              + [f"{n}/sync {means[n]:.4f}" for n in levers]))
        ovl = worst(means, [f"overlap H{h}" for h in args.overlap_h])
        eager = worst(means, [f"eager H{h}" for h in args.overlap_h])
        late = worst(means, [f"round-late H{h}" for h in args.overlap_h])
        print(f"overlap/sync eval-loss ratio {ovl:.4f}; eager {eager:.4f}; a round late {late:.4f}")
        return
    if args.optimizer == "muon":
        nan = float("nan")
        for h in args.muon_h:
            print(f"H = {h}: diloco-muon/ddp-adamw {means.get(f'diloco-muon H{h}', nan):.4f}, diloco-adamw/ddp-adamw "
                  f"{means.get(f'diloco-adamw H{h}', nan):.4f}")
        r1 = worst(means, [f"diloco-muon H{h}" for h in args.muon_h])
        print(f"muon: diloco-muon/ddp-adamw eval-loss ratio {r1:.4f}; ddp-muon/ddp-adamw "
              f"{means.get('ddp-muon', nan):.4f}")
        return
    if args.fragments:
        names = [f"fragments {p} H{h}" for h in args.fragments_h for p in args.fragments_p]
        print(f"fragments/sync eval-loss ratio {worst(means, names):.4f}")
        return
    if args.poison:
        on = worst(means, ["x100 sentinel on", "flip sentinel on"])
        off = worst(means, ["x100 sentinel off", "flip sentinel off"])
        print(f"poisoned/clean eval-loss ratio {on:.4f} with the sentinel; {off:.4f} without")
        return
    d = by.get("diloco") or next((r for r in per_seed[-1] if r.arm.kind == "diloco"), None)
    if d and "ddp" in by and "single" in by:
        r1, r2 = ratios[d.arm.name] if ratios else (d.eval_loss / by["ddp"].eval_loss,
                                                    d.eval_loss / by["single"].eval_loss)
        if len(args.seeds) == 1 and args.device == "cpu":
            print("one seed: at CPU scale these ratios move by about 3% with the seed (docs/learning.md, \"Batch per "
                  "worker\"); --seeds 1337,7,11,23 gives their mean")
        print(f"diloco/ddp eval-loss ratio {r1:.3f}; diloco/single {r2:.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    study = {"sparse_sweep": sparse_sweep_arms, "sparse": sparse_arms, "sweep": sweep_arms,
             "sweep_h": h_sweep_arms, "overlap": overlap_arms, "fragments": fragment_arms, "poison": poison_arms}
    if args.optimizer == "muon":
        study["muon"] = muon_arms
    chosen = next((name for name in study if name == "muon" or getattr(args, name, False)), None)
    arms = study[chosen](args) if chosen else default_arms(args)
    if args.arms:
        unknown = sorted(set(args.arms) - {a.name for a in arms})
        if unknown:
            raise SystemExit(f"learning: --arms {','.join(unknown)}: no such arm (arms: "
                             f"{', '.join(a.name for a in arms)})")
        arms = [a for a in arms if a.name in args.arms or a.name in {b.baseline for b in arms if b.name in args.arms}]
    args.out.mkdir(parents=True, exist_ok=True)
    kind = f"-{chosen.replace('_', '-')}" if chosen else ""
    kind += "-seeds" if len(args.seeds) > 1 else ""
    stem = f"learning-{args.corpus if args.data == CORPORA[args.corpus] else 'custom'}{kind}"

    def save(results: list[Result], suffix: str = "") -> None:
        (args.out / f"{stem}{suffix}.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()},
             "results": [{**asdict(r), "arm": asdict(r.arm)} for r in results]}, indent=1))

    if args.tune:
        arms = (sparse_tune if args.sparse else tune_arms)(args, arms, lambda results: save(results, "-tune"))
    per_seed = run_study_arms(args, arms, save)
    title = (f"{args.preset}, {args.data.name}, {args.steps} inner steps/worker, micro-batch {args.micro_batch} x "
             f"{args.seq_len}, engine {args.engine}, seed{'s' if len(args.seeds) > 1 else ''} "
             f"{', '.join(map(str, args.seeds))}")
    if chosen == "muon":
        muon_plot(per_seed, args.out / f"{stem}.png", title)
    else:
        plot([r for rs in per_seed for r in rs if not r.failed], args.out / f"{stem}.png", title)
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    conclude(args, per_seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
