"""The CLI without a screen: argument rules, bad profiles, the headless status line and outcome, the subcommands,
and the pure cell formats the table shares with them."""

from __future__ import annotations

import io
import math
import time

import pytest

from console import cli
from console.fleet import Fleet, NodeState
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
    assert str(cells.age_cell(0.5, 6.0).style) == "green"
    assert str(cells.age_cell(3.0, 6.0).style) == "yellow"
    assert str(cells.age_cell(7.0, 6.0).style) == "bold red"
    assert cells.age_cell(None, 6.0).plain == "-"
    assert cells.age_cell(float("nan"), 6.0).plain == "-"


def test_sparkline_scales_between_min_and_max_and_skips_bad_values():
    assert cells.sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert cells.sparkline([5.0, None, math.nan, 5.0]) == "▄▄"
    assert cells.sparkline([]) == ""
    assert len(cells.sparkline(range(100), width=12)) == 12


def test_number_formats_never_raise_on_garbage():
    assert cells.num_cell(None) == "-" and cells.num_cell(math.inf) == "-" and cells.num_cell("x") == "-"
    assert cells.loss_cell(3.14159) == "3.1416"
    assert cells.eta_text(3725) == "1h02m" and cells.eta_text(65) == "1m05s" and cells.eta_text(None) == "-"
    assert cells.state_cell("dead", "killed by operator").plain == "dead (killed by operator)"


def test_node_row_has_the_live_values():
    fleet = _training_fleet(step=42, loss=2.25, tps=1234.0)
    row = node_row(fleet.nodes["node-b"], heartbeat_timeout=6.0)
    assert row["name"].plain == "node-b" and row["state"].plain == "training"
    assert (row["step"], row["loss"], row["tps"]) == ("42", "2.2500", "1,234")


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
    fleet.set_state("a", NodeState.UNREACHABLE, "link down")
    assert cli.run_outcome(fleet) is None  # its engine may still train


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
