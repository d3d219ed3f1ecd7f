"""The node table: one row per node, updated cell by cell from the fleet (never rebuilt per tick)."""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Iterable, Sequence

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, ColumnKey, RowKey

from console.widgets import cells

# (key, label, width) -- fixed widths so an in-place update never re-measures the columns
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("mark", " ", 1),
    ("name", "node", 14),
    ("host", "host", 16),
    ("state", "state", 11),  # the state alone: the reason is in the log title, the detail view, the timeline
    ("util", "util", 14),
    ("mem", "memory", 16),
    ("hb", "heartbeat", 9),
    ("step", "step", 8),
    ("loss", "loss", 8),
    ("tps", "tok/s", 9),
    ("trend", "trend", 16),
)
TREND_WIDTH = 16
TREND_METRICS = ("tokens/s", "loss")


def _last_values(history: Any, n: int) -> list[float]:
    """The newest n values of a (ts, value) deque, oldest first, without walking its 512 points each tick."""
    return [v for _, v in islice(reversed(history), n)][::-1]


def _key(value: Any) -> Any:
    # rich's Text.__eq__ ignores the base style, so a colour change alone would be missed
    if isinstance(value, Text):
        return (value.plain, str(value.style), tuple(value.spans))
    return value


def node_row(node: Any, heartbeat_timeout: float, trend: str = "tokens/s") -> dict[str, Any]:
    """The cells of one node's row, by column key. Pure: tested without an app."""
    quiet = cells.state_name(node.state) in cells.QUIET_STATES
    live = cells.shows_figures(node.state)
    util, mem = (live and cells.gpu_cells(getattr(node, "devices", {}))) or cells.device_cells(
        node.device if live else None, node.util, node.mem_used, node.mem_total)
    history = node.loss_history if trend == "loss" else node.tps_history
    spark_style = "cyan" if trend == "loss" else "green"
    # every cell a Text: a str cell is parsed as markup on every render of the table
    return {
        "mark": Text("●", style="bold yellow") if node.marked else Text(" "),
        "name": Text(str(node.name), style="bold"),
        "host": Text(str(node.host)),
        "state": cells.state_cell(node.state),
        "util": util,
        "mem": mem,
        "hb": cells.age_cell(node.heartbeat_age, heartbeat_timeout,
                             live=not quiet),
        "step": Text(cells.num_cell(node.step, "{:d}") if isinstance(node.step, int) else cells.num_cell(node.step),
                     justify="right"),
        "loss": Text(cells.loss_cell(node.loss), justify="right"),
        "tps": Text(cells.num_cell(getattr(node, "tokens_per_s_now", node.tokens_per_s)), justify="right"),
        "trend": Text(cells.sparkline(_last_values(history, TREND_WIDTH), TREND_WIDTH), style=spark_style),
    }


class NodeTable(DataTable):
    """Rows keyed by node name; `sync` touches only the cells whose rendering changed."""

    DEFAULT_CSS = """
    NodeTable { height: 1fr; min-height: 6; }
    """

    def __init__(self, heartbeat_timeout: float, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.heartbeat_timeout = heartbeat_timeout
        self.trend = TREND_METRICS[0]
        self._shown: dict[str, dict[str, Any]] = {}  # row key -> column key -> _key(value) on screen
        self.cell_updates = 0  # counted for the benchmark and the tests (proves updates are in place)
        self.rebuilds = 0  # whole-table rebuilds: only when rows go away or reorder (a filter), never per tick
        self._stale = False  # rows out of view were skipped by the last sync
        self._synced_scroll = 0.0

    def on_mount(self) -> None:
        self.fixed_columns = 2  # the mark and the node's name stay while the table scrolls sideways (80 columns)
        for key, label, width in COLUMNS:
            self.add_column(label, key=key, width=width)

    def sync(self, nodes: Iterable[Any], only: Sequence[str] | None = None) -> None:
        """Bring the table in line with `nodes` (in order); `only` limits the columns compared.

        Rows scrolled out of view are left stale (any cell update re-renders the whole visible table, so
        the cost that matters is per tick, and off-screen rows only add to it); `needs_sync()` says when a
        scroll brought stale rows into view.
        """
        wanted = list(nodes)
        names = [str(n.name) for n in wanted]
        if list(self._shown) != names[: len(self._shown)] or len(set(names)) != len(names):
            # a node went away or the order changed (a filter): the one case where rows are rebuilt
            self._rebuild(wanted)
            return
        first, last = self._visible_rows()
        self._stale = False
        changes: list[tuple[str, str, Any]] = []
        for index, node in enumerate(wanted):
            name = names[index]
            if name not in self._shown:
                row = node_row(node, self.heartbeat_timeout, self.trend)
                self.add_row(*(row[k] for k, _, _ in COLUMNS), key=name)
                self._shown[name] = {k: _key(v) for k, v in row.items()}
                continue
            if not first <= index <= last:
                self._stale = True
                continue
            row = node_row(node, self.heartbeat_timeout, self.trend)
            shown = self._shown[name]
            for col in only or row.keys():
                key = _key(row[col])
                if shown.get(col) != key:
                    changes.append((name, col, row[col]))
                    shown[col] = key
        self._synced_scroll = self.scroll_y
        self._apply(changes)

    def _apply(self, changes: list[tuple[str, str, Any]]) -> None:
        """update_cell for a batch, re-rendering only the changed cells.

        DataTable.update_cell bumps a counter that is part of every render cache key, so one changed cell
        re-renders every visible cell; at 64 nodes x 10 events/s that was most of the console's CPU. Here the
        values are stored and only the changed cells' and rows' cache entries are dropped. The tests read the
        rendered lines back, so a Textual change that breaks this shows up there; without the caches this
        falls back to update_cell.
        """
        if not changes:
            return
        self.cell_updates += len(changes)
        caches = [getattr(self, n, None) for n in ("_data", "_cell_render_cache", "_row_render_cache",
                                                   "_row_renderable_cache", "_line_cache", "_row_locations")]
        if any(c is None for c in caches):
            for name, col, value in changes:
                self.update_cell(name, col, value)
            return
        data, cell_cache, row_cache, renderable_cache, line_cache, locations = caches
        cells_changed = {(RowKey(name), ColumnKey(col)) for name, col, _ in changes}
        rows_changed = {row for row, _ in cells_changed}
        for row, col in cells_changed:
            if row not in data or col not in data[row]:
                raise CellDoesNotExist(f"no cell {row.value!r}/{col.value!r}")
        for name, col, value in changes:
            data[RowKey(name)][ColumnKey(col)] = value
        for key in [k for k in cell_cache.keys() if (k[0], k[1]) in cells_changed]:
            cell_cache.discard(key)
        for key in [k for k in row_cache.keys() if k[0] in rows_changed]:
            row_cache.discard(key)
        indices = {locations.get(row) for row in rows_changed}
        for key in [k for k in renderable_cache.keys() if k[1] in indices]:
            renderable_cache.discard(key)
        line_cache.clear()  # keyed by screen line; rebuilt cheaply from the row cache
        self.refresh()

    def _visible_rows(self) -> tuple[int, int]:
        """Row indices on screen, with a row of margin (the header takes the first line)."""
        top = int(self.scroll_y)
        height = self.size.height or 10_000  # not laid out yet: treat every row as visible
        return top - 1, top + height + 1

    def needs_sync(self) -> bool:
        return self._stale and self.scroll_y != self._synced_scroll

    def _rebuild(self, nodes: list[Any]) -> None:
        self.rebuilds += 1
        selected, place = self.selected_name(), self.cursor_row
        self.clear()
        self._shown.clear()
        seen: set[str] = set()
        for node in nodes:
            name = str(node.name)
            if name in seen:
                continue
            seen.add(name)
            row = node_row(node, self.heartbeat_timeout, self.trend)
            self.add_row(*(row[k] for k, _, _ in COLUMNS), key=name)
            self._shown[name] = {k: _key(v) for k, v in row.items()}
        if selected in self._shown:
            self.move_cursor(row=self.get_row_index(selected))
        elif self.row_count:
            # the selected node left the rows shown (a filter): the same place, never row 0, where the next k, d or
            # r (no confirmation) would act on a node nobody chose
            self.move_cursor(row=min(max(place, 0), self.row_count - 1))

    def selected_name(self) -> str | None:
        """The node under the cursor, or None when the table is empty."""
        if not self.row_count:
            return None
        row = min(max(self.cursor_row, 0), self.row_count - 1)
        return self.coordinate_to_cell_key(Coordinate(row, 0)).row_key.value

    def cell_text(self, name: str, column: str) -> str:
        """The plain text shown in one cell (for tests and the headless twin)."""
        value = self.get_cell(name, column)
        return value.plain if isinstance(value, Text) else str(value)

    def toggle_trend(self) -> str:
        self.trend = TREND_METRICS[(TREND_METRICS.index(self.trend) + 1) % len(TREND_METRICS)]
        self.columns[self._column_key("trend")].label = Text(f"trend {self.trend}")
        return self.trend

    def _column_key(self, key: str):
        for column_key in self.columns:
            if column_key.value == key:
                return column_key
        raise KeyError(key)

    def names(self) -> list[str]:
        return list(self._shown)


def visible(nodes: Iterable[Any], query: str, predicate: Callable[[Any, str], bool] | None = None) -> list[Any]:
    """Nodes matching a filter query (k9s `/`): a substring of name, host or state, case-insensitive."""
    query = query.strip().lower()
    if not query:
        return list(nodes)
    match = predicate or _matches
    return [n for n in nodes if match(n, query)]


def _matches(node: Any, query: str) -> bool:
    return any(query in s for s in (str(node.name).lower(), str(node.host).lower(), cells.state_name(node.state)))
