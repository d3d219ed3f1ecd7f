"""What the full-screen views of one node share (`l` its log, Enter its detail): the node's name, a lookup into the
fleet, a redraw every `interval` seconds while shown, and escape back to the dashboard. Render only: no I/O."""

from __future__ import annotations

from typing import Callable

from textual.screen import Screen

from console.nodes import Node


class NodeScreen(Screen[None]):
    """A subclass composes its widgets and says in `follow()` how to draw the node (None: no such node now)."""

    def __init__(self, node_name: str, lookup: Callable[[str], Node | None], interval: float = 0.5) -> None:
        super().__init__()
        self.node_name = node_name
        self._lookup = lookup  # reads the fleet; the screen does no I/O
        self._interval = interval

    def current_node(self) -> Node | None:
        return self._lookup(self.node_name)

    def on_mount(self) -> None:
        self.follow()
        self.set_interval(self._interval, self.follow)

    def follow(self) -> None:
        raise NotImplementedError

    def action_close(self) -> None:
        self.dismiss(None)
