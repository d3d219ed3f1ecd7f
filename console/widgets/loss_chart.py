"""Loss over time, one line per node (textual-plotext)."""

from __future__ import annotations

import math
from itertools import islice
from typing import Any, Iterable

from rich.text import Text
from textual.app import RenderResult
from textual_plotext import PlotextPlot

MAX_POINTS = 240  # per line at most; fewer when the plot is narrower (2 braille dots per column)
MAX_LINES = 16  # past this many nodes one line each is noise, and plotext's cost grows per line
MEAN = "mean"
PLOTTABLE = 1e12  # plotext scales its axis labels by 10**8: values near float max overflow it


def plottable(v: float) -> bool:
    return math.isfinite(v) and abs(v) < PLOTTABLE


def _newest(history: Any, n: int) -> list:
    return list(islice(reversed(history), n))[::-1]


def downsample(points: list[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """Every k-th point, always keeping the newest (the value an operator is looking at)."""
    if len(points) <= limit:
        return points
    step = -(-len(points) // limit)
    kept = points[::step]
    if kept[-1] is not points[-1]:
        kept.append(points[-1])
    return kept


def mean_series(histories: list[list[tuple[float, float]]], bins: int) -> list[tuple[float, float]]:
    """The cluster's mean loss over time: every node's points averaged in `bins` equal time buckets."""
    points = [p for h in histories for p in h]
    if not points:
        return []
    t_lo = min(t for t, _ in points)
    width = (max(t for t, _ in points) - t_lo) / bins or 1.0
    sums: dict[int, list[float]] = {}
    for t, v in points:
        acc = sums.setdefault(min(int((t - t_lo) / width), bins - 1), [0.0, 0.0, 0.0])
        acc[0] += t
        acc[1] += v
        acc[2] += 1
    return [(s[0] / s[2], s[1] / s[2]) for _, s in sorted(sums.items())]


class LossChart(PlotextPlot):
    """Redrawn by `show(nodes)` only; it holds the plotted series so tests can read the numbers."""

    DEFAULT_CSS = """
    LossChart { height: 1fr; min-height: 8; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.series: dict[str, tuple[list[float], list[float]]] = {}
        self._t0: float | None = None
        self._height = 0  # the height the series were last drawn at (the legend's headroom depends on it)

    def show(self, nodes: Iterable[Any], focus: Iterable[str] = ()) -> None:
        """One line per node; past MAX_LINES nodes, the cluster mean plus the `focus` (selected, marked) nodes."""
        nodes = [n for n in nodes if n.loss_history]
        limit = max(16, min(MAX_POINTS, 2 * (self.size.width or MAX_POINTS)))
        # the newest `limit` points per node are all a plot this wide can show
        histories = {str(n.name): [(float(t), float(v)) for t, v in _newest(n.loss_history, limit) if plottable(v)]
                     for n in nodes}
        histories = {name: h for name, h in histories.items() if h}
        if self._t0 is None and histories:
            self._t0 = min(h[0][0] for h in histories.values())
        title = "loss"
        if len(histories) > MAX_LINES:
            wanted = [name for name in focus if name in histories][: MAX_LINES - 1]
            mean = mean_series(list(histories.values()), limit)
            title = f"loss: mean of {len(histories)} nodes" + (", and " + ", ".join(wanted) if wanted else "")
            histories = {MEAN: mean, **{name: histories[name] for name in wanted}}
        series = {}
        for name, points in histories.items():
            points = downsample(points, limit)
            series[name] = ([t - (self._t0 or 0.0) for t, _ in points], [v for _, v in points])
        if series == self.series and self.size.height == self._height:
            return
        self.series, self._height = series, self.size.height
        plt = self.plt
        plt.clear_data()
        plt.title(title)
        plt.xlabel("seconds")
        labelled = len(series) <= 8  # a legend longer than that hides the plot; the table names the nodes
        for name, (xs, ys) in series.items():
            plt.plot(xs, ys, label=name if labelled else None, marker="braille")
        xs = [x for xs, _ in series.values() for x in xs]
        if xs:  # seconds since the first point, never before it (one point alone was drawn on an axis of -1 to 1)
            plt.xlim(min(xs), max(max(xs), min(xs) + 1.0))
        self._headroom(plt, [y for _, ys in series.values() for y in ys], len(series) if labelled else 0)
        self.refresh()

    def _headroom(self, plt: Any, ys: list[float], entries: int) -> None:
        """Room above the highest point for the legend, which plotext writes over the canvas's top left rows: there
        a falling loss starts, and its first points were drawn under the node names."""
        rows = (self.size.height or 0) - 6  # the canvas: less the border, the title and the x axis with its label
        if not ys or not entries or rows <= entries + 2:  # no legend, or too short to spare the rows for one
            plt.ylim(None, None)
            return
        lo, hi = min(ys), max(ys)
        span = (hi - lo) or abs(hi) or 1.0
        plt.ylim(lo, hi + span * (entries + 1) / (rows - entries - 1))

    def render(self) -> RenderResult:
        try:
            return super().render()
        except (ArithmeticError, ValueError, IndexError) as e:  # plotext on data it cannot scale: say so, go on
            return Text(f"loss chart unavailable: {type(e).__name__}: {e}", style="dim")

    def last_value(self, name: str) -> float | None:
        xs_ys = self.series.get(name)
        return xs_ys[1][-1] if xs_ys and xs_ys[1] else None
