"""DiLoCo learns: with the shipped outer settings, k=4 nodes beat one worker at equal steps and stay within a stated
margin of the DDP-equivalent at equal tokens (docs/learning.md has the full study, bench/learning.py runs it).

The ordering test runs the study's in-process engine (the engine's own model, data, AdamW, schedule and
OuterOptimizer; deterministic on one thread), at the smallest scale that still separates the arms. The second test
shows that engine reproduces the real one: two engine processes over the real store and gloo end at the same held-out
loss as the in-process replica of the same run.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from procs import ROOT, spawned_ranks

sys.path.insert(0, str(ROOT / "bench"))
import learning  # noqa: E402

# The smallest scale that still separates the arms: a quarter of the bench's default tokens per worker step
# (sequences of 64, micro-batch 8; docs/learning.md, "Batch per worker"), which runs in a quarter of the time.
# Measured there: single 2.767, DDP-equivalent 2.503, the shipped DiLoCo (H=5, the plain mean) 2.654 (1.060x DDP:
# at this batch the k-times batch of DDP still pays off in full), the old default (Nesterov 0.7/0.9) 3.076 (1.229x
# DDP, 1.112x single). The single margin fails the old default, and so does the DDP margin; the issue's 1.01x goal
# is judged at the bench's default scale, over several seeds (docs/learning.md, "Against the goals").
DDP_MARGIN = 1.08  # DiLoCo k=4 eval loss at most this times the DDP-equivalent's
SINGLE_MARGIN = 0.98  # and at most this times the single worker's


def small_args(*extra: str):
    return learning.parse_args(["--engine", "sim", "--eval-interval", "0", "--seq-len", "64", "--micro-batch", "8",
                                *extra])


def _arms_on_one_core(rank: int, port: int, queue) -> None:
    """One of two spawned processes (one per core): rank 0 trains the DiLoCo arm, rank 1 the single worker and the
    DDP-equivalent (about the same work: 4 and 1 + 4 worker-steps per step)."""
    import pickle
    import traceback

    import torch
    torch.set_num_threads(1)
    try:
        args = small_args()
        arms = [learning.default_arms(args)[2]] if rank == 0 else \
            [learning.Arm("single", "single"), learning.Arm("ddp", "ddp", k=4)]
        queue.put((rank, pickle.dumps([learning.run_sim(args, arm) for arm in arms])))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


@pytest.mark.slow
def test_diloco_with_shipped_defaults_beats_single_and_tracks_ddp():
    got = spawned_ranks(_arms_on_one_core, 2, timeout=600)
    (diloco,), (single, ddp) = got[0], got[1]
    assert diloco.arm.kind == "diloco" and diloco.arm.k == 4
    assert ddp.eval_loss < single.eval_loss * 0.95, "the scale no longer separates DDP from a single worker"
    assert diloco.eval_loss < single.eval_loss * SINGLE_MARGIN, (diloco.eval_loss, single.eval_loss)
    assert diloco.eval_loss < ddp.eval_loss * DDP_MARGIN, (diloco.eval_loss, ddp.eval_loss)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_in_process_study_engine_reproduces_the_real_mesh(tmp_path, optimizer):
    """The sweep's engine is only worth its numbers if it computes what the engines compute: two real engine
    processes over the real store and gloo, and the in-process replica, end at the same held-out loss (with either
    inner optimizer: the Muon study runs in-process)."""
    args = learning.parse_args(["--steps", "12", "--seq-len", "32", "--micro-batch", "4", "--warmup", "2",
                                "--eval-batches", "4", "--eval-interval", "0", "--arm-timeout", "240"])
    arm = learning.Arm("diloco", "diloco", k=2, inner_steps=4, outer_lr=0.8, outer_momentum=0.5, optimizer=optimizer)
    real = learning.run_mesh(args, arm, tmp_path)
    replica = learning.run_sim(args, arm)
    assert real.bytes_sent > 0 and len(real.curve) == 1
    # the same arithmetic up to the order of fp32 sums inside the all-reduce
    assert abs(real.eval_loss - replica.eval_loss) < 2e-3, (real.eval_loss, replica.eval_loss)
    # and not trivially: the outer steps moved the model away from a single worker's
    single = learning.run_sim(args, learning.Arm("single", "single"))
    assert abs(single.eval_loss - replica.eval_loss) > 1e-2


@pytest.mark.slow
def test_in_process_fragments_reproduce_the_engines_fragments(tmp_path):
    """bench/learning.py SimFragments computes what diloco.fragments computes: one fragment per H / P steps, in the
    background for fragment_delay steps, mixed with fragment_alpha, and every fragment synced whole at the run's
    last step."""
    args = learning.parse_args(["--steps", "10", "--seq-len", "32", "--micro-batch", "4", "--warmup", "2",
                                "--eval-batches", "4", "--eval-interval", "0", "--arm-timeout", "240"])
    sync = learning.Arm("diloco", "diloco", k=2, inner_steps=4, outer_lr=0.8, outer_momentum=0.5)
    streamed = learning.replace(sync, fragments=2, fragment_alpha=0.5, fragment_delay=1)
    real = learning.run_mesh(args, streamed, tmp_path)
    replica = learning.run_sim(args, streamed)
    unmixed = learning.run_sim(args, learning.replace(streamed, fragment_alpha=0.0))
    whole = learning.run_sim(args, sync)
    print(f"fragments: engines {real.eval_loss:.6f}, in-process {replica.eval_loss:.6f}, alpha 0 "
          f"{unmixed.eval_loss:.6f}, synchronous {whole.eval_loss:.6f}")
    # two nodes: the mean of two fp32 values is exact in any order, so the engines agree to ~1e-6 (seen: equal to six
    # digits), far inside what a wrong mix (alpha 0: 3.4e-3), no delay (5.8e-4) or no fragments (2.3e-4) move it by
    assert abs(real.eval_loss - replica.eval_loss) < 5e-5, (real.eval_loss, replica.eval_loss)
    assert abs(unmixed.eval_loss - replica.eval_loss) > 1e-3 and abs(whole.eval_loss - replica.eval_loss) > 1e-4
    assert real.outer_steps == 6  # steps 2, 4, ..., 10, and the other fragment at the end


@pytest.mark.slow
def test_in_process_overlap_reproduces_the_engines_overlap(tmp_path):
    """The in-process engine's overlap (bench/learning.py SimOverlap) computes what diloco.overlap computes with its
    default update: the anchors and the landing one step into the next round with the progress carried over. (The
    eager update's working weights are checked against hand arithmetic in tests/test_overlap_eager.py.)"""
    args = learning.parse_args(["--steps", "8", "--seq-len", "32", "--micro-batch", "4", "--warmup", "2",
                                "--eval-batches", "4", "--eval-interval", "0", "--arm-timeout", "240"])
    sync = learning.Arm("diloco", "diloco", k=2, inner_steps=2, outer_lr=0.8, outer_momentum=0.5)
    overlapped = learning.replace(sync, overlap=True, overlap_update="delayed", overlap_delay=1)
    real = learning.run_mesh(args, overlapped, tmp_path)
    replica = learning.run_sim(args, overlapped)
    assert abs(real.eval_loss - replica.eval_loss) < 2e-3, (real.eval_loss, replica.eval_loss)
    # and not trivially: the late update moved the model away from the synchronous run's
    assert abs(learning.run_sim(args, sync).eval_loss - replica.eval_loss) > 2e-3


def test_outer_momentum_in_a_short_run_is_warned_about_once_configs_say_so():
    from engine.config import load_config
    from engine.outer.build import SHORT_RUN_OUTER_STEPS, short_run_note

    def note(path, **over):
        return short_run_note(load_config(ROOT / "configs" / path, [f"--{k}={v}" for k, v in over.items()]))

    # the shipped short config is quiet; the paper's momentum in it is not
    assert note("debug-diloco.toml") is None
    warned = note("debug-diloco.toml", **{"diloco.outer_momentum": 0.9, "diloco.outer_lr": 0.7})
    assert warned is not None and "10 outer steps" in warned and "docs/learning.md" in warned
    # the long presets keep the paper's setting without a warning (176 and 880 outer steps)
    assert note("150m-diloco.toml") is None and note("1b-diloco.toml") is None
    # the threshold is in outer steps: the same momentum is quiet once the run is long enough
    steps = 5 * SHORT_RUN_OUTER_STEPS
    assert note("debug-diloco.toml", **{"diloco.outer_momentum": 0.9, "train.max_steps": steps}) is None
    assert note("debug-diloco.toml", **{"diloco.outer_momentum": 0.9, "train.max_steps": steps - 5}) is not None


def test_the_seed_spread_takes_each_ratio_within_its_seed():
    """`--seeds`: a ratio is taken inside one seed (the arms of a seed share init, data order and held-out batches),
    then averaged; the mean of the losses' ratio would be a different, wrong number."""
    def seed(single, ddp, diloco):
        return [learning.Result(learning.Arm(n, n.split()[0]), loss, 1.0, 1)
                for n, loss in (("single", single), ("ddp", ddp), ("diloco", diloco))]

    text, means = learning.spread([seed(3.0, 2.0, 2.2), seed(4.0, 3.0, 2.7)])
    vs_ddp, vs_single = means["diloco"]
    assert vs_ddp == pytest.approx((2.2 / 2.0 + 2.7 / 3.0) / 2)  # 1.000, while 4.9 / 5.0 would be 0.98
    assert vs_single == pytest.approx((2.2 / 3.0 + 2.7 / 4.0) / 2)
    assert means["ddp"][0] == pytest.approx(1.0)
    row = next(line for line in text.splitlines() if line.startswith("diloco"))
    assert row.split()[1:3] == ["2", "2.4500"] and row.split()[4:7] == ["0.141", "0.900", "1.100"]


def test_seeds_and_arms_are_checked_before_anything_runs():
    with pytest.raises(SystemExit):
        learning.parse_args(["--seeds", "1,x"])
    args = learning.parse_args(["--seeds", "3, 5", "--arms", "single,ddp"])
    assert args.seeds == [3, 5] and args.arms == ["single", "ddp"]
    assert learning.parse_args([]).seeds == [1337]


@pytest.mark.slow
def test_jobs_run_the_same_arms_in_processes_of_their_own(tmp_path, capsys):
    """`--jobs 2` (the in-process engine's arms in a pool of processes, each in a session of its own) ends every arm,
    tuning grid included, at the loss one process gives it, in the same order; a mesh study refuses it."""
    import json
    with pytest.raises(SystemExit) as exit_:
        learning.parse_args(["--jobs", "2"])
    assert exit_.value.code == 2 and "--jobs 2 needs --engine sim" in capsys.readouterr().err
    runs = {}
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        assert learning.main(["--engine", "sim", "--optimizer", "muon", "--muon-h", "2", "--arms", "diloco-muon H2",
                              "--tune", "--tune-seeds", "3", "--tune-lrs", "3e-3,1e-2", "--tune-outer", "1.0/0",
                              "--steps", "4", "--seq-len", "32", "--micro-batch", "2", "--eval-batches", "2",
                              "--eval-interval", "0", "--seeds", "1,2", "--jobs", jobs, "--out", str(out)]) == 0
        runs[jobs] = [[(r["arm"]["name"], r["seed"], r["arm"]["lr"], r["eval_loss"])
                       for r in json.loads((out / f"learning-docstrings-muon-seeds{suffix}.json").read_text())[
                           "results"]] for suffix in ("-tune", "")]
    assert len(runs["1"][0]) == 4 and len(runs["1"][1]) == 4  # 2 arms x 2 lrs on seed 3; 2 arms x 2 seeds
    assert runs["2"] == runs["1"]
    assert [r[:2] for r in runs["1"][1]] == [("ddp-adamw", 1), ("diloco-muon H2", 1), ("ddp-adamw", 2),
                                             ("diloco-muon H2", 2)]


def test_reuse_takes_the_saved_runs_of_the_same_settings_and_runs_only_the_rest(tmp_path, capsys, monkeypatch):
    """`--reuse JSON`: an (arm, seed) an earlier study saved with the same Arm and study settings is taken, not run
    again, with --jobs and without; another setting (--steps) is refused in one line naming the file and the key."""
    import json
    tiny = ["--engine", "sim", "--overlap", "--overlap-h", "2", "--steps", "4", "--seq-len", "32", "--micro-batch", "2",
            "--eval-batches", "2", "--eval-interval", "0", "--k", "2"]
    first = tmp_path / "first"
    assert learning.main([*tiny, "--arms", "overlap H2", "--seeds", "1,2", "--out", str(first)]) == 0
    saved = first / "learning-docstrings-overlap-seeds.json"
    before = {(r["arm"]["name"], r["seed"]): r["eval_loss"] for r in json.loads(saved.read_text())["results"]}
    assert set(before) == {("sync H2", 1), ("overlap H2", 1), ("sync H2", 2), ("overlap H2", 2)}
    ran = []
    real = learning.run_sim
    monkeypatch.setattr(learning, "run_sim", lambda a, arm: ran.append((arm.name, a.seed)) or real(a, arm))
    again = tmp_path / "again"
    assert learning.main([*tiny, "--arms", "overlap H2,eager H2", "--seeds", "1,2,3", "--reuse", str(saved),
                          "--out", str(again)]) == 0
    assert ran == [("eager H2", 1), ("eager H2", 2), ("sync H2", 3), ("overlap H2", 3), ("eager H2", 3)]
    after = {(r["arm"]["name"], r["seed"]): r["eval_loss"]
             for r in json.loads((again / "learning-docstrings-overlap-seeds.json").read_text())["results"]}
    assert {k: after[k] for k in before} == before and len(after) == 9
    assert "taking 4 (arm, seed) results from" in capsys.readouterr().out
    # --jobs: the pool runs only what is missing (none here: every run of seeds 1-3 is saved now)
    both = again / "learning-docstrings-overlap-seeds.json"
    jobs = tmp_path / "jobs"
    assert learning.main([*tiny, "--arms", "overlap H2,eager H2", "--seeds", "1,2,3", "--reuse", str(both),
                          "--jobs", "2", "--out", str(jobs)]) == 0
    walls = {(r["arm"]["name"], r["seed"]): (r["eval_loss"], r["wall_s"])  # a run again would have its own wall_s
             for r in json.loads(both.read_text())["results"]}
    assert {(r["arm"]["name"], r["seed"]): (r["eval_loss"], r["wall_s"])
            for r in json.loads((jobs / "learning-docstrings-overlap-seeds.json").read_text())["results"]} == walls
    with pytest.raises(SystemExit, match=rf"^learning: --reuse {re.escape(str(saved))}: its steps is 4, this "
                                         r"study's 6: its results are not this study's$"):
        learning.main([*tiny, "--steps", "6", "--seeds", "1", "--reuse", str(saved), "--out", str(tmp_path / "x")])


_AUTOGROUP_STUDY = """
import multiprocessing, os, sys
from concurrent.futures import ProcessPoolExecutor
sys.path.insert(0, sys.argv[1])
import learning


def worker():
    return learning._autogroup_nice(), os.getsid(0) == os.getpid()


if __name__ == "__main__":
    os.setsid()  # an autogroup of its own, so that the test's own (and its shell's) stays as it is
    learning._set_autogroup_nice(int(sys.argv[2]))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=learning._job_init,
                             initargs=(1,)) as pool:
        print(*pool.submit(worker).result())
"""


@pytest.mark.parametrize("nice", [0, 7])
def test_a_jobs_worker_keeps_the_studys_autogroup_nice(tmp_path, nice):
    """--jobs: each worker leads a session of its own, so an autogroup of its own, which the kernel starts at nice 0;
    it takes the study's (a study started deprioritised, `echo 10 > /proc/$$/autogroup`, stays so)."""
    import subprocess
    script = tmp_path / "study.py"
    script.write_text(_AUTOGROUP_STUDY)
    r = subprocess.run([sys.executable, str(script), str(ROOT / "bench"), str(nice)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    # a kernel without autogroups: the worker's own session still, at nice 0 (there is none to keep)
    assert r.stdout.split() == [str(nice if learning.AUTOGROUP.exists() else 0), "True"]


def test_without_autogroups_a_jobs_worker_reads_nice_0_and_sets_nothing(tmp_path, monkeypatch, capsys):
    """A kernel without scheduler autogroups (no /proc/self/autogroup): the study reads nice 0 and a worker's set
    says in one line that it did not take, instead of failing the study."""
    monkeypatch.setattr(learning, "AUTOGROUP", tmp_path / "missing" / "autogroup")
    assert learning._autogroup_nice() == 0
    learning._set_autogroup_nice(7)
    assert capsys.readouterr().err.startswith("learning: --jobs worker: autogroup nice 7 not set (")


def test_muon_tuning_staged_takes_each_optimizers_lr_from_its_ddp_arm_and_reuses_earlier_points(tmp_path,
                                                                                                 monkeypatch):
    """`--tune --tune-staged`: the DDP arms over the lrs, then each DiLoCo arm over the outer pairs at the lr its
    optimizer's DDP arm chose; `--tune-from`: a (point, seed) an earlier run saved is not run again."""
    import json
    from dataclasses import asdict
    loss = {"ddp-adamw lr0.003": 2.8, "ddp-adamw lr0.01": 3.0, "ddp-muon lr0.003": 2.6, "ddp-muon lr0.01": 2.5}
    ran = []

    def fake_run(args, arms, save):  # eval loss: the table above, else lr + outer lr (the lowest of both wins)
        ran.extend(a.name for a in arms)
        return [[learning.Result(a, loss.get(a.name, a.lr + a.outer_lr), 1.0, 1, seed=s) for a in arms]
                for s in args.seeds]
    monkeypatch.setattr(learning, "run_study_arms", fake_run)
    earlier = tmp_path / "earlier-tune.json"
    reused = learning.Result(learning.Arm("ddp-adamw lr0.003", "ddp", k=4, lr=3e-3), 2.8, 1.0, 1, seed=101)
    earlier.write_text(json.dumps({"results": [{**asdict(reused), "arm": asdict(reused.arm)}]}))
    args = learning.parse_args(["--engine", "sim", "--optimizer", "muon", "--tune", "--tune-staged", "--tune-seeds",
                                "101", "--tune-lrs", "3e-3,1e-2", "--tune-outer", "1.0/0,0.5/0.5", "--muon-h", "5",
                                "--tune-from", str(earlier)])
    saved = []
    chosen = learning.tune_arms(args, learning.muon_arms(args), saved.append)
    assert [(a.name, a.lr, a.outer_lr, a.baseline) for a in chosen] == [
        ("ddp-adamw", 3e-3, 0.7, ""), ("ddp-muon", 1e-2, 0.7, "ddp-adamw"),
        ("diloco-adamw H5", 3e-3, 0.5, "ddp-adamw"), ("diloco-muon H5", 1e-2, 0.5, "ddp-adamw")]
    assert ran == ["ddp-adamw lr0.01", "ddp-muon lr0.003", "ddp-muon lr0.01",  # lr0.003 of ddp-adamw: reused
                   "diloco-adamw H5 lr0.003 outer1/0", "diloco-adamw H5 lr0.003 outer0.5/0.5",
                   "diloco-muon H5 lr0.01 outer1/0", "diloco-muon H5 lr0.01 outer0.5/0.5"]
    assert len(saved[-1]) == 8 and (saved[-1][0].arm.name, saved[-1][0].eval_loss) == ("ddp-adamw lr0.003", 2.8)
    # a second tuning seed: it runs every point, seed 101 only those it lacks; the means take both seeds' runs
    ran.clear()
    args.tune_seeds, seeds_ran = [101, 102], []
    monkeypatch.setattr(learning, "run_study_arms",
                        lambda a, arms, save: seeds_ran.append(list(a.seeds)) or fake_run(a, arms, save))
    chosen = learning.tune_arms(args, learning.muon_arms(args), saved.append)
    assert seeds_ran == [[101], [102], [101, 102]]  # the DDP stage (101 lacks 3 points, 102 all 4), then DiLoCo's
    assert ran[:3] == ["ddp-adamw lr0.01", "ddp-muon lr0.003", "ddp-muon lr0.01"]
    assert ran[3:7] == ["ddp-adamw lr0.003", "ddp-adamw lr0.01", "ddp-muon lr0.003", "ddp-muon lr0.01"]
    assert len(saved[-1]) == 16 and [a.lr for a in chosen] == [3e-3, 1e-2, 3e-3, 1e-2]
    for bad in (["--tune-staged"], ["--tune", "--tune-from", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            learning.parse_args(["--engine", "sim", "--optimizer", "muon", *bad])


def test_overlap_and_poison_studies_take_each_arm_against_its_baseline_of_the_same_seed():
    """`--overlap` and `--poison`: every study arm names its baseline, the poison stretch defaults to the middle half
    of the rounds, and the closing ratio is the worst arm's (a diverged run, nan, counts as the worst)."""
    over = learning.overlap_arms(learning.parse_args(["--overlap"]))
    assert [a.name for a in over] == ["sync H5", "overlap H5", "eager H5", "projected H5", "round-late H5",
                                      "sync H20", "overlap H20", "eager H20", "projected H20", "round-late H20"]
    assert over[1].overrides()["diloco.overlap_update"] == "delayed" and over[1].baseline == "sync H5"
    assert over[1].overrides()["diloco.overlap_delay"] == 1 and over[4].overrides()["diloco.overlap_delay"] == 5
    assert over[3].overrides()["diloco.overlap_update"] == "projected" and over[3].baseline == "sync H5"
    assert over[2].overrides()["diloco.overlap_update"] == "eager" and over[2].baseline == "sync H5"
    assert "diloco.overlap_update" not in over[0].overrides() and over[5].inner_steps == 20
    poison = learning.poison_arms(learning.parse_args(["--poison", "--steps", "120", "--inner-steps", "5"]))
    assert {a.poison for a in poison[1:]} == {learning.Poison(1, 100.0, 7, 18), learning.Poison(1, -1.0, 7, 18)}
    assert [a.overrides().get("diloco.sentinel_ratio") for a in poison] == [None, None, None, 0.0, 0.0]
    with pytest.raises(SystemExit):
        learning.poison_arms(learning.parse_args(["--poison", "--poison-rounds", "20-30"]))

    def run(name, loss, baseline=""):
        return learning.Result(learning.Arm(name, "diloco", baseline=baseline), loss, 1.0, 1)

    text, means = learning.paired([[run("sync", 2.0), run("eager", 2.02, "sync")],
                                   [run("sync", 3.0), run("eager", 2.97, "sync")]])
    assert means == {"eager": pytest.approx((1.01 + 0.99) / 2)}
    assert learning.worst({"a": 1.01, "b": 0.99}, ["a", "b"]) == 1.01
    assert str(learning.worst({"a": float("nan"), "b": 0.99}, ["a", "b"])) == "nan"
    assert learning.steps_text([3, 4, 5, 9]) == "3-5, 9"


def test_overlap_study_arms_of_issue_46_an_outer_lr_of_their_own_and_synchronous_early_rounds():
    """`--overlap-lrs` runs delayed overlap at another outer lr against the synchronous run at the shipped one;
    `--overlap-after N` makes the outer steps up to inner step N synchronous (in-process only): with every boundary
    but the flush up to N it is the synchronous run to the bit, with one overlapped boundary it is neither run."""
    args = learning.parse_args(["--engine", "sim", "--overlap", "--overlap-h", "2", "--overlap-lrs", "0.8",
                                "--overlap-after", "4,6", "--steps", "8", "--seq-len", "32", "--micro-batch", "2",
                                "--eval-batches", "2", "--eval-interval", "0", "--k", "2", "--seed", "1"])
    arms = {a.name: a for a in learning.overlap_arms(args)}
    assert arms["overlap H2 lr0.8"].outer_lr == 0.8 and arms["sync H2"].outer_lr == 1.0
    assert arms["overlap H2 lr0.8"].baseline == "sync H2" and arms["overlap H2 lr0.8"].overlap_update == "delayed"
    assert [arms[f"overlap H2 after{n}"].overlap_after for n in (4, 6)] == [4, 6]
    with pytest.raises(SystemExit):  # the engine has no such setting: refused, not ignored
        learning.parse_args(["--overlap", "--overlap-after", "20"])
    loss = {n: learning.run_sim(args, arms[n]).eval_loss
            for n in ("sync H2", "overlap H2", "overlap H2 after4", "overlap H2 after6")}
    assert loss["overlap H2 after6"] == loss["sync H2"]  # boundaries 2, 4, 6 synchronous, 8 the flush
    assert len({loss["sync H2"], loss["overlap H2"], loss["overlap H2 after4"]}) == 3  # 6 overlapped: neither


def test_overlap_closing_lines_name_the_arms_the_study_ran_levers_included(capsys):
    """A lever run on its own (`--arms "overlap H2 after4"`) prints its mean ratio per H, not nan for the updates it
    did not run."""
    args = learning.parse_args(["--engine", "sim", "--overlap", "--overlap-h", "2", "--overlap-after", "4",
                                "--arms", "overlap H2 after4", "--seeds", "1,2"])
    sync, lever = (learning.Arm(n, "diloco", baseline=b)
                   for n, b in (("sync H2", ""), ("overlap H2 after4", "sync H2")))
    learning.conclude(args, [[learning.Result(sync, 2.0, 1.0, 1, seed=1), learning.Result(lever, 2.02, 1.0, 1, seed=1)],
                             [learning.Result(sync, 3.0, 1.0, 1, seed=2), learning.Result(lever, 3.0, 1.0, 1, seed=2)]])
    out = capsys.readouterr().out.splitlines()
    assert "H = 2, landing 1 step(s) in: overlap H2 after4/sync 1.0050" in out


def test_overlap_study_prints_each_seeds_ratios_and_their_spread(tmp_path, capsys):
    """`--overlap --seeds`: each seed's overlap/sync and eager/sync, then each ratio's mean, standard error, min and
    max, on a tiny real run (the in-process engine), checked against the losses the study wrote to its JSON."""
    import json
    import math
    import statistics
    assert learning.main(["--engine", "sim", "--overlap", "--overlap-h", "2", "--arms", "overlap H2,eager H2",
                          "--steps", "4", "--seq-len", "32", "--micro-batch", "4", "--eval-batches", "2",
                          "--eval-interval", "0", "--seeds", "1,2", "--k", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    loss = {(r["arm"]["name"], r["seed"]): r["eval_loss"]
            for r in json.loads(next(tmp_path.glob("*.json")).read_text())["results"]}
    table = out.split("each seed's ratio to the synchronous run of that seed, and their spread:\n")[1].splitlines()
    assert table[0].split() == ["H", "=", "2", "seed", "sync", "overlap", "overlap/sync", "eager", "eager/sync"]
    rows = {line.split()[0]: line.split()[1:] for line in table[2:8]}
    ratios = {arm: [loss[(f"{arm} H2", s)] / loss[("sync H2", s)] for s in (1, 2)] for arm in ("overlap", "eager")}
    for s in (1, 2):
        assert [float(x) for x in rows[str(s)]] == pytest.approx(
            [loss[("sync H2", s)], loss[("overlap H2", s)], ratios["overlap"][s - 1], loss[("eager H2", s)],
             ratios["eager"][s - 1]], abs=6e-5)
    assert ratios["overlap"] != ratios["eager"] and ratios["overlap"][0] != ratios["overlap"][1]  # not trivially
    for arm, col in (("overlap", 0), ("eager", 1)):
        xs = ratios[arm]
        assert float(rows["mean"][col]) == pytest.approx(statistics.fmean(xs), abs=6e-5)
        assert float(rows["se"][col]) == pytest.approx(statistics.stdev(xs) / math.sqrt(2), abs=6e-5)
        assert float(rows["min"][col]) == pytest.approx(min(xs), abs=6e-5)
        assert float(rows["max"][col]) == pytest.approx(max(xs), abs=6e-5)


# ---------------------------------------------------------------------------------------------- sparse (issue 43)

def _sparse_args(*extra: str):
    return learning.parse_args(["--engine", "sim", "--sparse", "--steps", "4", "--sparse-h", "2", "--seq-len", "32",
                                "--micro-batch", "2", "--eval-batches", "2", "--eval-interval", "0", "--k", "2",
                                *extra])


def test_sparse_arm_counts_the_bytes_of_the_message_it_encodes():
    """`--sparse`: B is the bytes of one node's real encoded message over 4 x the values it covers, the message laid
    out over the model's own tensors (chunks never cross one): checked against the wire format's arithmetic
    (docs/sparse.md) over the model's parameter shapes, and the wire bytes are that message (and its 4-byte weight)
    to each other member at each outer step."""
    import math

    import torch

    from engine.config import ModelConfig
    from engine.model import build_model
    args = _sparse_args()
    dense, sparse = learning.sparse_arms(args)
    assert (dense.compression, dense.outer_lr, dense.outer_momentum) == ("none", 1.0, 0.0)
    assert sparse.baseline == dense.name and sparse.outer_momentum == 0.0 and sparse.sparse.bits == 2
    r = learning.run_sim(args, sparse)
    model = build_model(ModelConfig(preset=args.preset), learning.held_out(args).vocab_size, args.seq_len, "cpu")
    numels = [p.numel() for p in model.parameters()]
    spec = sparse.sparse
    chunks = sum(math.ceil(n / spec.chunk) for n in numels)
    kept = sum(min(spec.k, n - j * spec.chunk) for n in numels for j in range(math.ceil(n / spec.chunk)))
    message = 4 * chunks + math.ceil(kept * 12 / 8) + math.ceil(kept * 2 / 8)  # chunk 4096: 12-bit indices
    assert r.bytes_ratio == message / (4 * sum(numels))
    assert 0.005 < r.bytes_ratio < 0.01 and math.isfinite(r.eval_loss)
    assert r.bytes_sent == 2 * (args.k - 1) * (message + 4)  # 2 outer steps; the all-gather to k - 1 members
    assert torch.isfinite(torch.tensor(r.eval_loss))


def test_sparse_arm_keeps_error_feedbacks_books():
    """SimSparse per outer step: e' = beta * e + delta once, the message encoded from e', the token-weighted mean of
    the decoded messages, and e = e' - what was sent after quantization (decoded from the message's bytes here)."""
    import torch

    from engine.outer.sparse import ChunkLayout, SparseCodec, SparseSpec
    spec = SparseSpec(chunk=256, density=0.05, bits=2, beta=0.9)
    shapes = [(300,), (40, 130), (7,)]
    sim = learning.SimSparse(spec, shapes, 3)
    layout = ChunkLayout(shapes, spec)
    codec = SparseCodec(spec, layout)
    numel, weights = layout.numel, [1.0, 2.0, 5.0]
    gen = torch.Generator().manual_seed(0)
    e = [torch.zeros(layout.padded) for _ in range(3)]
    for _ in range(3):
        deltas = [torch.randn(numel, generator=gen) for _ in range(3)]
        mean = sim.mean(deltas, weights)
        want = torch.zeros(layout.padded)
        for i, d in enumerate(deltas):
            staged = spec.beta * e[i] + layout.pack(d)
            decoded = codec.decode(codec.encode(staged)[0])
            want += weights[i] * decoded
            e[i] = staged - decoded
            # not trivially: something was sent, and it was quantized (the residual is not e' less its top k)
            assert (decoded != 0).sum() > 0 and not torch.equal(decoded, torch.where(decoded != 0, staged, 0.0))
        assert torch.allclose(mean, layout.unpack(want / sum(weights)), rtol=0, atol=1e-6)
        for i in range(3):
            assert torch.allclose(sim.feedback[i].e, e[i], rtol=0, atol=1e-6), i
    assert sim.message_bytes == codec.bytes and sim.bytes_ratio == codec.bytes / (4 * numel)


def test_sparse_flags_are_checked_before_anything_runs():
    with pytest.raises(SystemExit):
        learning.parse_args(["--sparse"])  # the mesh engine has no sparse compression yet
    with pytest.raises(SystemExit):
        learning.parse_args(["--engine", "sim", "--sparse", "--sparse-bits", "3"])
    with pytest.raises(SystemExit):
        learning.parse_args(["--engine", "sim", "--sparse-sweep", "--sparse-densities", "0.01,1.5"])
    with pytest.raises(SystemExit):
        learning.parse_args(["--engine", "sim", "--sparse", "--tune", "--seeds", "101"])  # a tuning seed
    args = learning.parse_args(["--engine", "sim", "--sparse-sweep"])
    assert args.sparse and args.steps == 400 and (args.seq_len, args.micro_batch) == (64, 4)
    names = [a.name for a in learning.sparse_sweep_arms(args) if a.inner_steps == 5]
    assert len(names) == 1 + 5 * 3 and "sparse d0.5% b2 H5" in names and "sparse d10% b8 H5" in names


def test_sparse_sweep_along_its_axes_and_at_other_betas(capsys):
    """--sparse-axes: the shipped point first, then each density at the shipped bits and each bits at the shipped
    density, no point twice; --sparse-betas: the shipped point at each beta after them, all against dense DiLoCo.
    Either flag without --sparse-sweep, or a beta outside [0, 1], is one line naming the flag."""
    args = learning.parse_args(["--engine", "sim", "--sparse-sweep", "--sparse-axes", "--sparse-h", "20",
                                "--sparse-betas", "0.95,0.99"])
    arms = learning.sparse_sweep_arms(args)
    assert [a.name for a in arms] == [
        "dense H20", "sparse d1.56% b2 H20", "sparse d0.5% b2 H20", "sparse d1% b2 H20", "sparse d2% b2 H20",
        "sparse d5% b2 H20", "sparse d10% b2 H20", "sparse d1.56% b4 H20", "sparse d1.56% b8 H20",
        "sparse d1.56% b2 beta0.95 H20", "sparse d1.56% b2 beta0.99 H20"]
    assert [(a.sparse.density, a.sparse.bits, a.sparse.beta) for a in (arms[1], arms[7], arms[10])] == [
        (0.0156, 2, 0.9), (0.0156, 4, 0.9), (0.0156, 2, 0.99)]
    assert all(a.baseline == "dense H20" for a in arms[1:])
    for argv, flag in ((["--sparse", "--sparse-axes"], "--sparse-axes"),
                       (["--sparse", "--sparse-betas", "0.9"], "--sparse-betas"),
                       (["--sparse-sweep", "--sparse-betas", "0.9,1.5"], "--sparse-betas")):
        with pytest.raises(SystemExit):
            learning.parse_args(["--engine", "sim", *argv])
        assert flag in capsys.readouterr().err.strip().splitlines()[-1]


def test_sparse_sweep_plots_each_bits_line_the_other_betas_apart_and_dense_at_fp32(tmp_path):
    """The sweep's plot along its axes: the 2-bit line through the densities (the shipped one among them; 2 bits
    need not be in --sparse-bits-sweep), the 4 and 8 bits at the shipped density, the other betas as points of
    their own, dense DiLoCo at 4 bytes a value; the picture is written."""
    args = learning.parse_args(["--engine", "sim", "--sparse-sweep", "--sparse-axes", "--sparse-h", "20",
                                "--sparse-densities", "0.005,0.02", "--sparse-bits-sweep", "4,8",
                                "--sparse-betas", "0.95", "--out", str(tmp_path)])
    arms = learning.sparse_sweep_arms(args)
    loss = {a.name: 2.0 + i / 100 for i, a in enumerate(arms)}
    per_seed = [[learning.Result(a, loss[a.name] + s, 1.0, 1, seed=s,
                                 bytes_ratio=a.sparse.density * a.sparse.bits if a.sparse else 0.0) for a in arms]
                for s in (0, 1)]
    dense, lines, betas = learning.sparse_series(args, per_seed, 1000, 20)
    assert dense == (4000.0, loss["dense H20"] + 0.5, "dense")
    assert sorted(lines) == [2, 4, 8]
    assert [label for _, _, label in lines[2]] == ["0.5%", "1.56%", "2%"]  # sorted by bytes
    assert [label for _, _, label in lines[4]] == ["1.56%"] and [label for _, _, label in lines[8]] == ["1.56%"]
    assert lines[2][1] == (pytest.approx(0.0156 * 2 * 4000), loss["sparse d1.56% b2 H20"] + 0.5, "1.56%")
    assert betas == [(pytest.approx(0.0156 * 2 * 4000), loss["sparse d1.56% b2 beta0.95 H20"] + 0.5, "beta 0.95")]
    learning.sparse_plot(args, per_seed, 1000)
    assert (tmp_path / "learning-sparse-sweep.png").stat().st_size > 10_000


@pytest.mark.slow
def test_sparse_arm_at_full_density_tracks_dense_diloco():
    """Every value sent at 8 bits, nothing decayed (density 1, beta 1): the sparse arm is dense DiLoCo up to the
    quantizer's error, which error feedback carries forward; at the shipped density it is not."""
    args = _sparse_args("--steps", "8", "--sparse-h", "2")
    dense, sparse = learning.sparse_arms(args)
    d = learning.run_sim(args, dense).eval_loss
    # at the dense arm's outer settings (the sparse arm ships outer lr 2: SPARSE_OUTER_LR)
    full_spec = learning.replace(sparse.sparse, density=1.0, bits=8, beta=1.0)
    full = learning.run_sim(args, learning.replace(sparse, sparse=full_spec, outer_lr=dense.outer_lr,
                                                   outer_momentum=dense.outer_momentum)).eval_loss
    shipped = learning.run_sim(args, sparse).eval_loss
    print(f"dense {d:.4f}, sparse at density 1 / 8 bits {full:.4f}, at the shipped settings {shipped:.4f}")
    assert abs(full - d) < 0.01 * d < abs(shipped - d)
