"""`l`: one node's log, full screen, following new lines (k9s `l`). Escape returns to the dashboard."""

from __future__ import annotations

from typing import Any, Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer

from console.widgets.panes import LogPane


class LogScreen(Screen[None]):
    BINDINGS = [Binding("escape,q,l", "close", "Back")]
    DEFAULT_CSS = """
    LogScreen LogPane { height: 1fr; }
    """

    def __init__(self, node_name: str, lookup: Callable[[str], Any | None], interval: float = 0.5) -> None:
        super().__init__()
        self.node_name = node_name
        self._lookup = lookup  # reads the fleet; the screen does no I/O
        self._interval = interval

    def compose(self) -> ComposeResult:
        yield LogPane(id="full-log")
        yield Footer()

    def on_mount(self) -> None:
        self.follow()
        self.set_interval(self._interval, self.follow)

    def follow(self) -> None:
        self.query_one(LogPane).show(self._lookup(self.node_name))

    def action_close(self) -> None:
        self.dismiss(None)
