"""One vocabulary of node states (engine/states.py): the mesh stores its words, a node's `state` events say them, the
console shows them, and the console's own words for a host (console/nodes.py HostState) are none of them.

Two kinds of check: the sets themselves (every table the console keys by state covers exactly the words it can show;
no word in both sets; the mesh's store value and the event refuse a word outside them), and the sources: no state
typed by hand where a state is written, compared or listed, in the mesh, the engine's events or the console. A
hand-typed word is how a vocabulary drifts ("standby" meant a spare host in the console and a stepped-out node in
the mesh)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from console import fleet as fleet_module
from console.nodes import SHOWN_STATES, HostState, shown
from console.screens.help import STATE_MEANINGS, STATES
from console.widgets import cells
from engine.mesh import protocol
from engine.mesh.protocol import StateRecord
from engine.states import EVENT_STATES, STORED_STATES, NodeState
from engine.telemetry import NODE_STATES, STORE_STATES, BadEvent, encode, make_event, parse_line

ROOT = Path(__file__).resolve().parent.parent
NODE_WORDS = {s.value for s in NodeState}
HOST_WORDS = {s.value for s in HostState}


# ---- the sets --------------------------------------------------------------------------------------------------

def test_no_word_is_both_a_node_state_and_a_console_word():
    assert NODE_WORDS == {"starting", "joining", "training", "draining", "standby", "left", "dead"}
    assert HOST_WORDS == {"spare", "off", "unreachable", "failed"}
    assert NODE_WORDS & HOST_WORDS == set()
    assert set(SHOWN_STATES) == set(NodeState) | set(HostState) and len(SHOWN_STATES) == 11


def test_the_mesh_stores_the_node_states_and_refuses_any_other_word():
    assert protocol.NODE_STATES == tuple(s.value for s in NodeState)
    assert STORED_STATES == set(NodeState) - {NodeState.DEAD}  # dead is the peers' verdict, never written
    for state in STORED_STATES:
        text = StateRecord(state, "tok", (0, 3, 1), reason="drained").to_json()
        assert json.loads(text)["s"] == state.value  # the stored string is the word itself (docs/mesh.md)
        back = StateRecord.from_json(text)
        assert back is not None and back.state is state
    with pytest.raises(ValueError, match="spare"):
        StateRecord("spare").to_json()  # type: ignore[arg-type]
    with pytest.raises(protocol.MeshError, match="'stand-by', not one of starting, joining"):
        StateRecord.from_json('{"s":"stand-by","t":""}')


def test_a_nodes_state_events_say_node_states_and_a_reader_takes_any_word():
    assert NODE_STATES == ("starting", "joining", "training", "draining", "left")
    assert set(NODE_STATES) == {s.value for s in EVENT_STATES} and set(NODE_STATES) <= NODE_WORDS
    assert set(STORE_STATES) & (NODE_WORDS | HOST_WORDS) == set()
    for word in NODE_STATES:
        assert parse_line(encode(make_event("state", "node-a", 0, ts=1.0, state=word)))["state"] == word
    for word in ("spare", "standby", "ready"):  # a console word, the mesh's own, the store's
        with pytest.raises(BadEvent, match=word):
            make_event("state", "node-a", 0, state=word)
    assert make_event("state", "store", -1, state="ready")["state"] == "ready"
    with pytest.raises(BadEvent, match="training"):
        make_event("state", "store", -1, state="training")
    # the reader is not the producer: a line of another engine with a word this one does not know still parses
    line = '{"v":1,"type":"state","ts":1,"node":"node-a","rank":0,"state":"hibernating"}'
    assert parse_line(line)["state"] == "hibernating"


def test_the_console_keys_its_tables_by_the_words_it_can_show():
    words = {s.value for s in SHOWN_STATES}
    assert set(cells.STATE_STYLES) == words  # every word it can show has a colour; nothing else has one
    assert cells.REASON_STATES <= words and cells.QUIET_STATES <= words
    assert set(fleet_module._ENGINE_STATES) == set(NODE_STATES)  # what a state event may say
    # the help's table: what the dashboard shows (the events' states, dead, the console's words; not standby)
    assert set(STATE_MEANINGS) == set(EVENT_STATES) | {NodeState.DEAD} | set(HostState)
    assert "`standby`" in STATES and "`spare`" in STATES
    assert shown("spare") is HostState.SPARE and shown("standby") is NodeState.STANDBY
    with pytest.raises(ValueError, match="neither"):
        shown("completed")


def test_every_word_the_console_shows_has_its_colour_and_the_quiet_ones_show_no_figures():
    for state in SHOWN_STATES:
        assert cells.state_cell(state).plain == state.value and cells.state_cell(state).style, state
    quiet = {NodeState.LEFT, HostState.SPARE, HostState.OFF, HostState.FAILED}
    for state in SHOWN_STATES:  # a spare host's last sample (or a gone node's) is no live figure
        assert cells.shows_figures(state) is (state not in quiet and state is not NodeState.DEAD), state
    assert cells.reason_text(HostState.SPARE, "why") == "" and cells.reason_text(HostState.FAILED, "why") == "why"


def test_a_fleet_shows_an_unknown_event_word_in_the_log_not_in_the_table():
    fleet = fleet_module.Fleet()
    fleet.add_node("node-a", "h", NodeState.STARTING)
    fleet.ingest("node-a", '{"v":1,"type":"state","ts":1,"node":"node-a","rank":0,"state":"standby"}')
    node = fleet.nodes["node-a"]
    assert node.state is NodeState.STARTING and "unknown state 'standby'" in list(node.log)[-1]
    fleet.ingest("node-a", '{"v":1,"type":"state","ts":2,"node":"node-a","rank":0,"state":"training"}')
    assert node.state is NodeState.TRAINING


# ---- the sources -----------------------------------------------------------------------------------------------

STATE_ATTRS = {"state", "engine_state"}
STATE_CALLS = {"set_state": 1, "add_node": 2, "_engine_says": 1, "announce": 0, "StateRecord": 0}  # arg index


def _str_constants(node: ast.AST) -> list[str]:
    """The string constants of an expression that names states: a constant, or the elements of a literal
    tuple / list / set, or of frozenset({...}) / set((...))."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _str_constants(e)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set") \
            and node.args:
        return _str_constants(node.args[0])
    return []


STORE_CLASSES = ("StoreHealth",)  # console/store_health.py: the store's health, fleet.store


def _is_state(node: ast.AST) -> bool:
    """A node's state: `x.state` / `x.engine_state` (not the store's: it has its own words), or state_name(...)."""
    if isinstance(node, ast.Attribute) and node.attr in STATE_ATTRS:
        return not ast.unparse(node.value).endswith("store")
    return isinstance(node, ast.Call) and ast.unparse(node.func).endswith("state_name")


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _call_name(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def hand_typed_states(path: Path) -> list[str]:
    """Every place in a file where a state is written, compared or listed as a typed string."""
    found: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text(), str(path))
    # the store's own class speaks of itself as self.state, in the store's words (up, off...): not node states
    store_lines = {n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in STORE_CLASSES
                   for n in range(c.lineno, (c.end_lineno or c.lineno) + 1)}
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in store_lines:
            continue
        words: list[str] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_state(o) for o in operands):
                words = [w for o in operands for w in _str_constants(o)]
        elif isinstance(node, ast.Call) and _call_name(node) in STATE_CALLS:
            index = STATE_CALLS[_call_name(node)]
            args = node.args[index:index + 1] + [k.value for k in node.keywords if k.arg == "state"]
            words = [w for a in args for w in _str_constants(a)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_is_state(t) for t in targets) and node.value is not None:
                words = _str_constants(node.value)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            # a literal set (or table's keys) of words that are all states: states typed by hand, wherever used. A
            # set that mixes in other words is another vocabulary that shares some (the store's "off", a membership
            # change "left", a run_end status "failed")
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            elements = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if elements and len(elements) == len(elts) and set(elements) <= NODE_WORDS | HOST_WORDS:
                words = elements
        found += [(node.lineno, w) for w in words]
    return [f"{_where(path)}:{line}: {w!r}" for line, w in sorted(set(found))]  # a compared tuple counts once


def event_state_words(path: Path) -> list[tuple[str, str]]:
    """(where, word) for every `emit("state", state="...")` / `make_event("state", ..., state="...")` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and _call_name(node) in ("emit", "_emit", "make_event") and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "state":
            for k in node.keywords:
                if k.arg == "state" and isinstance(k.value, ast.Constant):
                    found.append((f"{_where(path)}:{node.lineno}", k.value.value))
    return found


def test_the_mesh_and_the_console_type_no_state_by_hand():
    files = sorted((ROOT / "engine" / "mesh").glob("*.py")) + sorted((ROOT / "console").rglob("*.py"))
    assert [line for f in files for line in hand_typed_states(f)] == []


def test_every_state_event_the_engine_sends_says_a_word_of_the_vocabulary():
    found = [hit for f in sorted((ROOT / "engine").rglob("*.py")) for hit in event_state_words(f)]
    assert {w for _, w in found} >= {"starting", "training", "left", "ready"}  # the scan sees the senders
    assert [f"{where}: {w!r}" for where, w in found if w not in NODE_STATES + STORE_STATES] == []


def test_the_scan_sees_a_hand_typed_state(tmp_path):
    """The oracle: each way a typed word slips in is found, and the enum's words are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        'QUIET_STATES = frozenset({"left", "standby"})\n'
        'if node.state in ("off", "spare"):\n    pass\n'
        'if state_name(node.state) == "dead":\n    pass\n'
        'fleet.set_state("a", "failed", "why")\n'
        'node.engine_state = "training"\n'
        'self.registration.announce("left")\n'
        'if store.state == "up":\n    pass\n'  # the store's own words: not node states
        'class StoreHealth:\n    def up(self):\n        return self.state == "up"\n'  # ... nor in its own class
        'if node.state is NodeState.DEAD or node.reason == "drained":\n    pass\n'
        'emit("state", state="standing")\n')
    hits = [h.split(": ", 1)[1] for h in hand_typed_states(sample)]
    assert sorted(hits) == sorted(["'left'", "'standby'", "'off'", "'spare'", "'dead'", "'failed'", "'training'",
                                   "'left'"])
    assert [w for _, w in event_state_words(sample)] == ["standing"]
