"""A checkpoint that fails on one rank of a node, in real engine processes (torchrun, 2 gloo ranks): every rank
fails at the same point and exits, nothing is committed, and `latest` keeps the last good checkpoint."""

from __future__ import annotations

from procs import PYTHON
from test_train import SMALL, parse_events

# Fault injection from the test side: rank 1's own file of the step-4 checkpoint meets a full disk (every time it is
# written). Each rank writes its exit code beside the run, since torchrun reports only the first failure. A rank
# still running after WATCHDOG_S prints its threads' stacks and exits without that file: a hang is reported, and no
# worker outlives the test (torchrun's workers are not in its process group, which the test's timeout kills).
WATCHDOG_S = 120
FULL_DISK_ON_RANK_1 = """import errno, faulthandler, os, sys
faulthandler.dump_traceback_later({watchdog}, exit=True)
import torch
_save = torch.save
def _full(obj, f, *args, **kwargs):
    if os.environ["RANK"] == "1" and str(getattr(f, "name", f)).endswith("step-00000004.tmp/rank-1.pt"):
        raise OSError(errno.ENOSPC, "No space left on device")
    return _save(obj, f, *args, **kwargs)
torch.save = _full
import engine.train
code = engine.train.main(sys.argv[1:], freeze=True)
with open(os.path.join({exits!r}, "exit-" + os.environ["RANK"]), "w") as fh:
    fh.write(str(code))
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def test_a_save_that_fails_on_one_rank_fails_every_rank_and_commits_nothing(procs, tmp_path):
    """Defect: rank 1's rank file failed (ENOSPC) while rank 0 waited in a bare barrier; rank 1's save before
    failing started the collective save again alone, its barrier paired with rank 0's, and rank 0 committed the
    step with an empty rank-1.pt, pointed `latest` at it, pruned the last good checkpoint (keep=1), and both ranks
    hung in mismatched collectives."""
    launcher, exits, run_dir = tmp_path / "launch.py", tmp_path / "exits", tmp_path / "run"
    launcher.write_text(FULL_DISK_ON_RANK_1.format(exits=str(exits), watchdog=WATCHDOG_S))
    exits.mkdir()
    args = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(launcher),
            "configs/debug.toml", *SMALL, "--data.fake=true", "--data.seq_len=32", "--train.max_steps=4",
            "--ckpt.interval=2", "--ckpt.keep=1", f"--run.dir={run_dir}"]
    done = procs.run(args, timeout=WATCHDOG_S + 60)
    assert done.returncode != 0, done.stderr[-3000:]
    # a rank without its file hung (its stacks are in the output)
    assert {p.name: p.read_text() for p in exits.iterdir()} == {"exit-0": "1", "exit-1": "1"}, done.stderr[-6000:]
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000002"]  # no step 4, no .tmp folder
    for rank in (0, 1):
        assert (ckpt / "step-00000002" / f"rank-{rank}.pt").stat().st_size > 0
    events = parse_events(done.stdout)
    assert [e["step"] for e in events if e["type"] == "checkpoint"] == [2]
    # one error (no second try of the same save before exiting), naming the rank, the cause and what is latest
    errors = [e["message"] for e in events if e["type"] == "error"]
    said = ("checkpoint step-00000004 failed on rank 1 while writing: OSError: [Errno 28] No space left on device; "
            "latest names step-00000002")
    assert errors == [said], done.stderr[-3000:]
    # one line for the node, not a traceback from every rank
    assert [ln for ln in done.stderr.splitlines() if ln.startswith("error:")] == [f"error: {said}"], done.stderr
    assert "engine/checkpoint.py" not in done.stderr, done.stderr[-3000:]  # no engine traceback (torchrun's own
    # report of the failed workers follows)
    assert [e["status"] for e in events if e["type"] == "run_end"] == ["failed"]
