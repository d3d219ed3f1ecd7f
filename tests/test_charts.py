"""The dashboard's charts (console/widgets/loss_chart.py, outer_chart.py) drawn by Textual at a real size."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from textual.app import App, ComposeResult

from console.nodes import OuterRound
from console.widgets.loss_chart import LossChart
from console.widgets.outer_chart import OuterChart

BRAILLE = range(0x2801, 0x2900)  # plotext's points (U+2800, the blank one, left out)


class _ChartApp(App):
    CSS = "OuterChart { border: round $secondary; }"  # as the dashboard draws it (console/screens/dashboard.tcss)

    def __init__(self, chart=LossChart) -> None:
        super().__init__()
        self.chart = chart

    def compose(self) -> ComposeResult:
        yield self.chart()


async def test_the_legend_sits_above_the_curves_it_names():
    """Defect: plotext writes the legend over the canvas's top left rows, where a falling loss starts: the first
    points were drawn under the node names and into the rows beside them (seen in the README's dashboard)."""
    nodes = [SimpleNamespace(name=f"node-{c}", loss_history=deque(
        (100.0 + t, 5.0 - 3.0 * t / 59 + 0.05 * i) for t in range(60))) for i, c in enumerate("abc")]
    app = _ChartApp()
    async with app.run_test(size=(90, 40)) as pilot:
        chart = app.query_one(LossChart)
        for height in (40, 14):  # and again, the same points, once the terminal shrank (the headroom is in rows)
            await pilot.resize_terminal(90, height)
            await pilot.pause()
            chart.show(nodes)
            await pilot.pause()
            lines = [strip.text for strip in chart.render_lines(chart.region.reset_offset)]
            assert len(lines) == height, lines
            legend = [i for i, line in enumerate(lines) if "node-" in line]
            assert len(legend) == 3, lines
            for i in legend:  # past the legend's own marker and name, a legend row holds no point of a curve
                rest = lines[i].split(f"node-{'abc'[legend.index(i)]}", 1)[1]
                assert not any(ord(ch) in BRAILLE for ch in rest), "\n".join(lines)
            below = "".join(lines[legend[-1] + 1:])
            assert sum(ord(ch) in BRAILLE for ch in below) > 60  # the curves are drawn, below the legend


async def test_the_outer_charts_legend_is_on_its_border_not_over_the_first_bars():
    """Defect: plotext wrote the legend (idle, codec, wire, compute) over the canvas's top left rows, where the first
    outer steps' bars end: their idle and codec tops were hidden under the part names."""
    rounds = [OuterRound(k, ts=100.0 + 2 * k, members=2, bytes_sent=1 << 20, allreduce_s=0.4, compute_s=1.7,
                         wire_s=0.3, codec_s=0.1, idle_s=0.4 - 0.01 * k) for k in range(1, 21)]
    app = _ChartApp(OuterChart)
    async with app.run_test(size=(90, 20)) as pilot:
        chart = app.query_one(OuterChart)
        chart.show(SimpleNamespace(outer_rounds={r.outer_step: r for r in rounds}))
        await pilot.pause()
        strips = chart.render_lines(chart.region.reset_offset)
        lines = [strip.text for strip in strips]
        canvas = lines[1:-1]
        assert all(part in lines[-1] for part in ("compute", "wire", "codec", "idle")), lines[-1]

        def colours(strips) -> set:
            return {seg.style.color.triplet for strip in strips for seg in strip if "█" in seg.text}
        assert colours(strips[1:-1]) == colours(strips[-1:]) and len(colours(strips[-1:])) == 4  # the legend's
        assert not any(part in line for line in canvas for part in ("compute", "wire", "codec", "idle")), lines
        top = next(i for i, line in enumerate(canvas) if "█" in line)  # the first (tallest) bars reach the top row
        assert canvas[top].split("┤", 1)[1][:6].count("█") >= 4, "\n".join(lines)
