"""The benchmark scripts' own plumbing, cheaply, so it cannot rot unseen: bench/strategies.py's warm-up steps what
engine.session.train_step needs; torchrun's workers never outlive a timeout; a failed worker's own traceback is
shown; the simulated nodes of bench/console_app_cpu.py send the rate they are given; bench/outer_step.py's first
outer step is a formation (so round 0 holds the hand-off); bench/elastic.py stops waiting on a node that exited;
bad arguments are argparse's one-line errors."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import console_app_cpu  # noqa: E402
import elastic  # noqa: E402
import outer_step  # noqa: E402
import ranks  # noqa: E402
import strategies  # noqa: E402


def test_strategies_warm_up_steps_a_stream_train_step_accepts():
    """The warm-up runs before every strategy's measurement: when it fails, every strategy fails."""
    import torch

    from engine.config import InnerConfig
    from engine.world import World

    world = World(rank=0, world_size=1, local_rank=0, hostname="bench", pid=os.getpid())
    strategies.warm_up_code_paths(argparse.Namespace(precision="fp32"), InnerConfig(strategy="ddp", device="cpu"),
                                  world, torch.device("cpu"))


def test_worker_errors_are_the_failing_ranks_traceback():
    stderr = "\n".join(["W1127 warning from torchrun", "[rank1]: some warning", "[rank0]: Traceback (most recent "
                        "call last):", "[rank0]:   File x", "[rank1]: Traceback (most recent call last):",
                        "[rank0]: AttributeError: no consumed", "[rank1]: AttributeError: no consumed",
                        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "Root Cause"])
    assert ranks.worker_errors(stderr).splitlines() == [
        "[rank0]: Traceback (most recent call last):", "[rank0]:   File x", "[rank0]: AttributeError: no consumed"]
    assert ranks.worker_errors("only torchrun\nspoke") == "only torchrun\nspoke"


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_run_torchrun_leaves_no_worker_behind_after_a_timeout(tmp_path):
    """A launcher whose worker sits in a session of its own (as torchrun's do) and that dies on SIGTERM without
    taking it down: the worker is killed too, and the timeout is the caller's to report."""
    pid_file = tmp_path / "worker.pid"
    launcher = ("import pathlib, subprocess, sys, time\n"
                "w = subprocess.Popen(['sleep', '60'], start_new_session=True, stdin=subprocess.DEVNULL,\n"
                "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                f"pathlib.Path({str(pid_file)!r}).write_text(str(w.pid))\n"
                "time.sleep(60)\n")
    worker = None
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            ranks.run_torchrun([sys.executable, "-c", launcher], 2.0)
        worker = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while _state(worker) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(worker) in (None, "Z"), "the worker outlived its launcher's timeout"
    finally:
        if worker is not None and _state(worker) not in (None, "Z"):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("rate, per_node", [(1.0, 3), (25.0, 75), (10.0, 30)])
def test_simulated_nodes_send_the_rate_they_are_given(monkeypatch, rate, per_node):
    """30 ticks of 100 ms: 3 s of events from each of two nodes, whatever the rate's multiple of 10."""
    sent: list[str] = []
    fleet = argparse.Namespace(ingest=lambda name, line: sent.append(name))
    sim = console_app_cpu.SimCluster(fleet, ["a", "b"], rate, {"a": ["x"], "b": ["y"]})
    ticks = 0

    class Done(Exception):
        pass

    async def one_tick(_seconds: float) -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 30:
            raise Done

    monkeypatch.setattr(console_app_cpu.asyncio, "sleep", one_tick)
    with pytest.raises(Done):
        asyncio.run(sim._produce())
    assert sent.count("a") == sent.count("b") == per_node
    assert sim.sent == 2 * per_node


def test_outer_step_bench_forms_its_run_on_the_first_outer_step():
    """diloco.py hands the state off after a forming plan's commit only: round 0's `handoff` figure needs one."""
    mesh = outer_step.AlwaysMesh(outer_step.NAMES)
    first = mesh.boundary(1, 0, contributing=True, draining=False)
    assert first.forming and first.size == 2
    assert mesh.boundary(1, 1, contributing=True, draining=False).forming  # an attempt that did not commit
    mesh.commit(first, False)
    assert mesh.boundary(1, 1, contributing=True, draining=False).forming
    mesh.commit(first, True)
    assert not mesh.boundary(2, 0, contributing=True, draining=False).forming


def test_elastic_stops_waiting_when_a_node_exited():
    exited = argparse.Namespace(name="a", stopped=False, err="error: a bad setting\n",
                                proc=argparse.Namespace(poll=lambda: 2, returncode=2))
    killed = argparse.Namespace(name="b", stopped=True, err="", proc=argparse.Namespace(poll=lambda: -9))
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match="a exited 2 waiting for 4 outer steps"):
        elastic.wait_for(lambda: False, 5, "4 outer steps", [killed, exited])
    assert time.monotonic() - t0 < 1
    with pytest.raises(SystemExit, match="timed out"):  # a node stopped on purpose is not a failure
        elastic.wait_for(lambda: False, 0.05, "the survivors", [killed])


def test_elastic_store_share_skips_each_nodes_formation():
    def node(*walls):
        return argparse.Namespace(of=lambda type_, call: [{"wall_s": w} for w in walls])
    rows = elastic.steady_rows([node(9, 1, 1), node(9, 2), node(9, 3, 3)], "boundary")
    assert [r["wall_s"] for r in rows] == [1, 1, 2, 3, 3]


@pytest.mark.parametrize("script, argv", [
    ("console_ingest", ["--repeat", "0"]), ("console_ingest", ["--nodes", "0"]), ("mesh_scale", ["--nodes", "0"]),
    ("diloco_comm", ["--hs", "x"]), ("diloco_comm", ["--hs", "0"]), ("diloco_comm", ["--compressions", "zstd"]),
    ("learning", ["--k", "0"]), ("learning", ["--steps", "0"]), ("learning", ["--eval-batches", "0"]),
    ("learning", ["--inner-steps", "0"]), ("learning", ["--engine", "sim", "--overlap", "--overlap-delay", "0"]),
    ("learning", ["--engine", "sim", "--optimizer", "muon", "--muon-h", "x"]),
    ("learning", ["--engine", "sim", "--optimizer", "muon", "--tune", "--seeds", "5,6", "--tune-seeds", "5"])])
def test_bad_arguments_are_one_line_errors(capsys, script, argv):
    module = __import__(script)
    with pytest.raises(SystemExit) as exit_:
        (module.parse_args if script == "learning" else module.main)(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and f": error: {'' if 'sim' in argv else 'argument '}{argv[-2]}" in err[-1], err
