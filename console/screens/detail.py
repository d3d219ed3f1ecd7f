"""Enter on a row: one node in full. Its GPUs (or each rank's CPU share) with utilization, memory, temperature
and power; each rank's step and throughput; the engine's command line, pid, config digest and overrides; its data
position; its checkpoints; its last events. Escape returns to the dashboard. Render only: it reads the fleet."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from console.screens.node_screen import NodeScreen
from console.widgets import cells

EVENTS = 15  # the node's newest log lines shown
GROWING = 4  # outer steps in a row over which a sparse run's residual grew: the density may be too low


def detail_tables(node: Any, now: float | None = None) -> list[Any]:
    """The renderables of the view, top to bottom. Pure: tested without an app."""
    now = time.time() if now is None else now
    out: list[Any] = []
    head = Text(f"{node.name}  ", style="bold")
    head.append_text(cells.state_cell(node.state))
    reason = cells.reason_text(node.state, node.reason)
    if reason:
        head.append(f"  {reason}")
    out.append(head)

    info = Table.grid(padding=(0, 2))
    run = node.run_info
    rows = [("host", node.host), ("pid", node.pid), ("command", node.command),
            ("config digest", run.get("config_digest")), ("strategy", run.get("strategy")),
            ("workers", run.get("world_size")), ("dataset", run.get("dataset")),
            ("overrides", " ".join(f"{k}={v}" for k, v in node.overrides.items()) or None),
            ("data position", _position(node)), ("last round", _round(node)),
            ("compile", getattr(node, "compile", None)), ("residual", _residual(node))]
    for label, value in rows:
        info.add_row(Text(label, style="dim"), Text("-" if value is None else str(value)))
    out.append(info)

    devices = Table(title="devices", title_justify="left", expand=False)
    for col in ("device", "util", "memory", "temp", "power", "age"):
        devices.add_column(col, justify="right" if col != "device" else "left")
    live = cells.shows_figures(node.state)
    for dev in sorted(node.devices.values(), key=lambda d: d.key):
        util, mem = cells.device_cells(dev.kind if live else None, dev.util, dev.mem_used, dev.mem_total)
        devices.add_row(dev.key, util, mem, "-" if dev.temp_c is None else f"{dev.temp_c:.0f}C",
                        "-" if dev.power_w is None else f"{dev.power_w:.0f}W", f"{max(0.0, now - dev.ts):.0f}s")
    out.append(devices)

    ranks = Table(title="ranks (rank > 0 reports with telemetry.all_ranks)", title_justify="left", expand=False)
    for col in ("rank", "step", "tok/s", "loss", "age"):
        ranks.add_column(col, justify="right")
    for fig in sorted(node.ranks.values(), key=lambda f: f.rank):
        ranks.add_row(str(fig.rank), str(fig.step), cells.num_cell(fig.tokens_per_s), cells.loss_cell(fig.loss),
                      f"{max(0.0, now - fig.ts):.0f}s")
    out.append(ranks)

    ckpts = Table(title="checkpoints", title_justify="left", expand=False)
    for col in ("step", "path", "seconds"):
        ckpts.add_column(col)
    for step, path, seconds in node.checkpoints:
        ckpts.add_row(str(step), str(path), f"{seconds:.1f}")
    out.append(ckpts)

    events = Text("last events\n", style="bold")
    events.append("\n".join(list(node.log)[-EVENTS:]) or "-", style="")
    out.append(events)
    return out


def _round(node: Any) -> str | None:
    """The tokens its last round counted for in the mean, and their share of the outer step."""
    if getattr(node, "round_tokens", None) is None:
        return None
    if not node.round_tokens:
        return f"outer step {node.outer_step}: not counted (joining, or its round diverged)"
    return f"outer step {node.outer_step}: {node.round_tokens:,.0f} tokens, {100 * node.round_share:.0f}% of the mean"


def _residual(node: Any) -> str | None:
    """diloco.compression = "sparse": the error-feedback accumulator's norm against the weights', and whether it
    grew over every one of the last outer steps (a residual that keeps growing says the density is too low)."""
    ratio = getattr(node, "residual_ratio", None)
    if ratio is None:
        return None
    last = list(getattr(node, "residual_history", ()))[-GROWING:]
    growing = len(last) == GROWING and all(b > a for a, b in zip(last, last[1:]))
    trend = f", grew at each of the last {GROWING} outer steps: raise diloco.density" if growing else ""
    return f"|e|/|w| = {ratio:.3g} (the unsent accumulator against the weights){trend}"


def _position(node: Any) -> str | None:
    parts = []
    if node.tokens is not None:
        parts.append(f"{cells.num_cell(node.tokens)} tokens")
    if node.epoch is not None:
        parts.append(f"epoch {node.epoch:.3f}")
    return ", ".join(parts) or None


class NodeDetailScreen(NodeScreen):
    BINDINGS = [Binding("escape,q,enter", "close", "Back")]
    DEFAULT_CSS = """
    NodeDetailScreen #detail-body { padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="detail-body")
        yield Footer()

    def follow(self) -> None:
        node = self.current_node()
        body = self.query_one("#detail-body", Static)
        if node is None:
            body.update(Text(f"{self.node_name}: no such node", style="bold red"))
            return
        from rich.console import Group

        body.update(Group(*detail_tables(node)))

    def text(self) -> str:
        """What the view shows, as plain text (tests read it)."""
        node = self.current_node()
        if node is None:
            return ""
        import io

        from rich.console import Console

        console = Console(width=200, record=True, file=io.StringIO())
        for part in detail_tables(node):
            console.print(part)
        return console.export_text()
