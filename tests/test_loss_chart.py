"""The dashboard's loss chart (console/widgets/loss_chart.py) drawn by Textual at a real size."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from textual.app import App, ComposeResult

from console.widgets.loss_chart import LossChart

BRAILLE = range(0x2801, 0x2900)  # plotext's points (U+2800, the blank one, left out)


class _ChartApp(App):
    def compose(self) -> ComposeResult:
        yield LossChart()


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
