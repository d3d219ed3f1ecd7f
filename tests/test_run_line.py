"""The run's line (the dashboard's header, the --headless status line) once the run has ended."""

from __future__ import annotations

import time

import pytest

from console.fleet import Fleet
from console.widgets import cells
from test_fleet import line, start, step


def test_an_ended_run_says_how_and_keeps_its_final_loss():
    """A completed run looked like a stopped one in the header (`loss -`, a stale ETA). Once no node runs, the line
    says how the run ended, and the final loss of the nodes there at its end."""
    fleet = Fleet(run="r")
    for name, loss in (("a", 2.0), ("b", 3.0), ("early", 9.5)):
        fleet.add_node(name, "h")
        fleet.ingest(name, start(name, max_steps=20))
        fleet.ingest(name, line("state", name, state="training"))
        fleet.ingest(name, step(10, loss + 1, 100.0, name, ts=time.time() - 5))
        fleet.ingest(name, step(19, loss, 100.0, name))
    def outer(name: str, k: int) -> str:
        return line("outer_step", name, outer_step=k, step=5 * k, generation=1, members=["a", "b"], pgrad_norm=0.1,
                    bytes_sent=0, allreduce_s=0.0, checksum="c")

    fleet.ingest("early", outer("early", 1))
    fleet.ingest("early", line("run_end", "early", status="drained", step=5))  # long before the end
    fleet.ingest("a", line("run_end", "a", status="completed", step=20))
    s = fleet.summary()  # b still trains: the run goes on, its loss is b's
    assert s.ended is None and s.loss == 3.0 and "| ETA " in cells.summary_text(s)
    fleet.ingest("a", outer("a", 4))
    fleet.ingest("b", outer("b", 4))
    fleet.ingest("b", line("run_end", "b", status="completed", step=20))
    s = fleet.summary()  # the final loss is a's and b's: early's old 9.5 moved it 2.5 -> 4.8
    assert (s.ended, s.loss, s.eta_s) == ("completed", pytest.approx(2.5), None)
    # first and short: the dashboard's header is cut at its right edge
    assert cells.summary_text(s) == "run r completed | outer 4 | step 20/20 | loss 2.5000", cells.summary_text(s)
    fleet.add_node("c", "h")  # a third node that was stopped: the run as a whole was stopped
    fleet.ingest("c", start("c"))
    fleet.ingest("c", line("run_end", "c", status="stopped", step=3))
    assert fleet.summary().ended == "stopped"


def test_a_running_runs_line_shows_its_loss_within_80_columns():
    """The header is cut at its right edge: at 80 columns a run's loss was past the cut (after tokens/s), so the
    dashboard of a run in progress showed no loss at all. The loss now comes before tokens/s and the ETA."""
    fleet = Fleet(run="lab-1b-0612")
    for name in ("node-gpu-01", "node-gpu-02"):
        fleet.add_node(name, "h")
        fleet.ingest(name, start(name, max_steps=100000))
        fleet.ingest(name, line("state", name, state="training"))
        fleet.ingest(name, step(15800, 3.4567, 123456.0, name, ts=time.time() - 5))
        fleet.ingest(name, step(15810, 3.4561, 123456.0, name))
    text = cells.summary_text(fleet.summary())
    assert "ETA " in text and "tok/s" in text
    assert "loss 3.4561" in text[:80], text
