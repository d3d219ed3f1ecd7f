"""The PNG timeline of a chaos run: outer steps per node (top), membership per node (bottom), faults shaded."""

from __future__ import annotations

from pathlib import Path

from lab.schedule import Fault

COLOURS = {"kill": "#d62728", "kill-leader": "#8c0000", "freeze": "#1f77b4", "link": "#ff7f0e",
           "loss": "#bcbd22", "blackhole": "#7f7f7f", "store": "#9467bd", "console": "#17becf", "drain": "#2ca02c"}


def draw(path: Path, events: dict[str, list[dict]], faults: list[Fault], store_down: list[tuple[float, float]],
         t0: float, end: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    nodes = sorted(events)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(14, 7), height_ratios=(3, 2))
    for colour, node in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4, nodes):
        for i, life in enumerate(_lives(events[node])):  # one line per process: a restart is a break
            commits = [(e["ts"] - t0, e["outer_step"]) for e in life if e.get("type") == "outer_step"]
            if commits:
                top.plot(*zip(*commits), ".-", color=colour, markersize=3, linewidth=0.8,
                         label=node if i == 0 else None)
    top.set_ylabel("committed outer step")
    top.legend(loc="upper left", fontsize=8)
    for row, node in enumerate(nodes):
        # a bar per commit of this node: where it was a member; members count as the label of the row
        spans = [(e["ts"] - t0, len(e.get("members", ()))) for e in events[node] if e.get("type") == "outer_step"]
        dots = bottom.scatter([t for t, _ in spans], [row] * len(spans), s=6, c=[n for _, n in spans],
                              cmap="viridis", vmin=0, vmax=max(len(nodes), 1))
        for e in events[node]:
            if e.get("type") == "run_end":
                bottom.annotate(e.get("status", "?"), (e["ts"] - t0, row), fontsize=7, color="#d62728")
    if nodes:
        fig.colorbar(dots, ax=(top, bottom), label="members of the commit (bottom)", pad=0.01)
    bottom.set_yticks(range(len(nodes)), nodes)
    bottom.set_ylabel("commits (colour: members)")
    bottom.set_xlabel("seconds since the lab started")
    for lo, hi in store_down:
        for ax in (top, bottom):
            ax.axvspan(lo - t0, hi - t0, color=COLOURS["store"], alpha=0.25)
    for f in faults:
        if f.start is None:
            continue
        stop = (f.healed or f.start) - t0
        colour = COLOURS.get(f.kind, "black")
        for ax in (top, bottom):
            ax.axvspan(f.start - t0, max(stop, f.start - t0 + 0.3), color=colour, alpha=0.2)
        mark = "" if f.survived else " FAILED"
        top.annotate(f"#{f.index} {f.kind} {f.resolved}{mark}", (f.start - t0, 0.02),
                     xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="bottom",
                     color="red" if not f.survived else colour)
    top.set_xlim(0, max(end - t0, 1.0))
    top.set_title("chaos lab: commits per node; shaded: faults (purple: store down); red label: not survived",
                  fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _lives(events: list[dict]) -> list[list[dict]]:
    """A node's events split at each run_start (its events file is appended to by every restart)."""
    lives: list[list[dict]] = [[]]
    for e in events:
        if e.get("type") == "run_start" and lives[-1]:
            lives.append([])
        lives[-1].append(e)
    return lives
