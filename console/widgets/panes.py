"""The run header, the selected node's log pane and the membership timeline: render only, fed by the app."""

from __future__ import annotations

import time
from typing import Any, Iterable

from rich.text import Text
from textual.content import Content
from textual.widgets import Log, Static

from console.widgets import cells
from console.widgets.cells import summary_text

LOG_TAIL = 300  # lines of the selected node shown in the pane (the fleet keeps 500)


class RunHeader(Static):
    DEFAULT_CSS = """
    RunHeader { height: 1; background: $primary-background; color: $text; text-style: bold; padding: 0 1; }
    """

    def show(self, summary: Any, readonly: bool = False) -> None:
        line = summary_text(summary)
        if line == self._shown:
            return
        self._shown = line
        text = Text("ZeroBand ", style="bold")
        text.append(line)
        if readonly:
            text.append("  [read-only]", style="bold yellow")
        self.update(text, layout=False)  # one fixed line: a relayout of the whole screen per tick buys nothing

    _shown: str | None = None


class LogPane(Log):
    """The tail of one node's log; appends only the new lines when the same node stays selected."""

    DEFAULT_CSS = """
    LogPane { height: 1fr; border: round $secondary; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_lines=LOG_TAIL * 2, **kwargs)
        self.node_name: str | None = None
        self._tail: list[str] = []

    def show(self, node: Any | None) -> None:
        if node is None:
            if self.node_name is not None:
                self.node_name, self._tail = None, []
                self.clear()
                self.border_title = "log"
            return
        tail = list(node.log)[-LOG_TAIL:]
        if node.name == self.node_name and tail == self._tail:
            return
        new = _new_lines(self._tail, tail) if node.name == self.node_name else None
        follow = None  # appending: follow only if the reader is at the end (tail -f; scrolling up pauses it)
        if new is None:
            self.clear()
            new, follow = tail, True
        self.write_lines(new, scroll_end=follow)
        self.node_name, self._tail = node.name, tail
        # a border title is markup: a node name is data
        self.border_title = Content(f"log {node.name}" + (f"  ({node.malformed} malformed)" if node.malformed else ""))


def _new_lines(old: list[str], new: list[str]) -> list[str] | None:
    """The lines of `new` after the end of `old`, or None when they do not overlap (then redraw)."""
    if not old:
        return new
    for shift in range(len(old)):  # old[shift:] must be a prefix of new
        overlap = len(old) - shift
        if overlap <= len(new) and old[shift:] == new[:overlap]:
            return new[overlap:]
    return None


class Timeline(Static):
    """Membership changes, newest last: who joined, drained, died, and the member count after it."""

    DEFAULT_CSS = """
    Timeline { height: 1fr; border: round $secondary; overflow: hidden; }
    """
    SHOWN = 40

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entries: list[str] = []
        self.border_title = "membership"

    def show(self, timeline: Iterable[Any]) -> None:
        fits = self.content_region.height or self.SHOWN  # newest last, and always in view
        shown = list(timeline)[-max(1, min(fits, self.SHOWN)):]
        entries = [timeline_line(e) for e in shown]
        if entries == self.entries:
            return
        self.entries = entries
        text = Text(no_wrap=True, overflow="ellipsis")  # one line per change, so the newest stays in view
        for i, (entry, line) in enumerate(zip(shown, entries)):
            text.append(("\n" if i else "") + line, style=_BAD.get(str(entry.change), ""))
        self.update(text, layout=False)  # its size comes from the layout (1fr), never from its text


_BAD = {"dead": "bold red", "failed": "bold red", "unreachable": "magenta", "rejected": "yellow"}


def timeline_line(entry: Any) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(entry.ts))
    gen = "" if entry.generation is None else f" gen {entry.generation}"
    members = f" -> {len(entry.members)} members" if entry.members else ""
    reason = f" ({entry.reason})" if entry.reason else ""
    return f"{when} {entry.subject} {entry.change}{gen}{members}{reason}"
