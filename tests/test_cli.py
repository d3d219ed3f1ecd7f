"""The CLI without a screen: argument rules, bad profiles, the headless status line and outcome, the subcommands,
and the pure cell formats the table shares with them."""

from __future__ import annotations

import asyncio
import io
import math
import os
import re
import sys
import time

import pytest

from console import cli
from console.fleet import Fleet, HostState, NodeState
from console.widgets import cells
from console.widgets.node_table import node_row, visible
from engine.telemetry import encode, make_event


def _event(type_: str, node: str, **fields) -> str:
    return encode(make_event(type_, node, 0, **fields))


def _training_fleet(names=("node-a", "node-b", "node-c"), step=10, loss=3.5, tps=1000.0) -> Fleet:
    fleet = Fleet(run="demo")
    for i, name in enumerate(names):
        fleet.add_node(name, "127.0.0.1")
        fleet.ingest(name, _event("run_start", name, pid=100 + i, host="h", world_size=1, config_digest="d",
                                  strategy="ddp", max_steps=100))
        fleet.ingest(name, _event("state", name, state="training"))
        fleet.ingest(name, _event("step", name, step=step, loss=loss, lr=1e-3, tokens_per_s=tps, grad_norm=None))
    return fleet


# ---- cells --------------------------------------------------------------------------------------------------
def test_device_cells_label_cpu_and_gpu():
    util, mem = cells.device_cells("cpu", 42.0, 300 * 2**20, 8 * 2**30)
    assert (util.plain, mem.plain) == ("CPU  42.0%", "RSS 300.0M")
    util, mem = cells.device_cells("gpu", 99.5, 40 * 2**30, 80 * 2**30)
    assert (util.plain, mem.plain) == ("GPU  99.5%", "40.0G/80.0G")
    util, mem = cells.device_cells(None, None, None, None)
    assert (util.plain, mem.plain) == ("-", "-")


def test_heartbeat_age_colour_follows_the_timeout():
    assert cells.age_cell(0.6, 6.0).plain == "1s" and str(cells.age_cell(0.6, 6.0).style) == "green"
    assert cells.age_cell(3.04, 6.0).plain == "3.0s" and str(cells.age_cell(3.0, 6.0).style) == "yellow"
    assert str(cells.age_cell(7.0, 6.0).style) == "bold red"
    assert cells.age_cell(None, 6.0).plain == "-"
    quiet = cells.age_cell(30.0, 6.0, live=False)
    assert quiet.plain == "30s" and str(quiet.style) == "dim"
    assert cells.age_cell(float("nan"), 6.0).plain == "-"


def test_sparkline_scales_between_min_and_max_and_skips_bad_values():
    assert cells.sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert cells.sparkline([5.0, None, math.nan, 5.0]) == "▄▄"
    assert cells.sparkline([]) == ""
    assert len(cells.sparkline(range(100), width=12)) == 12


def test_number_formats_never_raise_on_garbage():
    assert cells.num_cell(None) == "-" and cells.num_cell(math.inf) == "-" and cells.num_cell("x") == "-"
    assert cells.loss_cell(3.14159) == "3.1416"
    assert cells.loss_cell(1e308) == "1e+308" and cells.num_cell(-3e12) == "-3e+12"
    assert cells.eta_text(3725) == "1h02m" and cells.eta_text(65) == "1m05s" and cells.eta_text(None) == "-"


def test_state_column_is_the_state_and_the_reason_goes_whole_where_it_fits():
    """Defect: "dead (killed by the operat" -- the column cut the reason. Now the column holds the state, and the
    status line (and the detail view, the log title, the timeline) carries the reason whole."""
    reason = "exited with status 1: ValueError: train.batch_size (8) is not divisible by 16"
    fleet = _training_fleet()
    fleet.set_state("node-b", HostState.FAILED, reason)
    row = node_row(fleet.nodes["node-b"], 6.0)
    assert row["state"].plain == "failed"
    assert cli.node_line(fleet.nodes["node-b"]).endswith(f"({reason})")
    assert cells.reason_text("training", "whatever") == ""  # a healthy state needs no why


def test_status_line_of_a_node_says_where_it_is_in_its_data():
    fleet = _training_fleet()
    fleet.ingest("node-a", _event("step", "node-a", step=11, loss=3.0, lr=1e-3, tokens_per_s=900.0, grad_norm=None,
                                  tokens=45056, outer_step=2, epoch=0.25))
    assert "| data 45,056 tok epoch 0.250" in cli.node_line(fleet.nodes["node-a"])
    assert "| data" not in cli.node_line(fleet.nodes["node-b"])  # an engine that does not say: nothing made up


def test_status_of_dead_and_left_nodes_shows_no_stale_figures():
    """Defect: `status` printed "dead ... CPU 100.0% RSS 620.5M" from the last sample of a gone process."""
    fleet = _training_fleet()
    for name in fleet.nodes:
        fleet.ingest(name, _event("resource", name, device="cpu", util=100.0, mem_used=650_000_000,
                                  mem_total=8 * 2**30))
    fleet.set_state("node-b", NodeState.DEAD, "killed by the operator")
    fleet.ingest("node-c", _event("run_end", "node-c", status="stopped", step=10))
    lines = {n: cli.node_line(fleet.nodes[n]) for n in fleet.nodes}
    assert "CPU 100.0%" in lines["node-a"] and "RSS 619.9M" in lines["node-a"] and "1,000 tok/s" in lines["node-a"]
    for name in ("node-b", "node-c"):
        assert "CPU" not in lines[name] and "RSS" not in lines[name] and "1,000" not in lines[name], lines[name]
        assert lines[name].split()[3:5] == ["-", "-"]


def test_hosts_not_started_are_off_and_only_standby_hosts_are_spare(tmp_path):
    """Defect: before a start every host read "standby"; only a profile standby is a spare, the others are off."""
    from console.cluster import Cluster
    from console.profile import parse_profile

    fleet = Fleet(run="unit")
    Cluster(parse_profile(PROFILE_TEXT, str(tmp_path / "unit.toml")), fleet)
    assert {n: str(node.state) for n, node in fleet.nodes.items()} == {
        "node-a": "off", "node-b": "off", "node-c": "spare"}
    assert cli.run_outcome(fleet) is None  # nothing started: no outcome yet
    assert cli.status_line(fleet, now=0).endswith("| off 2")


def test_node_row_has_the_live_values():
    fleet = _training_fleet(step=42, loss=2.25, tps=1234.0)
    row = node_row(fleet.nodes["node-b"], heartbeat_timeout=6.0)
    assert row["name"].plain == "node-b" and row["state"].plain == "training"
    assert (row["step"].plain, row["loss"].plain, row["tps"].plain) == ("42", "2.2500", "1,234")
    node = fleet.nodes["node-a"]
    node.tps_history.extend((float(t), 1000.0 + (t % 2) * 500) for t in range(600))  # 512 kept; newest alternate
    assert node_row(node, 6.0)["trend"].plain == "▁█" * 8  # the newest 16 values, oldest first
    node.loss_history.extend((float(t), float(t)) for t in range(100))
    assert node_row(node, 6.0, trend="loss")["trend"].plain == cells.sparkline(range(84, 100), 16)


def test_filter_matches_name_host_or_state():
    fleet = _training_fleet()
    fleet.set_state("node-b", NodeState.DEAD, "killed")
    assert [n.name for n in visible(fleet.nodes.values(), "dead")] == ["node-b"]
    assert [n.name for n in visible(fleet.nodes.values(), "NODE-C")] == ["node-c"]
    assert len(visible(fleet.nodes.values(), "127.0")) == 3 and len(visible(fleet.nodes.values(), " ")) == 3


# ---- headless -------------------------------------------------------------------------------------------------
def test_status_line_carries_the_header_and_state_counts():
    fleet = _training_fleet(step=10, loss=3.5, tps=1000.0)
    fleet.set_state("node-c", NodeState.DEAD, "killed")
    line = cli.status_line(fleet, now=0)
    assert "run demo" in line and "step 10/100" in line and "loss 3.5000" in line
    assert "2,000 tok/s" in line  # the dead node no longer counts
    assert line.endswith("training 2 dead 1")
    assert "\n" not in line
    fleet.store.address = "10.0.0.1:29600"
    assert " | store 10.0.0.1:29600 off | training 2" in cli.status_line(fleet, now=0)
    # the etcd backend: no TCP store to call "off" (the console sets no address); the members' health instead
    fleet.store.address, fleet.store_status = None, "etcd 2/3 up, leader c"
    line = cli.status_line(fleet, now=0)
    assert "| etcd 2/3 up, leader c | training 2 dead 1" in line and "store" not in line


def test_run_outcome_waits_then_reports():
    fleet = _training_fleet()
    assert cli.run_outcome(fleet) is None
    for name in ("node-a", "node-b"):
        fleet.ingest(name, _event("run_end", name, status="completed", step=100))
    assert cli.run_outcome(fleet) is None  # node-c still trains
    fleet.ingest("node-c", _event("drained", "node-c", outer_step=3, step=60))
    fleet.ingest("node-c", _event("run_end", "node-c", status="drained", step=60))
    assert cli.run_outcome(fleet) == cli.EXIT_OK


def test_run_outcome_failure_and_stop():
    fleet = _training_fleet(names=("a", "b"))
    fleet.ingest("a", _event("run_end", "a", status="completed", step=100))
    fleet.set_state("b", NodeState.DEAD, "killed")
    assert cli.run_outcome(fleet) == cli.EXIT_FAILED
    fleet = _training_fleet(names=("a", "b"))
    for name in ("a", "b"):
        fleet.ingest(name, _event("run_end", name, status="stopped", step=50))
    assert cli.run_outcome(fleet) == cli.EXIT_STOPPED
    fleet.set_state("a", HostState.UNREACHABLE, "link down")
    assert cli.run_outcome(fleet) is None  # its engine may still train


def test_a_mesh_dead_label_is_not_the_end_of_the_run():
    fleet = _training_fleet(names=("a", "b", "c"))
    for subject in ("a", "b"):  # c, cut off from a and b, declares them dead; then c is killed
        fleet.ingest("c", _event("membership", "c", ts=time.time() + 0.01, change="dead", subject=subject,
                                 generation=5, members=["c"]))
    fleet.set_state("c", NodeState.DEAD, "killed by the operator (SIGKILL to its process group)")
    assert {n.state for n in fleet.nodes.values()} == {NodeState.DEAD}  # every node shown dead
    assert cli.run_outcome(fleet) is None  # but a and b were not seen to end: the run goes on
    fleet.set_state("a", NodeState.DEAD, "process gone without an exit status (killed?)")  # the console saw it
    assert cli.run_outcome(fleet) is None  # b still runs
    fleet.ingest("b", _event("run_end", "b", ts=time.time() + 1, status="completed", step=100))
    assert cli.run_outcome(fleet) == cli.EXIT_FAILED


async def test_headless_never_stops_engines_it_still_follows(unit_profile):
    """The fleet's view says the run is over (each node reported gone by its peer) while the cluster still follows
    both live processes: no stop() and no exit until the watchers have seen the processes end."""
    from console.profile import load_profile

    fleet = Fleet(run="unit")
    cluster = RecordingCluster(load_profile(unit_profile), fleet)
    live = {"node-a", "node-b"}
    cluster.running = lambda: sorted(live)

    async def start():
        await cluster.attach()
        for reporter, subject in (("node-a", "node-b"), ("node-b", "node-a")):
            fleet.ingest(reporter, _event("membership", reporter, change="left", subject=subject, generation=4,
                                          members=[reporter]))
        assert cli.run_outcome(fleet) == cli.EXIT_STOPPED  # the (wrong) view: every node gone

        async def finish():
            await asyncio.sleep(0.5)
            live.clear()  # the watchers saw both processes end
        asyncio.ensure_future(finish())

    cluster.start = start
    out = io.StringIO()
    begun = time.monotonic()
    code = await cli.run_headless(cluster, fleet, attach=False, interval=0.1, out=out)
    assert time.monotonic() - begun >= 0.5  # it waited for the processes, not for the fleet's view
    assert code == cli.EXIT_STOPPED and cluster.calls[-2:] == [("stop", "all"), "close"]


def test_standby_nodes_do_not_hold_the_outcome():
    fleet = _training_fleet(names=("a",))
    fleet.add_node("spare", "10.0.0.9")
    fleet.ingest("a", _event("run_end", "a", status="completed", step=100))
    assert cli.run_outcome(fleet) == cli.EXIT_OK


# ---- arguments and profiles -----------------------------------------------------------------------------------
def test_parse_subcommands_and_flags():
    args = cli.parse_args(["p.toml", "drain", "node-b"])
    assert (args.profile, args.command, args.node) == ("p.toml", "drain", "node-b")
    args = cli.parse_args(["p.toml", "--headless", "--interval", "0.5"])
    assert args.headless and args.interval == 0.5 and args.command is None
    assert cli.parse_args(["p.toml", "--attach", "add", "10.0.0.4"]).host == "10.0.0.4"


@pytest.mark.parametrize("argv", [["p.toml", "--headless", "--readonly"], ["p.toml", "--interval", "0"],
                                  ["p.toml", "--headless", "status"], ["p.toml", "drain"], ["p.toml", "nuke"]])
def test_bad_usage_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip()


def test_bad_profile_is_one_line_and_nothing_starts(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nname = "x"\n\n[engine]\nconfig = "c.toml"\n\n[hosts.a]\nport = "twenty-two"\n')
    started = []
    code = cli.main([str(bad), "--headless"], cluster_factory=lambda p, f: started.append(p))
    err = capsys.readouterr().err.strip()
    assert code == 2 and started == []
    assert len(err.splitlines()) == 1
    assert f"{bad}:8: hosts.a.port" in err


def test_missing_profile_exits_2(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope.toml"), "status"], cluster_factory=lambda p, f: None) == 2
    assert "nope.toml" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_status_quietly(tmp_path):
    """`zeroband-console P status | head -1`: a closed pipe is the reader's choice, not a failure of the command
    (it said "status failed: BrokenPipeError" and exited 1). A real process, its stdout a pipe nobody reads."""
    import subprocess

    from procs import ROOT, engine_env
    profile = tmp_path / "p.toml"
    profile.write_text(PROFILE_TEXT.replace('name = "unit"', f'name = "unit"\ndir = "{tmp_path / "runs"}"'))
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "console", str(profile), "status"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60, cwd=ROOT, env=engine_env())
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


# ---- subcommands against a stand-in cluster (the real one is driven in test_cli_against_a_running_cluster) ----
PROFILE_TEXT = """\
[run]
name = "unit"
[engine]
config = "configs/debug-diloco.toml"
[defaults]
transport = "local"
[hosts.node-a]
[hosts.node-b]
[hosts.node-c]
standby = true
"""


class RecordingCluster:
    """Records the calls the CLI makes; answers like console.cluster.Cluster (Outcome, never raises)."""

    def __init__(self, profile, fleet: Fleet, ok: bool = True):
        from console.control import Outcome

        self.fleet, self.ok, self.calls, self.Outcome = fleet, ok, [], Outcome
        self.warnings: list[str] = []
        for name, host in profile.hosts.items():
            fleet.add_node(name, "local", HostState.SPARE)

    async def start(self):
        self.calls.append("start")

    def running(self):
        return []  # the processes ended as the fleet says

    def nothing_runs(self):
        return None

    async def attach(self, **kw):
        self.calls.append("attach")
        for name in ("node-a", "node-b"):
            self.fleet.ingest(name, _event("state", name, state="training"))
            self.fleet.ingest(name, _event("step", name, step=12, loss=2.5, lr=1e-3, tokens_per_s=800.0,
                                           grad_norm=None))

    async def status(self):
        self.calls.append("status")
        return self.fleet.summary()

    async def _act(self, *call):
        self.calls.append(call)
        return self.Outcome(self.ok, f"{call[-1]}: {call[0]} {'done' if self.ok else 'refused: not running'}")

    async def drain(self, name):
        return await self._act("drain", name)

    async def kill(self, name):
        return await self._act("kill", name)

    async def add(self, host):
        return await self._act("add", host)

    async def stop(self):
        return await self._act("stop", "all")

    async def close(self):
        self.calls.append("close")


@pytest.fixture
def unit_profile(tmp_path):
    path = tmp_path / "unit.toml"
    path.write_text(PROFILE_TEXT)
    return str(path)


def run_cli(argv, ok: bool = True):
    made = []

    def factory(profile, fleet):
        made.append(RecordingCluster(profile, fleet, ok))
        return made[-1]

    out = io.StringIO()
    code = cli.main(argv, cluster_factory=factory, out=out)
    return code, out.getvalue(), made[0].calls if made else None


@pytest.mark.parametrize("argv", [["--headless"], ["add", "node-c"]])
def test_an_engine_config_the_engines_refuse_is_one_line_exit_2_and_nothing_starts(tmp_path, capsys, argv):
    """README: a misspelt override is one `file:line: key` line and exit 2, nothing started (--headless exited 1
    with no line, `add` printed "added" and the engine died)."""
    path = tmp_path / "bad.toml"
    config = 'config = "configs/debug-diloco.toml"\n'
    path.write_text(PROFILE_TEXT.replace(config, config + '[engine.overrides]\n"train.max_stepz" = 40\n'))
    code, out, calls = run_cli([str(path), *argv])
    assert (code, out, calls) == (2, "", None)  # no cluster was even made
    assert capsys.readouterr().err == (f"zeroband-console: {path}:6: engine.overrides.train.max_stepz: unknown key "
                                       "(did you mean train.max_steps?)\n")


def test_status_prints_the_summary_and_every_node(unit_profile):
    code, out, calls = run_cli([unit_profile, "status"])
    assert code == 0 and calls == ["attach", "status", "close"]
    lines = out.splitlines()
    assert "run unit" in lines[0] and "members 2" in lines[0] and "training 2" in lines[0]
    assert lines[1].split()[:3] == ["node-a", "local", "training"]
    assert "step 12" in lines[1] and "loss 2.5000" in lines[1]
    assert lines[3].split()[:3] == ["node-c", "local", "spare"]


@pytest.mark.parametrize("argv,call", [(["drain", "node-b"], ("drain", "node-b")),
                                       (["kill", "node-a"], ("kill", "node-a")),
                                       (["add", "10.0.0.7"], ("add", "10.0.0.7")), (["stop"], ("stop", "all"))])
def test_actions_attach_act_and_detach(unit_profile, argv, call):
    code, out, calls = run_cli([unit_profile, *argv])
    assert code == 0 and calls == ["attach", call, "close"]
    assert out.strip() == f"{call[1]}: {call[0]} done"


def test_refused_action_exits_1_with_the_reason(unit_profile, capsys):
    code, out, calls = run_cli([unit_profile, "kill", "node-b"], ok=False)
    assert code == 1 and out == ""
    assert capsys.readouterr().err.strip() == "zeroband-console: node-b: kill refused: not running"


def test_unknown_node_exits_2_and_acts_on_nothing(unit_profile, capsys):
    code, _, calls = run_cli([unit_profile, "drain", "node-z"])
    assert code == 2 and calls == ["attach", "close"]
    assert "unknown node 'node-z' (nodes: node-a, node-b, node-c)" in capsys.readouterr().err


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_headless_that_loses_its_reader_leaves_the_run_going_and_exits_130(unit_profile, capsys):
    """`--headless | tee log` and tee dies: like an interrupt (the run is not over), never a traceback."""
    made = []

    def factory(profile, fleet):
        made.append(RecordingCluster(profile, fleet))
        return made[-1]

    code = cli.main([unit_profile, "--headless", "--attach", "--interval", "0.05"], cluster_factory=factory,
                    out=_ClosedPipe())
    assert code == 130 and "stop" not in [c if isinstance(c, str) else c[0] for c in made[0].calls]
    assert capsys.readouterr().err == ""


async def test_headless_prints_lines_until_the_outcome(unit_profile):
    """run_headless with a cluster whose nodes finish after a few intervals: one line per interval, then exit 0."""
    from console.profile import load_profile

    fleet = Fleet(run="unit")
    cluster = RecordingCluster(load_profile(unit_profile), fleet)

    async def start():
        await cluster.attach()

        async def finish():
            await asyncio.sleep(0.35)
            for name in ("node-a", "node-b"):
                fleet.ingest(name, _event("run_end", name, status="completed", step=100))
        asyncio.ensure_future(finish())

    cluster.start = start
    out = io.StringIO()
    code = await cli.run_headless(cluster, fleet, attach=False, interval=0.1, out=out)
    lines = out.getvalue().splitlines()
    status = [line for line in lines if " | " in line]
    assert code == 0 and cluster.calls[-2:] == [("stop", "all"), "close"]  # the run is over: the store ends too
    assert 2 <= len(status) <= 6 and "training 2" in status[0] and status[-1].endswith("left 2")
    assert any(line.split()[:3] == ["node-a", "local", "left"] for line in lines)


async def test_headless_failed_start_is_one_line_and_exit_1(unit_profile, capsys):
    fleet = Fleet(run="unit")

    class Broken(RecordingCluster):
        async def start(self):
            raise OSError("store port in use")

    from console.profile import load_profile

    cluster = Broken(load_profile(unit_profile), fleet)
    code = await cli.run_headless(cluster, fleet, attach=False, interval=0.1, out=io.StringIO())
    assert code == 1 and cluster.calls == ["close"]
    assert capsys.readouterr().err.strip() == "zeroband-console: start failed: OSError: store port in use"


# ---- end to end: a headless console and shell commands on the real local cluster ------------------------------
def _console(procs, *args, timeout: float = 60.0):
    return procs.run([sys.executable, "-m", "console", *args], timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_against_a_running_cluster(tmp_path, procs):
    """`--headless` runs the cluster (no terminal: pipes); `status`, `kill`, `drain`, `stop` from other processes
    act on it; the headless console sees it all and exits with the run's outcome (a node died: 1)."""
    from procs import fast_local_profile, kill_recorded_groups

    profile = fast_local_profile(tmp_path)
    try:
        headless = procs.start([sys.executable, "-m", "console", str(profile), "--headless", "--interval", "1"])
        deadline = time.monotonic() + 180
        while True:
            status = _console(procs, str(profile), "status")
            assert status.returncode == 0, status.stderr
            lines = status.stdout.splitlines()
            # a resource sample each, and the store's figures from its probe (status said "rtt - | - keys")
            if "training 3" in lines[0] and sum(" CPU " in line for line in lines) == 3 and \
                    re.search(r" up \| rtt [\d.]+ms \| \d+ keys", lines[0]):
                break
            assert time.monotonic() < deadline and headless.poll() is None, status.stdout
            time.sleep(2)
        rows = {line.split()[0]: line for line in status.stdout.splitlines()[1:]}
        assert set(rows) == {"node-a", "node-b", "node-c", "node-d"} and "spare" in rows["node-d"]
        assert all("RSS " in rows[n] and " step " in rows[n] for n in ("node-a", "node-b", "node-c"))

        killed = _console(procs, str(profile), "kill", "node-c")
        assert (killed.returncode, killed.stdout.strip()) == (0, "node-c: killed")
        drained = _console(procs, str(profile), "drain", "node-b")
        assert (drained.returncode, drained.stdout.strip()) == (0, "node-b: drain requested")
        unknown = _console(procs, str(profile), "kill", "node-z")
        assert unknown.returncode == 2 and "unknown node 'node-z'" in unknown.stderr

        deadline = time.monotonic() + 120
        while True:
            rows = {line.split()[0]: line for line in _console(procs, str(profile), "status").stdout.splitlines()[1:]}
            if (" left " in rows["node-b"] and rows["node-b"].endswith("(drained)") and " dead " in rows["node-c"]
                    and " training " in rows["node-a"]):
                break
            assert time.monotonic() < deadline, rows
            time.sleep(2)

        stopped = _console(procs, str(profile), "stop", timeout=90)
        assert stopped.returncode == 0, stopped.stderr
        out, err = headless.communicate(timeout=60)
        lines = out.splitlines()
        assert headless.returncode == cli.EXIT_FAILED, (out, err)  # node-c died: not a clean completion
        assert sum(" | " in line for line in lines) >= 3 and "training 3" in out
        assert any(" | store 127.0.0.1:" in line and " up | rtt " in line for line in lines), out  # store health
        outer = [line for line in lines if line.startswith("  outer ")]
        # a line per outer step (these engines split the exchange into wire and codec seconds)
        assert outer and all(" compute " in line and " wire " in line and " codec " in line and " members | " in line
                              for line in outer), out
        final = {line.split()[0]: line for line in lines if line.startswith("  ")}
        assert "stopped" in final["node-a"] and "drained" in final["node-b"] and "dead" in final["node-c"]
    finally:
        kill_recorded_groups((tmp_path / "runs").glob("*/pid"))


def test_heartbeat_timeout_comes_from_the_engine_config(tmp_path, monkeypatch):
    from console.profile import parse_profile
    from procs import ROOT

    monkeypatch.chdir(ROOT)  # the engine config's own paths are relative to the checkout
    config = tmp_path / "engine.toml"
    config.write_text((ROOT / "configs" / "debug-diloco.toml").read_text() + "\n[mesh]\nheartbeat_timeout = 9.0\n")
    text = PROFILE_TEXT.replace('config = "configs/debug-diloco.toml"', f'config = "{config}"')
    assert cli.heartbeat_timeout_of(parse_profile(text)) == 9.0
    typed = text.replace(f'config = "{config}"', f'config = "{config}"\n'
                         'overrides = { "train.max_steps" = 40, "data.path" = "corpus/", "telemetry.human" = false }')
    # typed overrides pass through as the engine reads them
    assert cli.heartbeat_timeout_of(parse_profile(typed)) == 9.0
    fast = text.replace(f'config = "{config}"',
                        f'config = "{config}"\noverrides = {{ "mesh.heartbeat_timeout" = 2.5 }}')
    assert cli.heartbeat_timeout_of(parse_profile(fast)) == 2.5
    missing = text.replace(str(config), str(tmp_path / "absent.toml"))
    assert cli.heartbeat_timeout_of(parse_profile(missing)) == cli.DEFAULT_HEARTBEAT_TIMEOUT


def test_shell_commands_and_headless_do_not_load_textual():
    """status/drain/kill/add/stop and --headless import no UI: quick to start from a shell, nothing needs a TTY."""
    import subprocess

    from procs import ROOT

    probe = "import sys, console.cli; sys.exit(1 if 'textual' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, timeout=60).returncode == 0


def test_resume_reaches_the_cluster(unit_profile):
    seen = []

    def factory(profile, fleet, **kw):
        seen.append(kw)
        return RecordingCluster(profile, fleet)

    assert cli.main([unit_profile, "--resume", "status"], cluster_factory=factory, out=io.StringIO()) == 0
    assert cli.main([unit_profile, "status"], cluster_factory=factory, out=io.StringIO()) == 0
    assert seen == [{"resume": True}, {}]  # a fresh run unless asked


def test_every_action_subcommand_has_its_typed_call():
    """The CLI calls the cluster through ACTIONS (a typed call each, no getattr by the command's name): every
    subcommand that acts on the run has one, and the parser offers no action without one."""
    acting = set(cli.COMMANDS) - {"status", "check", "sync"}
    assert set(cli.ACTIONS) == acting == {"drain", "kill", "add", "stop"}
    for argv in (["drain", "node-a"], ["kill", "node-a"], ["add", "10.0.0.9"], ["stop"]):
        assert cli.parse_args(["p.toml", *argv]).command == argv[0]
