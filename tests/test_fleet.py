"""The fleet model: numbers from events, malformed lines counted and skipped, state transitions."""

from __future__ import annotations

import time

import pytest

from console.fleet import Fleet, HostState, Node, NodeState
from console.rounds import OUTER_ROUNDS
from console.widgets.panes import timeline_line
from engine.telemetry import encode, make_event


def line(type_: str, node: str = "a", rank: int = 0, ts: float | None = None, **fields) -> str:
    return encode(make_event(type_, node, rank, ts=ts, **fields))


def step(n: int, loss: float, tps: float, node: str = "a", ts: float | None = None) -> str:
    return line("step", node, ts=ts, step=n, loss=loss, lr=1e-3, tokens_per_s=tps, grad_norm=None)


def start(node: str, pid: int = 100, max_steps: int = 100) -> str:
    return line("run_start", node, pid=pid, host="h", world_size=1, config_digest="x", strategy="ddp",
                max_steps=max_steps)


def test_ingest_numbers_and_summary():
    fleet = Fleet(run="demo")
    fleet.add_node("a", "h1")
    fleet.add_node("b", "h2")
    t0 = time.time() - 10
    for name in ("a", "b"):
        fleet.ingest(name, start(name, max_steps=100))
        fleet.ingest(name, line("state", name, state="training"))
    fleet.ingest("a", step(10, 3.0, 1000.0, ts=t0))
    fleet.ingest("a", step(20, 2.0, 1500.0, ts=t0 + 5))  # 10 steps in 5 s: 80 steps left -> 40 s
    fleet.ingest("b", step(12, 4.0, 500.0, "b", ts=t0 + 5).encode())  # bytes are accepted too
    fleet.ingest("a", line("resource", device="cpu", util=42.5, mem_used=10, mem_total=100))
    fleet.ingest("a", line("outer_step", outer_step=3, step=20, generation=2, members=["a", "b"],
                           pgrad_norm=0.1, bytes_sent=10, allreduce_s=0.1, wire_s=0.08, codec_s=0.02,
                           compute_s=1.0, outer_s=0.12, checksum="c", contributors=["a", "b"], weights=[1.0, 1.0]))
    a = fleet.nodes["a"]
    assert (a.step, a.loss, a.tokens_per_s, a.outer_step, a.pid) == (20, 2.0, 1500.0, 3, 100)
    assert (a.device, a.util, a.mem_used, a.mem_total) == ("cpu", 42.5, 10, 100)
    assert list(a.loss_history) == [(t0, 3.0), (t0 + 5, 2.0)]
    assert [v for _, v in a.tps_history] == [1000.0, 1500.0]
    assert a.state is NodeState.TRAINING and a.malformed == 0
    s = fleet.summary()
    assert (s.run, s.members, s.outer_step, s.step, s.max_steps) == ("demo", 2, 3, 20, 100)
    assert s.tokens_per_s == 2000.0
    assert s.loss == pytest.approx(3.0)
    assert s.eta_s == pytest.approx(40.0)
    assert any("step     20 loss 2.0000" in text for text in a.log)  # log lines are plain strings
    assert all(isinstance(text, str) for text in a.log) and isinstance(a.log[-1], str)
    fleet.ingest("a", line("heartbeat", ts=time.time() - 12, seq=1, peers={"b": 0.5}))
    assert 11 < a.heartbeat_age < 30 and a.peers == {"b": 0.5}  # type: ignore[operator]


def test_time_rounds_progress_and_eta_follow_the_outer_steps():
    """With time rounds the run lasts max_steps / H rounds; each node counts its own steps, and a fast one passes
    max_steps: the header said `step 1580/1000 ... ETA 0s` with rounds left. run_start says the rounds now."""
    from console.widgets import cells

    fleet, t0 = Fleet(run="mixed"), time.time() - 100
    fleet.add_node("fast", "h")
    fleet.ingest("fast", line("run_start", "fast", pid=1, host="h", world_size=1, config_digest="x",
                              strategy="ddp", max_steps=1000, rounds=50))
    fleet.ingest("fast", line("state", "fast", state="training"))
    fleet.ingest("fast", step(1580, 2.0, 900.0, node="fast"))
    for k in (10, 20):  # 10 rounds in 50 s: 30 rounds left -> 150 s
        fleet.ingest("fast", line("outer_step", "fast", ts=t0 + 5 * k, outer_step=k, step=79 * k, generation=1,
                                  members=["fast"], pgrad_norm=0.1, bytes_sent=0, allreduce_s=0.0, checksum="c"))
    s = fleet.summary()
    assert (s.rounds, s.max_steps, s.step, s.outer_step) == (50, None, 1580, 20)
    assert s.eta_s == pytest.approx(150.0)
    assert "| outer 20/50 | step 1580 |" in cells.summary_text(s)


def test_malformed_lines_counted_and_skipped():
    fleet = Fleet()
    fleet.add_node("a", "h")
    bad = ["not json", "{", '{"v": 1, "type": "step"}', '{"v": 99, "type": "step"}', "[1, 2]", b"\xff\xfe",
           line("step", step=1, loss=1.0, lr=1.0, tokens_per_s=1.0, grad_norm=None).replace('"step":1', '"step":"1"')]
    v0 = fleet.version
    for text in bad:
        fleet.ingest("a", text)
    fleet.ingest("a", step(5, 1.5, 10.0))
    a = fleet.nodes["a"]
    assert a.malformed == len(bad)
    assert a.step == 5 and a.loss == 1.5  # the good line after the garbage still counts
    assert fleet.version > v0
    assert sum("malformed line" in text for text in a.log) == 3  # the first few are explained, not all


def test_a_stray_print_on_stdout_shows_in_the_log():
    """A user's print() lands on the engine's stdout, the event stream: the log says what the line was, not only
    that it was not JSON (cut short: a stray dump of a tensor must not flood the pane)."""
    fleet = Fleet()
    fleet.ingest("a", "loss looks fine here")
    fleet.ingest("a", "x" * 500)
    fleet.ingest("a", b'{"v": 1, "type": "step"}\n')
    log = list(fleet.nodes["a"].log)
    assert log[0].startswith("[console] malformed line #1: not JSON: ") and log[0].endswith(": 'loss looks fine here'")
    assert log[1].endswith(": '" + "x" * 117 + "...'")
    assert log[2].endswith(""": '{"v": 1, "type": "step"}'""") and "missing" in log[2]


def test_state_transitions_engine_and_console_facts():
    fleet = Fleet()
    fleet.add_node("a", "h")
    assert fleet.nodes["a"].state is HostState.SPARE
    fleet.set_state("a", NodeState.STARTING)
    fleet.ingest("a", start("a"))
    for state in ("joining", "training", "draining"):
        fleet.ingest("a", line("state", state=state))
        assert fleet.nodes["a"].state.value == state
    fleet.ingest("a", line("drained", outer_step=4, step=20))
    fleet.ingest("a", line("run_end", status="drained", step=20))
    assert fleet.nodes["a"].state is NodeState.LEFT and fleet.nodes["a"].reason == "drained"

    # unreachable holds until any line arrives (the link is back), then the engine's own state shows again
    fleet.ingest("a", start("a", pid=200))
    fleet.ingest("a", line("state", state="training"))
    fleet.set_state("a", HostState.UNREACHABLE, "ssh: keepalive timeout")
    assert (fleet.nodes["a"].state, fleet.nodes["a"].reason) == (HostState.UNREACHABLE, "ssh: keepalive timeout")
    fleet.ingest("a", step(21, 1.0, 1.0))
    assert fleet.nodes["a"].state is NodeState.TRAINING and fleet.nodes["a"].reason is None
    fleet.set_state("a", HostState.UNREACHABLE, "ssh: connection refused")
    fleet.set_reachable("a")  # reconnected, nothing new to read yet
    assert fleet.nodes["a"].state is NodeState.TRAINING and fleet.nodes["a"].reason is None

    # dead holds against the old process's late lines; a new process (run_start) settles it
    fleet.set_state("a", NodeState.DEAD, "killed (SIGKILL)")
    fleet.ingest("a", line("state", state="training"))
    assert fleet.nodes["a"].state is NodeState.DEAD
    fleet.ingest("a", start("a", pid=300))
    assert fleet.nodes["a"].state is NodeState.STARTING and fleet.nodes["a"].pid == 300
    console_facts = [e.change for e in fleet.timeline if e.source == "console"]
    assert console_facts == ["starting", "unreachable", "unreachable", "dead"]


def test_failed_run_end_keeps_the_error_as_reason():
    """engine/train.py's closing lines of a crash: the error, a second one if the checkpoint before exit failed too,
    then shutdown()'s `state left` (whose reason-less LEFT once wiped the error) and run_end "failed"."""
    fleet = Fleet()
    fleet.ingest("a", start("a"))
    fleet.ingest("a", line("state", state="training"))
    fleet.ingest("a", line("error", message="RuntimeError: CUDA OOM"))
    fleet.ingest("a", line("error", message="checkpoint before exit failed: RuntimeError: CUDA OOM"))
    fleet.ingest("a", line("state", state="left"))
    fleet.ingest("a", line("run_end", status="failed", step=3))
    assert (fleet.nodes["a"].state, fleet.nodes["a"].reason) == (HostState.FAILED, "RuntimeError: CUDA OOM")
    # the next process starts clean: its own failure without an error line says "failed", not the old cause
    fleet.ingest("a", start("a", pid=200))
    fleet.ingest("a", line("state", state="left"))
    fleet.ingest("a", line("run_end", status="failed", step=3))
    assert (fleet.nodes["a"].state, fleet.nodes["a"].reason) == (HostState.FAILED, "failed")


class _NodeFiles:
    """A node's run folder as settle() reads it through a transport: the exit status, the log, the kill mark."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self.fleet = None

    def transport(self, name: str) -> _NodeFiles:
        return self

    def path(self, name: str, file: str) -> str:
        return file

    async def read_text(self, path: str) -> str | None:
        return self.files.get(path)

    async def last_lines(self, path: str, lines: int = 5) -> str:
        return "\n".join(self.files.get(path, "").splitlines()[-lines:])


async def _settled(events: list[str], files: dict[str, str]) -> Node:
    """The node after its events were read and its process was found gone, with these files left behind."""
    from console.watchers import Watchers

    fleet, hosts = Fleet(), _NodeFiles(files)
    hosts.fleet = fleet
    fleet.add_node("a", "h", NodeState.STARTING)
    for text in events:
        fleet.ingest("a", text)
    await Watchers(hosts).settle("a")  # type: ignore[arg-type]
    return fleet.nodes["a"]


async def test_a_drained_node_killed_writing_its_last_checkpoint_failed():
    """`drained` says the last round was sent, not that the process ended well: OOM-killed while it writes its final
    checkpoint (exit 137, no `state left`, no run_end), it failed, and --headless must not exit 0."""
    from console.exit_codes import EXIT_FAILED, EXIT_OK, run_outcome

    draining = [start("a"), line("state", state="training"), line("state", state="draining"),
                line("membership", change="drained", subject="a", generation=2, members=["a"]),
                line("drained", outer_step=4, step=20)]
    log = {"engine.log": "[a:0] drained\nsaving checkpoint step 20\n"}
    node = await _settled(draining, {"rc": "137\n", **log})
    assert (node.state, node.reason) == (HostState.FAILED, "exited with status 137: saving checkpoint step 20")
    fleet = Fleet()
    fleet.nodes["a"] = node
    assert run_outcome(fleet) == EXIT_FAILED
    # the same, ended as it said: run_end (whatever the exit status read), or a clean exit whose run_end was lost
    ended = draining + [line("state", state="left"), line("run_end", status="drained", step=20)]
    for events, rc in ((ended, "137\n"), (ended, None), (draining, "0\n")):
        node = await _settled(events, {"rc": rc, **log} if rc else log)
        assert (node.state, node.reason) == (NodeState.LEFT, "drained"), (len(events), rc)
        fleet.nodes["a"] = node
        assert run_outcome(fleet) == EXIT_OK


def test_membership_timeline_dedup_and_dead_peer():
    fleet = Fleet()
    for name in ("a", "b", "c"):
        fleet.add_node(name, "h", NodeState.STARTING)
        fleet.ingest(name, line("state", name, state="training"))
    # both survivors report c's death: one timeline entry, c is dead, members shrink
    for reporter in ("a", "b"):
        fleet.ingest(reporter, line("membership", reporter, change="dead", subject="c", generation=3,
                                    members=["a", "b"]))
    assert fleet.nodes["c"].state is NodeState.DEAD and "mesh" in fleet.nodes["c"].reason
    mesh_events = [e for e in fleet.timeline if e.source != "console"]
    assert [(e.change, e.subject, e.generation) for e in mesh_events] == [("dead", "c", 3)]
    assert fleet.summary().members == 2
    fleet.ingest("a", line("membership", change="joined", subject="d", generation=4, members=["a", "b", "d"]))
    assert [e.change for e in fleet.timeline if e.source != "console"] == ["dead", "joined"]
    assert fleet.members == ("a", "b", "d")
    assert fleet.summary().members == 3  # d is not a node of this fleet (yet): the mesh's word counts
    fleet.set_state("b", NodeState.DEAD, "killed")
    assert fleet.summary().members == 2  # the mesh has not said so yet, the console knows


def test_version_bumps_only_on_change():
    fleet = Fleet()
    v = fleet.version
    fleet.add_node("a", "h")
    assert fleet.version == v + 1
    fleet.add_node("a", "h")  # already there
    fleet.set_state("a", HostState.SPARE)  # same state, same reason
    assert fleet.version == v + 1
    fleet.ingest("a", step(1, 1.0, 1.0))
    assert fleet.version == v + 2


def test_unknown_node_is_created_and_bounded_history():
    fleet = Fleet()
    for i in range(2000):
        fleet.ingest("x", step(i, 1.0, 1.0))
    x = fleet.nodes["x"]
    assert x.host == "?" and x.step == 1999
    assert len(x.loss_history) == x.loss_history.maxlen and len(x.log) == x.log.maxlen


# ---- per-GPU figures, the detail view, the outer step, the store (issue 14 items 8-10) ----------------------
def gpu(index: int, util: float, used_g: float, ts: float | None = None, node: str = "a") -> str:
    """A resource sample as engine/resources.py emits one per GPU (a fake NVML: no GPU here)."""
    return line("resource", node, ts=ts, device="gpu", index=index, util=util, mem_used=int(used_g * 2**30),
                mem_total=80 * 2**30, temp_c=60 + index, power_w=300.0 + index)


def test_a_node_of_several_gpus_shows_mean_minimum_and_fullest():
    """Defect: a host of 8 GPUs was one row with one device's figures (the last sample won)."""
    from console.widgets import cells
    from console.widgets.node_table import node_row

    fleet = Fleet()
    fleet.add_node("a", "h", NodeState.TRAINING)
    for index, (util, used) in enumerate([(90.0, 40.0), (95.0, 71.0), (35.0, 20.0), (100.0, 50.0)]):
        fleet.ingest("a", gpu(index, util, used))
    node = fleet.nodes["a"]
    assert sorted(node.devices) == ["gpu 0", "gpu 1", "gpu 2", "gpu 3"]
    row = node_row(node, 6.0)
    assert row["util"].plain == "4GPU 80% ↓35"  # the straggler at 35% shows, the mean alone would hide it
    assert row["mem"].plain == "max 71.0G/80.0G"
    fleet.set_state("a", NodeState.DEAD, "killed")
    assert node_row(node, 6.0)["util"].plain == "-"  # a dead node's samples are not current figures
    assert cells.gpu_cells({"x": node.devices["gpu 0"]}) is None  # one GPU: the plain device cells


def test_detail_view_lists_every_gpu_rank_checkpoint_and_event():
    from console.screens.detail import detail_tables
    from rich.console import Console
    import io

    fleet = Fleet()
    fleet.add_node("a", "h", NodeState.TRAINING)
    now = time.time()
    fleet.ingest("a", line("run_start", pid=4242, host="h", world_size=2, config_digest="d1g3st", strategy="fsdp",
                           max_steps=100, run="r", diloco=True, dataset="fineweb-edu-10m"))
    for rank, (s, tps) in enumerate([(30, 1000.0), (29, 990.0)]):
        fleet.ingest("a", line("step", rank=rank, ts=now, step=s, loss=2.5 + rank, lr=1e-3, tokens_per_s=tps,
                               grad_norm=None, tokens=61440, outer_step=6, epoch=0.125))
    for index in (0, 1):
        fleet.ingest("a", gpu(index, 50.0 + index, 10.0, ts=now))
    fleet.ingest("a", line("checkpoint", step=30, path="runs/x/step-00000030", seconds=1.5))
    node = fleet.nodes["a"]
    node.command, node.overrides = "python -m engine.train configs/x.toml", {"train.max_steps": 100}
    out = Console(width=200, record=True, file=io.StringIO())
    for part in detail_tables(node, now=now + 2):
        out.print(part)
    text = out.export_text()
    for expected in ("4242", "python -m engine.train configs/x.toml", "d1g3st", "fsdp", "fineweb-edu-10m",
                     "train.max_steps=100", "61,440 tokens, epoch 0.125", "gpu 0", "gpu 1", "GPU  51.0%", "61C",
                     "301W", "runs/x/step-00000030", "990"):
        assert expected in text, (expected, text)
    assert fleet.dataset == "fineweb-edu-10m" and node.ranks[1].step == 29


def outer(n: int, ts: float, node: str = "a", members=("a", "b"), allreduce: float = 0.5, **new) -> str:
    return line("outer_step", node, ts=ts, outer_step=n, step=n * 10, generation=1, members=list(members),
                pgrad_norm=0.1, bytes_sent=1000, allreduce_s=allreduce, checksum="c", **new)


def test_outer_rounds_from_todays_fields_and_from_the_new_ones():
    """Today's engines: compute = time since the node's previous outer step less the all-reduce (the slowest node
    counts). Engines with compute_s/wire_s/codec_s/outer_s: those, and idle = outer_s - wire_s - codec_s."""
    from console.cli import outer_lines

    fleet = Fleet()
    for name in ("a", "b"):
        fleet.add_node(name, "h")
        fleet.ingest(name, line("state", name, ts=100.0, state="training"))
    fleet.ingest("a", outer(1, 110.0, "a", allreduce=0.5))
    fleet.ingest("b", outer(1, 112.0, "b", allreduce=1.0))
    rnd = fleet.outer_rounds[1]
    assert (rnd.compute_s, rnd.allreduce_s, rnd.bytes_sent, rnd.reporters, rnd.derived) == (11.0, 1.0, 2000, 2, True)
    assert outer_lines(fleet, -1) == (["  outer 1: compute 11.00s~ allreduce 1.00s idle - (8% comm) | 2 members | "
                                       "2.0K sent"], 1)
    fleet.ingest("a", outer(2, 120.0, "a", allreduce=0.6, compute_s=8.0, wire_s=0.4, codec_s=0.2, outer_s=1.5))
    assert outer_lines(fleet, 1) == ([], 1)  # b has not reported outer step 2 yet
    fleet.ingest("b", outer(2, 121.0, "b", allreduce=0.6, compute_s=7.0, wire_s=0.3, codec_s=0.3, outer_s=1.2))
    rnd = fleet.outer_rounds[2]
    assert (rnd.compute_s, rnd.wire_s, rnd.codec_s, rnd.derived) == (8.0, 0.4, 0.3, False)
    assert rnd.idle_s == pytest.approx(0.9)  # a's 1.5 - 0.4 - 0.2: the slowest node's wait
    lines, last = outer_lines(fleet, 1)
    assert last == 2 and lines[0].startswith("  outer 2: compute 8.00s wire 0.40s codec 0.30s idle 0.90s")

    from console.widgets.outer_chart import bar_series
    bars = bar_series(list(fleet.outer_rounds.values()))
    assert bars == {"compute": [11.0, 8.0], "wire": [0.0, 0.4], "codec": [0.0, 0.3], "idle": [0.0, rnd.idle_s]}


def test_attach_replay_keeps_the_newest_outer_rounds_with_every_nodes_report():
    """--attach reads a's file, then b's, then c's (a late joiner): early reports replayed after the window filled
    evicted good rounds for rounds of one report each. The newest OUTER_ROUNDS steps are kept, in order."""
    fleet = Fleet()
    newest = OUTER_ROUNDS + 60
    for name, first in (("a", 1), ("b", 1), ("c", 100)):
        fleet.add_node(name, "h")
        for n in range(first, newest + 1):
            fleet.ingest(name, outer(n, 1000.0 + n, name, members=("a", "b", "c")))
    assert list(fleet.outer_rounds) == list(range(61, newest + 1))
    assert {fleet.outer_rounds[n].reporters for n in range(61, 100)} == {2}
    assert {fleet.outer_rounds[n].reporters for n in range(100, newest + 1)} == {3}
    # the late joiner's file first: the others' older rounds go in order, the oldest drop out
    fleet = Fleet()
    for name, first in (("c", 100), ("a", 1)):
        fleet.add_node(name, "h")
        for n in range(first, newest + 1):
            fleet.ingest(name, outer(n, 1000.0 + n, name, members=("a", "c")))
    assert list(fleet.outer_rounds) == list(range(61, newest + 1))
    assert fleet.outer_rounds[99].reporters == 1 and fleet.outer_rounds[100].reporters == 2


def test_store_health_and_its_alert():
    from console.widgets import cells

    fleet = Fleet()
    fleet.store.address = "10.0.0.1:29600"
    assert cells.store_text(fleet.store).plain == "store 10.0.0.1:29600 off"
    fleet.store.ingest(line("state", "store", rank=-1, state="ready", host="0.0.0.0", port=29600, pid=77))
    fleet.store.ingest(line("heartbeat", "store", rank=-1, seq=1, peers={}, keys=14, rtt_ms=0.42))
    assert cells.store_text(fleet.store).plain == "store 10.0.0.1:29600 up | rtt 0.4ms | 14 keys"
    fleet.store.set("down", "store exited: Killed; restarting it")
    alert = cells.store_text(fleet.store)
    assert alert.plain.startswith("STORE DOWN 10.0.0.1:29600: store exited: Killed; restarting it -- ")
    assert "wait for it" in alert.plain and str(alert.style) == "bold white on red"
    assert fleet.store.keys is None  # a dead store has no current figures
    assert [e.change for e in fleet.timeline] == ["up", "down"]
    assert timeline_line(fleet.timeline[-1]).endswith(" store down (store exited: Killed; restarting it)")  # once


def test_a_node_held_without_steps_no_longer_counts_its_last_tokens_per_s():
    """Held at a boundary (a lost store, a straggler) a node beats and samples on, and its last tokens/s was summed
    into the cluster's as if it trained: no step for 30 s (or four of its step intervals) and it is no figure."""
    from console.widgets.node_table import node_row

    now = time.time()
    seen = [now]
    fleet = Fleet(clock=lambda: seen[0])  # when the console received each line
    # c's steps arrive now, by a clock 100 s behind the console's: current (the console's clock decides)
    for name, received, clock in (("a", now - 1, 0.0), ("b", now - 60, 0.0), ("c", now, -100.0)):
        seen[0] = received
        fleet.add_node(name, "h", NodeState.STARTING)
        fleet.ingest(name, start(name))
        fleet.ingest(name, line("state", name, state="training"))
        for k in range(3):
            fleet.ingest(name, step(k + 1, 2.0, 1000.0, node=name, ts=received + clock - 2 + k))
        fleet.ingest(name, line("heartbeat", name, seq=1, peers={}))  # b beats on, held
    assert fleet.summary().tokens_per_s == 2000.0
    assert [node_row(fleet.nodes[n], 6.0)["tps"].plain for n in "abc"] == ["1,000", "-", "1,000"]


def test_a_store_whose_probe_writes_nothing_new_is_flagged_then_cleared():
    """A hung store (alive, not answering: SIGSTOP, swapping) showed `up | rtt 0.4ms | 14 keys` for ever: the probe
    only warns on its own stream, and the console kept re-reading the last sample. Timed by the console's clock."""
    from console.widgets import cells

    now = [1000.0]
    fleet = Fleet(clock=lambda: now[0])
    fleet.store.address = "10.0.0.1:29600"
    fleet.store.ingest(line("state", "store", rank=-1, state="ready", host="0.0.0.0", port=29600, pid=77))
    sample = line("heartbeat", "store", rank=-1, ts=5.0, seq=1, peers={}, keys=14, rtt_ms=0.42)
    fleet.store.ingest(sample)
    for now[0] in (1005.0, 1010.0):  # the same sample read again (the file is re-read every poll)
        fleet.store.ingest(sample)
        fleet.store.check_samples(7.0)
    assert cells.store_text(fleet.store).plain == ("store 10.0.0.1:29600 up | rtt 0.4ms | 14 keys | no new health "
                                                   "sample for 10s: it does not answer its probe (hung? overloaded?)")
    fleet.store.ingest(line("heartbeat", "store", rank=-1, ts=16.0, seq=2, peers={}, keys=14, rtt_ms=0.5))
    fleet.store.check_samples(7.0)
    assert cells.store_text(fleet.store).plain == "store 10.0.0.1:29600 up | rtt 0.5ms | 14 keys"


def _mesh_of_three() -> tuple[Fleet, float]:
    fleet, t0 = Fleet(), time.time() - 100
    for name in ("a", "b", "c"):
        fleet.add_node(name, "h", NodeState.STARTING)
        fleet.ingest(name, line("run_start", name, ts=t0, pid=10, host="h", world_size=1, config_digest="x",
                                strategy="diloco", max_steps=100))
        fleet.ingest(name, line("state", name, ts=t0 + 1, state="training"))
    return fleet, t0


def _dead(reporter: str, subject: str, ts: float, generation: int = 3) -> str:
    return line("membership", reporter, ts=ts, change="dead", subject=subject, generation=generation,
                members=[n for n in ("a", "b", "c") if n != subject])


def test_a_mesh_dead_node_that_speaks_again_trains_without_a_new_run_start():
    """A link fault or a long freeze: the peers declare c dead, the same process re-joins (no run_start)."""
    fleet, t0 = _mesh_of_three()
    fleet.ingest("a", _dead("a", "c", t0 + 10))
    c = fleet.nodes["c"]
    assert (c.state, c.mesh_dead_ts) == (NodeState.DEAD, t0 + 10) and "mesh" in c.reason
    fleet.ingest("c", step(5, 1.0, 1.0, "c", ts=t0 + 9))  # written before the report, read after: still dead
    assert c.state is NodeState.DEAD
    fleet.ingest("c", line("outer_step", "c", ts=t0 + 12, outer_step=4, step=20, generation=4,
                           members=["a", "b", "c"], pgrad_norm=0.1, bytes_sent=1, allreduce_s=0.1, wire_s=0.1,
                           codec_s=0.0, compute_s=1.0, outer_s=0.1, checksum="k", contributors=["a", "b", "c"],
                           weights=[1.0, 1.0, 1.0]))
    assert (c.state, c.reason, c.mesh_dead_ts) == (NodeState.TRAINING, None, None)
    # a heartbeat is the node's own word too
    fleet.ingest("b", _dead("b", "c", t0 + 20, generation=5))
    assert c.state is NodeState.DEAD
    fleet.ingest("c", line("heartbeat", "c", ts=t0 + 21, seq=9, peers={"a": 0.1}))
    assert c.state is NodeState.TRAINING
    # a console fact (the process is gone) is final: a late line of the old process does not undo it
    fleet.ingest("a", _dead("a", "c", t0 + 30, generation=6))
    fleet.set_state("c", NodeState.DEAD, "process gone without an exit status (killed?)")
    fleet.ingest("c", step(30, 1.0, 1.0, "c", ts=t0 + 31))
    assert c.state is NodeState.DEAD and c.mesh_dead_ts is None


def test_a_mesh_dead_node_is_back_only_on_an_event_that_shows_it_in_the_mesh():
    """Cut off by a link fault, c trains and samples on until its next outer step finds it out: a resource sample
    or a step newer than the peers' report does not put it back in the mesh; its own `joined` (or a heartbeat, an
    outer step, a state) does. --attach in the other order (c's file first) ends the same."""
    fleet, t0 = _mesh_of_three()
    fleet.ingest("a", _dead("a", "c", t0 + 10))
    c = fleet.nodes["c"]
    fleet.ingest("c", line("resource", "c", ts=t0 + 11, device="cpu", util=50.0, mem_used=1, mem_total=2))
    fleet.ingest("c", step(6, 1.0, 1.0, "c", ts=t0 + 12))
    assert (c.state, c.mesh_dead_ts) == (NodeState.DEAD, t0 + 10)
    fleet.ingest("c", line("membership", "c", ts=t0 + 13, change="joined", subject="b", generation=4,
                           members=["a", "b"]))  # another node's join, as c saw it long ago: not c's own
    assert c.state is NodeState.DEAD
    fleet.ingest("c", line("membership", "c", ts=t0 + 14, change="joined", subject="c", generation=4,
                           members=["a", "b", "c"]))
    assert (c.state, c.mesh_dead_ts) == (NodeState.TRAINING, None)

    fleet, t0 = _mesh_of_three()
    fleet.ingest("c", line("resource", "c", ts=t0 + 11, device="cpu", util=50.0, mem_used=1, mem_total=2))
    fleet.ingest("c", step(6, 1.0, 1.0, "c", ts=t0 + 12))
    fleet.ingest("a", _dead("a", "c", t0 + 10))
    assert fleet.nodes["c"].state is NodeState.DEAD


def test_attach_replay_a_peers_old_dead_report_does_not_kill_a_node_that_spoke_since():
    """--attach reads b's whole file, then a's: a's old `dead b` lands after b's newer own events."""
    fleet, t0 = _mesh_of_three()
    fleet.ingest("b", line("run_start", "b", ts=t0 + 50, pid=20, host="h", world_size=1, config_digest="x",
                           strategy="diloco", max_steps=100))
    fleet.ingest("b", line("state", "b", ts=t0 + 60, state="training"))
    fleet.ingest("a", _dead("a", "b", t0 + 40))  # about b's previous process, replayed late
    assert fleet.nodes["b"].state is NodeState.TRAINING and fleet.nodes["b"].mesh_dead_ts is None
    # the other order (a's file first) ends the same: b's own later events override the report
    fleet, t0 = _mesh_of_three()
    fleet.ingest("a", _dead("a", "b", t0 + 40))
    assert fleet.nodes["b"].state is NodeState.DEAD
    fleet.ingest("b", line("run_start", "b", ts=t0 + 50, pid=20, host="h", world_size=1, config_digest="x",
                           strategy="diloco", max_steps=100))
    fleet.ingest("b", line("state", "b", ts=t0 + 60, state="training"))
    assert fleet.nodes["b"].state is NodeState.TRAINING
    # a run_start older than the report does not undo it: the report is about that process
    fleet.ingest("a", _dead("a", "b", t0 + 70, generation=4))
    fleet.ingest("b", line("run_start", "b", ts=t0 + 65, pid=20, host="h", world_size=1, config_digest="x",
                           strategy="diloco", max_steps=100))
    assert fleet.nodes["b"].state is NodeState.DEAD


def test_attach_replay_a_peers_old_drained_report_does_not_end_a_node_restarted_since():
    """The 50-fault soak: b drained and was added again; a console attached later read b's file (b training in its
    new process), then a's, whose `drained b` about b's previous process set b left: `training 1 left 2` for a
    run of three training nodes."""
    fleet, t0 = _mesh_of_three()
    fleet.ingest("b", line("run_start", "b", ts=t0 + 50, pid=20, host="h", world_size=1, config_digest="x",
                           strategy="diloco", max_steps=100))
    fleet.ingest("b", line("state", "b", ts=t0 + 60, state="training"))
    fleet.ingest("a", line("membership", "a", ts=t0 + 40, change="drained", subject="b", generation=4,
                           members=["a", "b", "c"]))
    assert fleet.nodes["b"].state is NodeState.TRAINING
    assert fleet.summary().members == 3
    # in order (followed live), the same report ends b until its new process speaks
    fleet, t0 = _mesh_of_three()
    fleet.ingest("a", line("membership", "a", ts=t0 + 40, change="drained", subject="b", generation=4,
                           members=["a", "b", "c"]))
    assert fleet.nodes["b"].state is NodeState.LEFT


def test_a_process_that_ended_as_it_said_is_not_left_dead_by_a_later_mesh_report():
    """--attach reads a's file first (it declared c dead), then c's: its run_end is older than the report, so c
    stays dead on the mesh's word; once its process is gone, its own run_end is what counts."""
    fleet, t0 = _mesh_of_three()
    fleet.ingest("a", _dead("a", "c", t0 + 12))
    fleet.ingest("c", line("run_end", "c", ts=t0 + 10, status="completed", step=100))
    c = fleet.nodes["c"]
    assert c.state is NodeState.DEAD and c.engine_state is NodeState.LEFT
    assert fleet.process_ended("c") and (c.state, c.reason, c.mesh_dead_ts) == (NodeState.LEFT, "completed", None)
    assert not fleet.process_ended("c") and not fleet.process_ended("a")  # nothing of the mesh's to undo


def test_each_nodes_share_of_a_round_comes_from_the_token_weights():
    """Engines weigh each contributor by the tokens of its round: with time rounds a host twice as fast has twice
    the share. The detail view and the outer chart's caption show it; a joiner (not counted) shows as such."""
    from console.screens.detail import detail_tables
    from console.widgets.cells import outer_line
    fleet = Fleet(run="mixed")
    for name in ("a", "b", "c"):
        fleet.add_node(name, "h")
    for name in ("a", "b", "c"):
        fleet.ingest(name, line("outer_step", name, outer_step=7, step=40, generation=3, members=["a", "b", "c"],
                                pgrad_norm=0.1, bytes_sent=10, allreduce_s=0.1, wire_s=0.08, codec_s=0.02,
                                compute_s=1.0, outer_s=0.12, checksum="c", contributors=["a", "b"],
                                weights=[6000.0, 2000.0]))
    a, b, c = (fleet.nodes[n] for n in "abc")
    assert (a.round_tokens, a.round_share) == (6000.0, 0.75) and (b.round_tokens, b.round_share) == (2000.0, 0.25)
    assert (c.round_tokens, c.round_share) == (0.0, 0.0)
    rnd = fleet.outer_rounds[7]
    assert rnd.shares == {"a": 0.75, "b": 0.25}
    assert outer_line(rnd).endswith("| shares a 75% b 25%")
    assert "6,000 tokens, 75% of the mean" in _grid_text(detail_tables(a))
    assert "not counted" in _grid_text(detail_tables(c))


def _grid_text(renderables) -> str:
    from rich.console import Console
    console = Console(width=200, record=True)
    for r in renderables:
        console.print(r)
    return console.export_text()


def test_bytes_against_fp32_and_the_sparse_residual():
    """An outer step's bytes and their part of what the same exchanges would have sent uncompressed, in the headless
    line and the outer chart's legend; only when every reporter said (an older engine beside a new one: bytes
    only). The node detail shows the error-feedback accumulator against the weights, and says when it keeps
    growing (4 outer steps in a row), not when it only grew once."""
    from console.cli import outer_lines
    from console.screens.detail import detail_tables
    from console.widgets.cells import bytes_text

    fleet = Fleet()
    for name in ("a", "b"):
        fleet.add_node(name, "h")
        fleet.ingest(name, line("state", name, ts=100.0, state="training"))
    # a sends 1000 bytes of 98,000, b 1000 of 98,000: 2000 of 196,000 = 1/98
    fleet.ingest("a", outer(1, 110.0, "a", fp32_bytes=98_000, residual_norm=0.5, weights_norm=10.0))
    fleet.ingest("b", outer(1, 111.0, "b", fp32_bytes=98_000))
    lines, _ = outer_lines(fleet, -1)
    assert lines[0].endswith("| 2 members | 2.0K sent (1/98 of fp32)"), lines
    fleet.ingest("a", outer(2, 120.0, "a", fp32_bytes=98_000))
    fleet.ingest("b", outer(2, 121.0, "b"))  # an engine that does not say: no factor made of half the reporters
    assert bytes_text(fleet.outer_rounds[2]) == "2.0K sent"

    # the outer chart's legend: whole where it fits; at 80 columns (42 cells of border) the factor stays readable
    from rich.text import Text

    from console.widgets.outer_chart import first_fitting, legend_forms
    rnd = fleet.outer_rounds[1]
    series = {"compute": [1.0], "wire": [0.1], "codec": [0.1], "idle": [0.1]}
    forms = legend_forms(series, bytes_text(rnd), bytes_text(rnd, short=True), "")
    assert Text.from_markup(first_fitting(forms, 200)).plain == "█ compute █ wire █ codec █ idle  2.0K sent (1/98 of fp32)"
    assert Text.from_markup(first_fitting(forms, 52)).plain == "█ compute █ wire █ codec █ idle  2.0K = 1/98 fp32"
    assert Text.from_markup(first_fitting(forms, 42)).plain.startswith("2.0K = 1/98 fp32  █compute █wire")
    assert first_fitting(legend_forms(series, "", "", "c: loss"), 200).endswith("idle  c: loss")

    node = fleet.nodes["a"]
    assert node.residual_ratio == pytest.approx(0.05)

    def residual_row() -> str:
        import io

        from rich.console import Console

        out = Console(width=200, record=True, file=io.StringIO())
        for part in detail_tables(node, now=200.0):
            out.print(part)
        return next(t for t in out.export_text().splitlines() if t.startswith("residual"))

    assert "|e|/|w| = 0.05 " in residual_row() and "raise diloco.density" not in residual_row()
    for n, r in ((3, 0.6), (4, 0.7), (5, 0.65)):  # grew twice, then fell: not "keeps growing"
        fleet.ingest("a", outer(n, 100.0 + 10 * n, "a", residual_norm=r, weights_norm=10.0))
    assert "raise diloco.density" not in residual_row()
    for n, r in ((6, 0.7), (7, 0.8), (8, 0.9)):  # 0.65 < 0.7 < 0.8 < 0.9: four in a row grew
        fleet.ingest("a", outer(n, 100.0 + 10 * n, "a", residual_norm=r, weights_norm=10.0))
    assert "|e|/|w| = 0.09 " in residual_row() and "grew at each of the last 4 outer steps" in residual_row()
