"""The run header, the selected node's log pane and the membership timeline: render only, fed by the app."""

from __future__ import annotations

import time
from collections import deque
from itertools import islice
from typing import Any, Iterable

from rich.text import Text
from textual.content import Content
from textual.widgets import Log, Static

from console.nodes import HostState, NodeState
from console.widgets import cells
from console.widgets.cells import summary_text
from engine.telemetry import members_after

LOG_TAIL = 300  # lines of the selected node shown in the pane (the fleet keeps 500)


class RunHeader(Static):
    """Two fixed lines: the run (members, outer step, step, tokens/s, loss, ETA, dataset) and the store's health."""

    DEFAULT_CSS = """
    RunHeader { height: 2; background: $primary-background; color: $text; padding: 0 1;
                text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def show(self, summary: Any, readonly: bool = False, store: Any = None, dataset: str | None = None) -> None:
        line = summary_text(summary) + (f" | data {dataset}" if dataset else "")
        store_line = cells.store_text(store) if store is not None else Text("")
        key = (line, store_line.plain, str(store_line.style), readonly)
        if key == self._shown:
            return
        self._shown = key
        text = Text("ZeroBand ", style="bold")
        text.append(line, style="bold")
        if readonly:
            text.append("  [read-only]", style="bold yellow")
        text.append("\n")
        text.append_text(store_line)
        self.update(text, layout=False)  # fixed lines: a relayout of the whole screen per tick buys nothing

    _shown: tuple | None = None


class LogPane(Log):
    """The tail of one node's log; appends only the new lines when the same node stays selected."""

    DEFAULT_CSS = """
    LogPane { height: 1fr; border: round $secondary; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_lines=LOG_TAIL * 2, **kwargs)
        self.node_name: str | None = None
        self._last: object = None  # the newest log entry shown, as stored (compared by identity)
        self._title = ""

    def show(self, node: Any | None) -> None:
        if node is None:
            if self.node_name is not None:
                self.node_name, self._last, self._title = None, None, "log"
                self.clear()
                self.border_title = "log"
            return
        raw = _raw_tail(node.log, LOG_TAIL)
        same = node.name == self.node_name
        if same and raw and raw[-1] is self._last:
            return
        new = _after(raw, self._last) if same else None
        follow = None  # appending: follow only if the reader is at the end (tail -f; scrolling up pauses it)
        if new is None:
            self.clear()
            new, follow = raw, True
        self.write_lines([str(entry) for entry in new], scroll_end=follow)
        if follow:  # a new node: start at its newest line once the new length is laid out
            self.call_after_refresh(self.scroll_end, animate=False, x_axis=False)
        self.node_name, self._last = node.name, (raw[-1] if raw else None)
        title = f"log {node.name}" + (f"  ({node.malformed} malformed)" if node.malformed else "")
        why = cells.why_text(node)
        if why:  # the state column holds the state alone; its reason is read here (and in the detail view)
            title += f"  {cells.state_name(node.state)}: {why}"
        if title != self._title:  # setting a title repaints the whole pane: only when it changes
            self._title = title
            self.border_title = Content(title)  # a border title is markup: a node name is data


def _raw_tail(log: Any, n: int) -> list:
    """The newest n log entries as stored: the fleet formats an engine event only when it is read, and reading
    the whole 500-line buffer every tick to show its tail was the log pane's main cost."""
    if isinstance(log, deque):
        return list(islice(deque.__reversed__(log), n))[::-1]
    return list(log)[-n:]


def _after(raw: list, last: object) -> list | None:
    """The entries after `last` (found by identity), or None when it is gone from the tail (then redraw)."""
    if last is None:
        return raw
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] is last:
            return raw[i + 1:]
    return None


class Timeline(Static):
    """Membership changes, newest last: who joined, drained, died, and the member count after it."""

    DEFAULT_CSS = """
    Timeline { height: 1fr; border: round $secondary; overflow: hidden; text-wrap: nowrap; text-overflow: ellipsis; }
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


# a timeline entry's change: a membership change, a console fact about a node (its state), the store's state
_BAD = {NodeState.DEAD.value: "bold red", HostState.FAILED.value: "bold red", HostState.UNREACHABLE.value: "magenta",
        "down": "bold red", "rejected": "yellow"}


def timeline_line(entry: Any) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(entry.ts))
    gen = "" if entry.generation is None else f" gen {entry.generation}"
    members = f" -> {members_after(entry.change, entry.subject, entry.members)} members" if entry.members else ""
    reason = f" ({entry.reason})" if entry.reason else ""
    return f"{when} {entry.subject} {entry.change}{gen}{members}{reason}"
