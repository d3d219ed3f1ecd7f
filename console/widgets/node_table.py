"""The node table: one row per node, updated cell by cell from the fleet (never rebuilt per tick)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterable, Sequence

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, ColumnKey, RowKey

from console.widgets import cells


@dataclass(frozen=True)
class Column:
    """A column of the node table: its labels (longest first: the longest that fits is shown), the narrowest width
    that shows every value whole, the width it grows to where there is room, and `hides`: 0 for a column always
    shown, else its place in the order columns hide when the terminal is too narrow (1 hides first)."""

    key: str
    labels: tuple[str, ...]
    min: int
    max: int
    hides: int = 0


COLUMNS: tuple[Column, ...] = (
    Column("mark", (" ",), 1, 1),
    Column("name", ("node",), 6, 20),  # measured: as wide as the longest name shown, within these bounds
    Column("host", ("host",), 5, 16, hides=1),  # measured; also in the detail view and `status`; `/` still matches it
    Column("state", ("state",), 11, 11),  # "unreachable"; the reason is in the log title, the detail view
    Column("util", ("util",), 12, 14),  # "CPU 100.0%", "8GPU 87% ↓12"
    Column("mem", ("memory",), 15, 16, hides=3),  # "RSS 619.9M", "75.2G/79.6G", "max 75.2G/79.6G"
    Column("hb", ("heartbeat", "hb"), 6, 9),  # cells.age_cell: at most six characters
    Column("step", ("step",), 7, 8, hides=4),
    Column("loss", ("loss",), 7, 8),  # cells.fit_num: 3.4567, 123.457
    Column("tps", ("tok/s",), 7, 9),  # cells.fit_num: 123,456, then 1.235M
    Column("trend", (), 11, 16, hides=2),  # labels: trend_labels(); the sparkline as wide as its column
)
MEASURED = ("name", "host")  # as wide as their longest text (within the column's bounds), never wider
NUMBER_WIDTH = 7  # step, loss and tokens/s are written to fit this (cells.fit_num)
GROW_ORDER = ("util", "mem", "trend", "hb", "step", "loss", "tps")  # who gets the room left over first
TREND_WIDTH = 16
TREND_METRICS = ("tokens/s", "loss")


def trend_labels(metric: str) -> tuple[str, ...]:
    return (f"trend {metric}", "trend " + {"tokens/s": "tok/s"}.get(metric, metric), "trend")


def layout(width: int, measured: dict[str, int] | None = None, trend: str = TREND_METRICS[0],
           padding: int = 1) -> list[tuple[str, str, int]]:
    """The columns shown in `width` terminal columns, as (key, label, width), in table order. Pure.

    Every column starts at its minimum width (node and host: their longest text, within the column's bounds);
    while they do not fit, the columns that hide go, in their order (host, trend, memory, step); then the room
    left widens columns towards their widest, in GROW_ORDER; each shows the longest label that fits. Node, state,
    util, heartbeat, loss and tokens/s always stay (below about 70 columns the table scrolls sideways, the node's
    name fixed at the left).
    """
    def span(w: int) -> int:
        return w + 2 * padding

    measured = measured or {}
    widths = {c.key: min(max(measured.get(c.key, 0), c.min), c.max) if c.key in MEASURED else c.min
              for c in COLUMNS}
    for column in sorted((c for c in COLUMNS if c.hides), key=lambda c: c.hides):
        if sum(span(w) for w in widths.values()) <= width:
            break
        del widths[column.key]
    room = width - sum(span(w) for w in widths.values())
    for column in (c for key in GROW_ORDER for c in COLUMNS if c.key == key and key in widths):
        grow = max(0, min(column.max - widths[column.key], room))
        widths[column.key] += grow
        room -= grow
    return [(c.key, fit_label(trend_labels(trend) if c.key == "trend" else c.labels, widths[c.key]), widths[c.key])
            for c in COLUMNS if c.key in widths]


def fit_label(labels: Sequence[str], width: int) -> str:
    """The first (longest) label that fits: a header is never cut."""
    return next((label for label in labels if len(label) <= width), labels[-1][:width])


def _last_values(history: Any, n: int) -> list[float]:
    """The newest n values of a (ts, value) deque, oldest first, without walking its 512 points each tick."""
    return [v for _, v in islice(reversed(history), n)][::-1]


def _key(value: Any) -> Any:
    # rich's Text.__eq__ ignores the base style, so a colour change alone would be missed
    if isinstance(value, Text):
        return (value.plain, str(value.style), tuple(value.spans))
    return value


def node_row(node: Any, heartbeat_timeout: float, trend: str = "tokens/s",
             trend_width: int = TREND_WIDTH) -> dict[str, Any]:
    """The cells of one node's row, by column key (every column's, shown or not). Pure: tested without an app."""
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
        "step": Text(cells.fit_num(node.step, "{:d}" if isinstance(node.step, int) else "{:,.0f}", NUMBER_WIDTH),
                     justify="right"),
        "loss": Text(cells.fit_num(node.loss, "{:.4f}", NUMBER_WIDTH), justify="right"),
        "tps": Text(cells.fit_num(getattr(node, "tokens_per_s_now", node.tokens_per_s), width=NUMBER_WIDTH),
                    justify="right"),
        # as many points as the column is wide: a longer line would be cut at its newest end
        "trend": Text(cells.sparkline(_last_values(history, trend_width), trend_width), style=spark_style),
    }


class NodeTable(DataTable):
    """Rows keyed by node name; `sync` touches only the cells whose rendering changed.

    The columns shown are `layout()`'s for the table's width and the names and hosts shown: recomputed on a
    resize and when the rows change, and the rows rebuilt only when that changes the columns.
    """

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
        self.relayouts = 0  # rebuilds for other columns: a resize, or the longest name or host changed
        self._stale = False  # rows out of view were skipped by the last sync
        self._synced_scroll = 0.0
        self._layout: list[tuple[str, str, int]] = []  # the columns shown: (key, label, width)
        self._fleet_nodes: list[Any] = []  # the nodes last synced (the fleet's own objects): a relayout redraws them

    def on_mount(self) -> None:
        self.fixed_columns = 2  # the mark and the node's name stay while the table scrolls sideways (under 70)
        self._set_columns(self._wanted_layout(self._fleet_nodes))

    def on_resize(self) -> None:
        wanted = self._wanted_layout(self._fleet_nodes)
        if wanted != self._layout:
            self._rebuild(self._fleet_nodes, wanted)

    def _wanted_layout(self, nodes: Sequence[Any]) -> list[tuple[str, str, int]]:
        # the vertical scroll bar's columns are kept free: it comes with the rows, and a relayout then would
        # rebuild the table each time the rows cross the table's height
        width = (self.size.width or self.app.size.width) - self.styles.scrollbar_size_vertical
        measured = {"name": max((len(str(n.name)) for n in nodes), default=0),
                    "host": max((len(str(n.host)) for n in nodes), default=0)}
        return layout(width, measured, self.trend, self.cell_padding)

    def _set_columns(self, columns: list[tuple[str, str, int]]) -> None:
        self._layout = columns
        self.clear(columns=True)
        self._shown.clear()
        for key, label, width in columns:
            self.add_column(label, key=key, width=width)

    def _trend_width(self) -> int:
        return next((width for key, _, width in self._layout if key == "trend"), TREND_WIDTH)

    def _row(self, node: Any) -> dict[str, Any]:
        row = node_row(node, self.heartbeat_timeout, self.trend, self._trend_width())
        return {key: row[key] for key, _, _ in self._layout}

    def sync(self, nodes: Iterable[Any], only: Sequence[str] | None = None) -> None:
        """Bring the table in line with `nodes` (in order); `only` limits the columns compared.

        Rows scrolled out of view are left stale (any cell update re-renders the whole visible table, so
        the cost that matters is per tick, and off-screen rows only add to it); `needs_sync()` says when a
        scroll brought stale rows into view.
        """
        wanted = list(nodes)
        self._fleet_nodes = wanted
        names = [str(n.name) for n in wanted]
        columns = self._wanted_layout(wanted)
        if columns != self._layout:  # a longer name or host came, or the longest went: other columns fit
            self._rebuild(wanted, columns)
            return
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
                row = self._row(node)
                self.add_row(*row.values(), key=name)
                self._shown[name] = {k: _key(v) for k, v in row.items()}
                continue
            if not first <= index <= last:
                self._stale = True
                continue
            row = self._row(node)
            shown = self._shown[name]
            for col in [c for c in only if c in row] if only else row:
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
        caches: list[Any] = [getattr(self, n, None) for n in ("_data", "_cell_render_cache", "_row_render_cache",
                                                   "_row_renderable_cache", "_line_cache", "_row_locations")]
        if any(c is None for c in caches):
            for name, col, value in changes:
                self.update_cell(name, col, value)
            return
        data, cell_cache, row_cache, renderable_cache, line_cache, locations = caches
        cells_changed = {(RowKey(name), ColumnKey(col)) for name, col, _ in changes}
        rows_changed = {row for row, _ in cells_changed}
        for row, column in cells_changed:
            if row not in data or column not in data[row]:
                raise CellDoesNotExist(f"no cell {row.value!r}/{column.value!r}")
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

    def _rebuild(self, nodes: list[Any], columns: list[tuple[str, str, int]] | None = None) -> None:
        """The rows again, from `nodes`; with `columns`, the columns too (a resize, or the names' width changed)."""
        selected, place = self.selected_name(), self.cursor_row
        if columns is None:
            self.rebuilds += 1
            self.clear()
            self._shown.clear()
        else:
            self.relayouts += 1
            self._set_columns(columns)
        seen: set[str] = set()
        for node in nodes:
            name = str(node.name)
            if name in seen:
                continue
            seen.add(name)
            row = self._row(node)
            self.add_row(*row.values(), key=name)
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
        """The sparkline's metric; its column's label says which (when the column is shown)."""
        self.trend = TREND_METRICS[(TREND_METRICS.index(self.trend) + 1) % len(TREND_METRICS)]
        for index, (key, _, width) in enumerate(self._layout):
            if key == "trend":
                label = fit_label(trend_labels(self.trend), width)
                self._layout[index] = (key, label, width)
                self.columns[self._column_key("trend")].label = Text(label)
                # the header's render is cached by cursor and update count, neither of which a label changes (with
                # the cursor moved since the last frame, the old label stayed on screen)
                clear = getattr(self, "_clear_caches", None)
                if clear is not None:
                    clear()
                self.refresh()
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
