"""Loss over time, one line per node (textual-plotext)."""

from __future__ import annotations

from typing import Any, Iterable

from textual_plotext import PlotextPlot

MAX_POINTS = 240  # per line: plotext cost grows with points, the terminal shows ~100 columns anyway


def downsample(points: list[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """Every k-th point, always keeping the newest (the value an operator is looking at)."""
    if len(points) <= limit:
        return points
    step = -(-len(points) // limit)
    kept = points[::step]
    if kept[-1] is not points[-1]:
        kept.append(points[-1])
    return kept


class LossChart(PlotextPlot):
    """Redrawn by `show(nodes)` only; it holds the plotted series so tests can read the numbers."""

    DEFAULT_CSS = """
    LossChart { height: 1fr; min-height: 8; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.series: dict[str, tuple[list[float], list[float]]] = {}
        self._t0: float | None = None

    def show(self, nodes: Iterable[Any]) -> None:
        series: dict[str, tuple[list[float], list[float]]] = {}
        for node in nodes:
            points = [(float(t), float(v)) for t, v in list(node.loss_history)]
            if not points:
                continue
            if self._t0 is None:
                self._t0 = points[0][0]
            points = downsample(points)
            series[str(node.name)] = ([t - self._t0 for t, _ in points], [v for _, v in points])
        if series == self.series:
            return
        self.series = series
        plt = self.plt
        plt.clear_data()
        plt.title("loss")
        plt.xlabel("seconds")
        # a legend of 64 names would hide the plot; past a handful the table names the nodes
        labelled = len(series) <= 8
        for name, (xs, ys) in series.items():
            plt.plot(xs, ys, label=name if labelled else None, marker="braille")
        self.refresh()

    def last_value(self, name: str) -> float | None:
        xs_ys = self.series.get(name)
        return xs_ys[1][-1] if xs_ys and xs_ys[1] else None
