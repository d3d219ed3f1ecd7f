"""The outer step made visible: per DiLoCo outer step, compute against communication (wire, codec) and idle time,
as stacked bars (textual-plotext), captioned (on its top border) with the newest step's members and bytes; the
legend is on its bottom border, in the bars' colors (plotext writes a legend over the canvas's top left rows,
where it hid the first bars' tops).

It tells an operator whether H (diloco.inner_steps) and the compression are right: communication that is a large
share of each bar wants a larger H or more compression; idle time is nodes waiting for the slowest one.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import RenderResult
from textual_plotext import PlotextPlot

from console.widgets import cells

BARS = 30  # the newest outer steps shown
# a part's colour, the same in its bars and on the legend (textual-plotext maps colour names to its own palette)
COLORS = {"compute": (152, 224, 36), "wire": (244, 0, 95), "allreduce": (244, 0, 95), "codec": (157, 101, 255),
          "idle": (250, 162, 25)}


def bar_series(rounds: list[Any]) -> dict[str, list[float]]:
    """{part: seconds per outer step} for the newest BARS steps; communication split into wire and codec when
    the engine reports them, one "allreduce" part otherwise. Pure: tested without an app."""
    rounds = rounds[-BARS:]
    split = any(r.wire_s is not None or r.codec_s is not None for r in rounds)
    series: dict[str, list[float]] = {"compute": [r.compute_s or 0.0 for r in rounds]}
    if split:
        series["wire"] = [r.wire_s or 0.0 for r in rounds]
        series["codec"] = [r.codec_s or 0.0 for r in rounds]
    else:
        series["allreduce"] = [r.allreduce_s for r in rounds]
    if any(r.idle_s is not None for r in rounds):
        series["idle"] = [r.idle_s or 0.0 for r in rounds]
    return series


class OuterChart(PlotextPlot):
    """Redrawn by `show(fleet)` only; it keeps what it plotted so tests can read the numbers."""

    DEFAULT_CSS = """
    OuterChart { height: 1fr; min-height: 8; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps: list[int] = []
        self.series: dict[str, list[float]] = {}
        self.caption = ""
        self.hint = ""  # a key the dashboard names after the legend (`c: loss` when one chart fits)
        self.sent = ""  # the newest outer step's bytes and their part of fp32's, at the legend's end

    def show(self, fleet: Any) -> None:
        rounds = list(fleet.outer_rounds.values())[-BARS:]
        steps = [r.outer_step for r in rounds]
        series = bar_series(rounds)
        caption = cells.outer_line(rounds[-1]) if rounds else "no outer step yet"
        sent = cells.bytes_text(rounds[-1]) if rounds else ""
        if (steps, series, caption, sent) == (self.steps, self.series, self.caption, self.sent):
            return
        self.steps, self.series, self.caption, self.sent = steps, series, caption, sent
        plt = self.plt
        plt.clear_data()
        # on the border, cut to fit with an ellipsis: as plotext's title, a caption wider than the plot was dropped
        self.border_title = caption
        self._subtitle()
        plt.xlabel("outer step")
        if steps:
            colors: Any = [COLORS[p] for p in series]  # one per series (plotext's annotation says one colour)
            plt.stacked_bar([str(s) for s in steps], list(series.values()), color=colors)
        self.refresh()

    def set_hint(self, hint: str) -> None:
        if hint != self.hint:
            self.hint = hint
            self._subtitle()

    def _subtitle(self) -> None:
        legend = " ".join(f"[rgb{COLORS[part]}]█[/] {part}" for part in self.series) if self.steps else ""
        self.border_subtitle = "  ".join(part for part in (legend, self.sent if self.steps else "", self.hint) if part)

    def render(self) -> RenderResult:
        try:
            return super().render()
        except (ArithmeticError, ValueError, IndexError) as e:  # plotext on data it cannot scale: say so, go on
            return Text(f"outer-step chart unavailable: {type(e).__name__}: {e}", style="dim")
