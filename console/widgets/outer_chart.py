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


def legend_forms(series: dict[str, list[float]], sent: str, sent_short: str, hint: str) -> list[str]:
    """The bottom border's legend, bytes and hint, widest first. At 80 columns the words of the full form do not fit,
    and the bytes against fp32, the figure an operator tunes the compression by, must not be what the border cuts:
    the last form puts them first and lets the legend's tail go."""

    def legend(sep: str) -> str:
        return " ".join(f"[rgb{COLORS[part]}]█[/]{sep}{part}" for part in series)

    def joined(*parts: str) -> str:
        return "  ".join(part for part in parts if part)

    return [joined(legend(" "), sent, hint), joined(legend(" "), sent_short, hint),
            joined(legend(""), sent_short, hint), joined(sent_short, hint, legend(""))]


def first_fitting(forms: list[str], room: int) -> str:
    """The first form whose text fits `room` cells whole; the last (the border cuts it with an ellipsis) if none."""
    return next((f for f in forms if Text.from_markup(f).cell_len <= room), forms[-1])


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
        self.sent_short = ""  # the same in fewer cells, for a legend that has no room for the words

    def show(self, fleet: Any) -> None:
        rounds = list(fleet.outer_rounds.values())[-BARS:]
        steps = [r.outer_step for r in rounds]
        series = bar_series(rounds)
        caption = cells.outer_line(rounds[-1]) if rounds else "no outer step yet"
        sent = cells.bytes_text(rounds[-1]) if rounds else ""
        if (steps, series, caption, sent) == (self.steps, self.series, self.caption, self.sent):
            return
        self.steps, self.series, self.caption, self.sent = steps, series, caption, sent
        self.sent_short = cells.bytes_text(rounds[-1], short=True) if rounds else ""
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

    def on_resize(self) -> None:
        self._subtitle()

    def _subtitle(self) -> None:
        width = self.size.width  # the corners and a rule and a space each side; not laid out yet: no limit
        forms = legend_forms(self.series, self.sent, self.sent_short, self.hint) if self.steps else [self.hint]
        self.border_subtitle = first_fitting(forms, width - 6 if width else 1 << 16)

    def render(self) -> RenderResult:
        try:
            return super().render()
        except (ArithmeticError, ValueError, IndexError) as e:  # plotext on data it cannot scale: say so, go on
            return Text(f"outer-step chart unavailable: {type(e).__name__}: {e}", style="dim")
