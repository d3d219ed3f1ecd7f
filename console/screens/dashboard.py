"""The dashboard: header, node table, loss chart, membership timeline and the selected node's log.

It renders what the app hands it and turns keys into messages to the app (which owns the cluster and its
workers): `DashboardScreen.Drain(names)`, `.Kill`, `.Restart`, `.AddNode`, `.ShowLogs(node)`, `.ShowDetail(node)`,
`.ShowHelp`, `.Quit`, and `.Ready` once its first frame can be drawn. It never does I/O and never reads the cluster.
"""

from __future__ import annotations

from typing import ClassVar, Iterable, Sequence

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input

from console.fleet import Fleet
from console.nodes import Node
from console.widgets.loss_chart import LossChart
from console.widgets.node_table import NodeTable, visible
from console.widgets.outer_chart import OuterChart
from console.widgets.panes import LogPane, RunHeader, Timeline

# actions that change the cluster: hidden (and refused) in --readonly
MUTATING = frozenset({"add", "drain", "kill", "restart"})
# rows under the table that hold both charts; fewer (80x24 with a few nodes), one at a time, `c` swaps. 16 (8 each)
# left the loss chart one row of plot at 80x24 once the node table had no sideways scroll bar to take a row
BOTH_CHARTS_ROWS = 17


class ChartArea(Horizontal):
    """The charts and the side panes under the table. Its height follows the table's rows, the filter box and the
    terminal: each change refits the charts (a screen resize alone missed a filter that shrank the table)."""

    def on_resize(self) -> None:
        if isinstance(self.screen, DashboardScreen):
            self.screen.fit_charts()


class DashboardScreen(Screen[None]):
    CSS_PATH = "dashboard.tcss"
    BINDINGS = [
        Binding("a", "add", "Add"),
        Binding("d", "drain", "Drain"),
        Binding("k", "kill", "Kill"),
        Binding("r", "restart", "Restart"),
        Binding("l", "logs", "Logs"),
        Binding("slash", "filter", "Filter"),
        Binding("space", "mark", "Mark"),
        Binding("t", "trend", "Trend", show=False),
        Binding("c", "swap_chart", "Chart", show=False),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    class NodeAction(Message):
        """A key asked for `verb` on nodes (the marked ones shown, else the selected one); the app confirms where
        the action is destructive, skips nodes in a state it does not fit, and runs it."""

        verb: ClassVar[str]

        def __init__(self, names: Sequence[str]) -> None:
            super().__init__()
            self.names = tuple(names)

    class Drain(NodeAction):
        verb = "drain"

    class Kill(NodeAction):
        verb = "kill"

    class Restart(NodeAction):
        verb = "restart"

    class AddNode(Message):
        """`a`: the app asks which host (a standby one or a new address) and adds it."""

    class ShowLogs(Message):
        def __init__(self, node: str) -> None:
            super().__init__()
            self.node = node

    class ShowDetail(Message):
        def __init__(self, node: str) -> None:
            super().__init__()
            self.node = node

    class ShowHelp(Message):
        pass

    class Quit(Message):
        pass

    class Ready(Message):
        """Mounted: the app draws the first frame now rather than at its next tick."""

    def __init__(self, fleet: Fleet, heartbeat_timeout: float, readonly: bool = False) -> None:
        super().__init__()
        self.fleet = fleet  # read only: the app owns it and feeds it
        self.heartbeat_timeout = heartbeat_timeout
        self.readonly = readonly
        self.filter_query = ""
        self.one_chart = "loss"  # the chart shown when only one fits: "loss" or "outer"

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        yield NodeTable(self.heartbeat_timeout, id="nodes")
        with ChartArea(id="lower"):
            with Vertical(id="charts"):
                yield LossChart(id="chart")
                yield OuterChart(id="outer")
            with Vertical(id="side"):
                yield Timeline(id="timeline")
                yield LogPane(id="log")
        yield Input(placeholder="filter: name, host or state (enter keeps it, escape clears)", id="filter")
        # at 80 columns ^p sat over ? Help and q Quit (the help screen names ctrl+p)
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one(NodeTable).focus()
        self.call_after_refresh(self.post_message, self.Ready())  # the first frame shows the nodes

    # ---- rendering (called by the app's 2 Hz tick) -------------------------------------------------------
    @property
    def table(self) -> NodeTable:
        return self.query_one(NodeTable)

    def render_fleet(self, fleet: Fleet) -> None:
        nodes = visible(fleet.nodes.values(), self.filter_query)
        self.query_one(RunHeader).show(fleet.summary(), self.readonly, fleet.store, fleet.dataset)
        self.table.sync(nodes)
        self.query_one(Timeline).show(fleet.timeline)
        self.query_one(LogPane).show(fleet.nodes.get(self.table.selected_name() or ""))

    def render_chart(self, fleet: Fleet) -> None:
        focus = [n for n in self.table.names() if fleet.nodes[n].marked]
        selected = self.table.selected_name()
        self.query_one(LossChart).show(visible(fleet.nodes.values(), self.filter_query),
                                       focus=([selected] if selected else []) + focus)
        self.query_one(OuterChart).show(fleet)

    def fit_charts(self) -> None:
        """Both charts where the rows under the table hold them; else the one chosen, and its border names `c`.
        (At 80x24 the outer-step chart was laid out below the screen's last row.)"""
        loss, outer = self.query_one(LossChart), self.query_one(OuterChart)
        one = 0 < self.query_one("#lower").size.height < BOTH_CHARTS_ROWS
        loss.display = not one or self.one_chart == "loss"
        outer.display = not one or self.one_chart == "outer"
        loss.border_subtitle = "c: outer steps" if one else ""
        outer.set_hint("c: loss" if one else "")

    def render_ages(self, fleet: Fleet) -> None:
        """Heartbeat ages grow with the clock, not with events: refresh that one column."""
        self.table.sync(visible(fleet.nodes.values(), self.filter_query), only=("hb",))

    @on(DataTable.RowSelected, "#nodes")
    def _open_detail(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.post_message(self.ShowDetail(event.row_key.value))  # Enter: the node in full

    @on(DataTable.RowHighlighted, "#nodes")
    def _selected(self, event: DataTable.RowHighlighted) -> None:
        self.query_one(LogPane).show(self.fleet.nodes.get(event.row_key.value or ""))

    # ---- keys ---------------------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.readonly and action in MUTATING:
            return False  # hidden from the footer and refused
        return True

    def targets(self) -> list[str]:
        """Marked nodes (among those shown) if any, else the node under the cursor."""
        shown = self.table.names()
        nodes = self.fleet.nodes
        marked = [n for n in shown if n in nodes and nodes[n].marked]
        if marked:
            return marked
        selected = self.table.selected_name()
        return [selected] if selected else []

    def action_add(self) -> None:
        self.post_message(self.AddNode())

    def action_drain(self) -> None:
        self.post_message(self.Drain(self.targets()))

    def action_kill(self) -> None:
        self.post_message(self.Kill(self.targets()))

    def action_restart(self) -> None:
        self.post_message(self.Restart(self.targets()))

    def action_logs(self) -> None:
        name = self.table.selected_name()
        if name:
            self.post_message(self.ShowLogs(name))

    def action_mark(self) -> None:
        name = self.table.selected_name()
        node = self.fleet.nodes.get(name) if name else None
        if node is None:
            return
        node.marked = not node.marked
        self.table.sync(self._visible(), only=("mark",))
        if self.table.cursor_row < self.table.row_count - 1:  # htop: space marks and moves down
            self.table.move_cursor(row=self.table.cursor_row + 1)

    def unmark(self, names: Iterable[str]) -> None:
        for name in names:
            node = self.fleet.nodes.get(name)
            if node is not None:
                node.marked = False
        self.table.sync(self._visible(), only=("mark",))

    def action_swap_chart(self) -> None:
        """Only where one chart fits: the other one."""
        if self.query_one(LossChart).display != self.query_one(OuterChart).display:
            self.one_chart = "outer" if self.one_chart == "loss" else "loss"
            self.fit_charts()

    def action_trend(self) -> None:
        metric = self.table.toggle_trend()
        self.table.sync(self._visible(), only=("trend",))
        self.notify(f"sparkline: {metric}", timeout=2, markup=False)

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display = False
        self.set_filter("")
        self.table.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.set_filter(event.value)

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        if not event.value.strip():
            event.input.display = False
        self.table.focus()

    def set_filter(self, query: str) -> None:
        self.filter_query = query
        self.render_fleet(self.fleet)
        self.render_chart(self.fleet)

    def action_help(self) -> None:
        self.post_message(self.ShowHelp())

    def action_quit(self) -> None:
        self.post_message(self.Quit())

    def _visible(self) -> list[Node]:
        return visible(self.fleet.nodes.values(), self.filter_query)
