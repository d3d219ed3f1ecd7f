"""`l`: one node's log, full screen, following new lines (k9s `l`). Escape returns to the dashboard."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer

from console.screens.node_screen import NodeScreen
from console.widgets.panes import LogPane


class LogScreen(NodeScreen):
    BINDINGS = [Binding("escape,q,l", "close", "Back")]
    DEFAULT_CSS = """
    LogScreen LogPane { height: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield LogPane(id="full-log")
        yield Footer()

    def follow(self) -> None:
        self.query_one(LogPane).show(self.current_node())
