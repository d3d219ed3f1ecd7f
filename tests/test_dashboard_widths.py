"""The node table at the terminal widths people use (80, 100, 120 columns), read off the screen as drawn.

Defect: the table's columns were fixed and wider than the terminal. At 120 columns the last header read `tok/` and
no node's tokens/s showed; at 100 the table ended at the heartbeat column (step, loss and tokens/s gone); at 80 it
scrolled sideways. Now the columns fit the width: the least needed hide first (host, trend, memory, step), node,
state, util, heartbeat, loss and tokens/s always stay, and numbers are written to fit their column.

The Pilot test reads the compositor's text (what a terminal would show), column by column, at the x the table
draws each column, not the table's data.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import tomlkit

from console.app import make_app
from console.cluster import Cluster
from console.fleet import Fleet
from console.profile import load_profile
from console.widgets import cells
from console.widgets.node_table import COLUMNS, NUMBER_WIDTH, NodeTable, layout
from procs import fast_local_profile

ROOT = Path(__file__).resolve().parent.parent

# name -> (state, loss, tokens/s, what its loss and tokens/s must read on screen)
NODES = {
    "node-gpu-01": ("training", 3.4567, 123456.0, "3.4567", "123,456"),
    "node-gpu-02": ("training", 3.4571, 98765.4, "3.4571", "98,765"),
    "node-gpu-07": ("draining", 3.4612, 123456.0, "3.4612", "123,456"),
    "node-gpu-12": ("training", 12.3456, 1234567.0, "12.3456", "1.235M"),  # a 7-figure rate, written to fit
}
NEEDED = {"name": "node", "state": "state", "util": "util", "loss": "loss", "tps": "tok/s"}  # and hb (or heartbeat)
# the documented order: host hides first, then trend, memory, step (these names are 11 long, the hosts `local`)
HIDDEN = {80: {"host", "trend", "mem"}, 100: {"host", "trend"}, 120: set()}
COLUMNS_KEYS = [c.key for c in COLUMNS]


@pytest.fixture
def gpu_profile(tmp_path, monkeypatch):
    """profiles/local.toml with the hosts renamed as a GPU cluster names them (nothing is started)."""
    monkeypatch.chdir(ROOT)
    path = fast_local_profile(tmp_path)
    doc = tomlkit.parse(path.read_text())
    doc["store"]["host"] = "node-gpu-01"
    doc["hosts"] = {name: {} for name in NODES}
    path.write_text(tomlkit.dumps(doc))
    return load_profile(path)


def feed(fleet: Fleet) -> None:
    """Each node as a running engine reports it: run start, a state, a GPU sample, a few steps."""
    now = time.time()
    for name, (state, loss, tps, _, _) in NODES.items():
        events = [{"type": "run_start", "pid": 4242, "host": "h", "world_size": 1, "config_digest": "d",
                   "strategy": "ddp", "max_steps": 100000},
                  {"type": "state", "state": state},
                  {"type": "resource", "device": "gpu", "util": 87.5, "mem_used": 71 * 2**30, "mem_total": 80 * 2**30}]
        events += [{"type": "step", "step": 12340 + i, "loss": loss + (4 - i) * 0.01, "lr": 1e-3,
                    "tokens_per_s": tps * (0.9 + i * 0.025), "tokens": 10 ** 9, "outer_step": 2468,
                    "grad_norm": None} for i in range(5)]
        for i, event in enumerate(events):
            fleet.ingest(name, json.dumps({"v": 1, "ts": now - len(events) + i, "node": name, "rank": 0, **event}))


def screen_lines(app) -> list[str]:
    """The whole screen as a terminal shows it: the compositor's lines."""
    return [strip.text for strip in app.screen._compositor.render_strips()]


def drawn_columns(table: NodeTable, lines: list[str]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """Each column's header and each row's cells as drawn on screen: the text between the x where the table draws
    the column and its end (cut at the table's right edge, as a terminal would cut it)."""
    top, x, right = table.region.y, table.region.x, table.scrollable_content_region.right
    spans = []
    for column in table.ordered_columns:
        width = column.get_render_width(table)
        spans.append((column.key.value, x, min(x + width, right), str(column.label)))
        x += width
    header = {key: lines[top][a:b] for key, a, b, _ in spans}
    rows = {}
    for y in range(top + 1, top + 1 + table.row_count):
        row = {key: lines[y][a:b].strip() for key, a, b, _ in spans}
        rows[row["name"]] = row
    return header, rows


def assert_fits(app, width: int) -> None:
    table = app.dashboard.table
    lines = screen_lines(app)
    assert all(len(line) == width for line in lines)
    header, rows = drawn_columns(table, lines)
    labels = {c.key.value: str(c.label) for c in table.ordered_columns}
    for key, label in labels.items():  # no header cut: each reads its whole label in its own span
        assert header[key].strip() == label.strip(), (key, header[key], lines[table.region.y])
    for key, label in NEEDED.items():
        assert labels.get(key) == label, (key, labels)
    assert labels.get("hb") in ("hb", "heartbeat"), labels
    assert table.max_scroll_x == 0  # nothing off to the right
    assert set(rows) == set(NODES), rows
    for name, (state, _, _, loss, tps) in NODES.items():
        row = rows[name]
        assert (row["state"], row["loss"], row["tps"]) == (state, loss, tps), (name, row)
        assert row["util"] == "GPU  87.5%" and row["hb"].endswith("s"), row
        line = next(line for line in lines if f" {name} " in line)
        assert f" {state} " in line and f" {loss} " in line and f" {tps} " in line, line


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 30)], ids=lambda s: f"{s[0]}x{s[1]}")
async def test_the_node_table_fits_the_terminal_and_keeps_state_loss_and_tokens(gpu_profile, size):
    fleet = Fleet(run=gpu_profile.run.name)
    app = make_app(gpu_profile, Cluster(gpu_profile, fleet), fleet=fleet, start=False)
    async with app.run_test(size=size) as pilot:
        feed(fleet)
        app.tick()
        await pilot.pause()
        assert_fits(app, size[0])
        table = app.dashboard.table
        shown = [c.key.value for c in table.ordered_columns]
        assert set(COLUMNS_KEYS) - set(shown) == HIDDEN[size[0]], shown

        # wider: every column comes back; narrower again: the same columns as at first (recomputed on resize)
        await pilot.resize_terminal(160, size[1])
        await pilot.pause()
        assert [c.key.value for c in table.ordered_columns] == COLUMNS_KEYS
        assert_fits(app, 160)
        table.move_cursor(row=table.get_row_index("node-gpu-07"))
        await pilot.resize_terminal(*size)
        await pilot.pause()
        assert [c.key.value for c in table.ordered_columns] == shown
        assert_fits(app, size[0])
        assert table.selected_name() == "node-gpu-07"  # a relayout keeps the node under the cursor

        # `t` puts the loss in the trend column where it is shown, and its header says so on screen (with the
        # cursor moved a frame before, the header's cached render kept "trend tok/s")
        await pilot.press("up")
        await pilot.pause(0.6)
        for metric in ("loss", "tok/s"):
            await pilot.press("t")
            await pilot.pause()
            assert_fits(app, size[0])
            header = screen_lines(app)[table.region.y]
            assert ("trend" in shown) == (f"trend {metric} " in header), header


def test_columns_hide_in_their_order_on_both_sides_of_each_width():
    """The width where each hiding column just fits, and one column less: it hides, and those before it too."""
    names = {"name": 11, "host": 9}

    def hidden(width: int) -> set[str]:
        return set(COLUMNS_KEYS) - {key for key, _, _ in layout(width, names)}

    required = 3 + 13 + 13 + 14 + 8 + 9 + 9  # mark, name, state, util, hb, loss, tokens/s: their least, padded
    step, mem, trend, host = 9, 17, 13, 11
    assert hidden(required + step) == {"host", "trend", "mem"}
    assert hidden(required + step - 1) == {"host", "trend", "mem", "step"}
    assert hidden(required - 1) == {"host", "trend", "mem", "step"}  # the needed ones stay (the table scrolls)
    assert hidden(required + step + mem) == {"host", "trend"}
    assert hidden(required + step + mem - 1) == {"host", "trend", "mem"}
    assert hidden(required + step + mem + trend) == {"host"}
    assert hidden(required + step + mem + trend - 1) == {"host", "trend"}
    assert hidden(required + step + mem + trend + host) == set()
    assert hidden(required + step + mem + trend + host - 1) == {"host"}
    for width in range(40, 200):
        columns = layout(width, names)
        used = sum(w + 2 for _, _, w in columns)
        assert used <= width or hidden(width) == {"host", "trend", "mem", "step"}, width
        for key, label, w in columns:  # the header fits its column, and the column its least
            column = next(c for c in COLUMNS if c.key == key)
            assert len(label) <= w and (key in ("name", "host") or w >= column.min), (width, key, label, w)


def test_numbers_are_written_to_fit_their_column():
    """A cut number reads as another number: step, loss and tokens/s fit NUMBER_WIDTH, the heartbeat age six."""
    cases = {(123456, "{:,.0f}"): "123,456", (999999, "{:,.0f}"): "999,999", (1234567, "{:,.0f}"): "1.235M",
             (12345678, "{:d}"): "12.35M", (3.4567, "{:.4f}"): "3.4567", (12.3456, "{:.4f}"): "12.3456",
             (123.4567, "{:.4f}"): "123.457", (-1234567, "{:,.0f}"): "-1.235M", (1e308, "{:.4f}"): "1e+308",
             (None, "{:.4f}"): "-", (2.0e15, "{:,.0f}"): "2e+15"}
    for (value, fmt), text in cases.items():
        assert cells.fit_num(value, fmt, NUMBER_WIDTH) == text, (value, fmt)
    for value in (0, 1, 9_999_999, 10_000_000, 5e11, 7.77e12, 1e15):
        assert len(cells.fit_num(value, "{:d}" if isinstance(value, int) else "{:,.0f}", NUMBER_WIDTH)) <= 7, value
    ages = {0.6: "1s", 3.04: "3.0s", 99.94: "99.9s", 100.4: "100s", 99_999.4: "99999s", 99_999.6: "28h"}
    for age, text in ages.items():
        assert cells.age_cell(age, 6.0).plain == text, age
    assert cells.age_cell(99_999.6, 6.0, live=False).plain == "28h"
