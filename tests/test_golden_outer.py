"""The outer loop against its golden table (tests/golden/outer.json): every golden run of tests/golden/record.py
(sync, overlap delayed and eager, fragments with delay and alpha; every codec; step and time rounds; the sentinel on
and off; resumes and drains at fixed steps) is run again on real engines and must give the recorded losses and
fingerprints to the last bit. A difference names the run, the node, the first step (or outer step) that differs,
and what was expected and got. A table recorded with another torch says so in the failure.

Re-record (`.venv/bin/python tests/golden/record.py --write`) only in a commit of its own that says why the numbers
moved (docs/reliability.md, "The golden table")."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("golden_record", HERE / "golden" / "record.py")
record = importlib.util.module_from_spec(_spec)
sys.modules["golden_record"] = record
_spec.loader.exec_module(record)

TABLE = json.loads(record.TABLE.read_text())


def test_the_table_holds_every_golden_run_and_how_it_was_made():
    assert sorted(TABLE["runs"]) == sorted(r["name"] for r in record.RUNS), \
        "tests/golden/record.py's RUNS and outer.json differ: re-record with --write, in a commit of its own"
    head = TABLE["header"]
    assert head["torch"] and head["python"] and head["how"] and head["recorded_from"]
    for name, run in TABLE["runs"].items():
        for node, rec in run["nodes"].items():
            assert rec["steps"] and rec["outer"] and rec["end"], (name, node)
            # every step's loss is an exact float, and every outer step has its checksum
            assert all(float.fromhex(s["loss"]) > 0 for s in rec["steps"]), (name, node)
            assert all(len(o["checksum"]) == 12 for o in rec["outer"].values()), (name, node)


@pytest.mark.slow
@pytest.mark.parametrize("spec", record.RUNS, ids=[r["name"] for r in record.RUNS])
def test_golden_run_gives_the_recorded_numbers_to_the_last_bit(spec, procs):
    got = {"header": TABLE["header"], "runs": {spec["name"]: record.record_run(spec, procs)}}
    expected = {"header": TABLE["header"], "runs": {spec["name"]: TABLE["runs"][spec["name"]]}}
    diffs = record.compare(expected, got)
    if diffs:
        pytest.fail("\n".join([f"golden run {spec['name']} differs from tests/golden/outer.json:", *diffs,
                                record.torch_note(TABLE) or f"(torch {TABLE['header']['torch']}, as recorded)"]),
                    pytrace=False)


def test_a_difference_of_one_ulp_is_named_by_run_node_and_step_and_another_torch_is_said():
    """The comparison itself, on the table: one loss one ulp off, one outer step's checksum changed."""
    import copy
    import math
    name = "sync-none-poison"
    got = copy.deepcopy({"header": TABLE["header"], "runs": {name: TABLE["runs"][name]}})
    step = got["runs"][name]["nodes"]["b"]["steps"][4]
    step["loss"] = math.nextafter(float.fromhex(step["loss"]), math.inf).hex()
    got["runs"][name]["nodes"]["c"]["outer"]["3"]["checksum"] = "0" * 12
    diffs = record.compare(TABLE, got)
    assert len(diffs) == 2, diffs
    assert diffs[0].startswith(f"{name}: node b, step 5 (the first that differs): loss expected '")
    assert f" got '{step['loss']}'" in diffs[0]
    assert diffs[1].startswith(f"{name}: node c, outer step 3 (the first that differs): checksum expected '")
    assert record.compare(TABLE, {"header": TABLE["header"], "runs": dict(TABLE["runs"])}) == []
    assert record.torch_note(TABLE) == ""
    other = dict(TABLE, header=dict(TABLE["header"], torch="2.4.0"))
    assert "recorded with torch 2.4.0, this is torch" in record.torch_note(other)
