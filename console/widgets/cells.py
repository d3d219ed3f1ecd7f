"""Pure formatting of fleet values into table cells and status text (no Textual, no I/O).

Kept apart from the widgets so the headless status line and the table render the same numbers, and so
each format is unit-tested without an app.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from rich.text import Text

# htop/k9s habit: green is healthy, yellow is in transition, red is lost, dim is gone.
STATE_STYLES: dict[str, str] = {
    "standby": "dim",
    "starting": "cyan",
    "joining": "bold cyan",
    "training": "bold green",
    "draining": "yellow",
    "left": "dim",
    "completed": "green",
    "dead": "bold red",
    "unreachable": "bold magenta",
    "failed": "bold white on red",
}

SPARK_CHARS = "▁▂▃▄▅▆▇█"
HUGE = 1e9  # past this a number is shown in exponent form: it fits its column and is garbage anyway


def state_name(state: object) -> str:
    """The lower-case name of a NodeState (a str Enum) or of a plain string."""
    value = getattr(state, "value", state)
    return str(value).lower() if value is not None else "?"


def state_cell(state: object, reason: str | None = None) -> Text:
    name = state_name(state)
    text = Text(name, style=STATE_STYLES.get(name, ""))
    if reason and name in ("dead", "unreachable", "failed", "left"):
        # the reason is the first thing an operator asks; keep it short enough for the column
        text.append(f" ({_clip(reason, 24)})", style="dim")
    return text


def _clip(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def human_bytes(n: float | None) -> str:
    if n is None or not _finite(n):
        return "-"
    n = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"  # unreachable: the loop returns at T


def device_cells(device: str | None, util: float | None, mem_used: float | None,
                 mem_total: float | None) -> tuple[Text, Text]:
    """(utilization, memory) cells. Without a GPU the engine reports CPU% and RSS: label them so."""
    if device is None or util is None:
        return Text("-", style="dim"), Text("-", style="dim")
    label = "GPU" if device == "gpu" else "CPU"
    util_text = Text(f"{label} {float(util):5.1f}%", style=_util_style(util))
    if device == "gpu":
        mem = f"{human_bytes(mem_used)}/{human_bytes(mem_total)}"
    else:
        mem = f"RSS {human_bytes(mem_used)}"
    return util_text, Text(mem)


def _util_style(util: float) -> str:
    if not _finite(util):
        return "dim"
    return "green" if util >= 60 else ("yellow" if util >= 20 else "dim")


def age_cell(age: float | None, timeout: float, live: bool = True) -> Text:
    """Heartbeat age coloured against the mesh's heartbeat timeout (what makes a peer dead).

    A node that ended on purpose (left, standby) is expected to be silent: its age is shown dim, not alarming.
    """
    if age is None or not _finite(age):
        return Text("-", style="dim")
    if not live:
        return Text(f"{age:.0f}s", style="dim")
    if age < timeout / 3:
        # healthy: whole seconds; tenths would change every cell on every redraw for no information
        return Text(f"{age:.0f}s", style="green")
    return Text(f"{age:.1f}s", style="yellow" if age < timeout else "bold red")


def num_cell(value: float | None, fmt: str = "{:,.0f}") -> str:
    if value is None or not _finite(value):
        return "-"
    if abs(float(value)) >= HUGE:  # a garbage 1e308 would be 300 digits wide
        return f"{float(value):.3g}"
    return fmt.format(value)


def loss_cell(value: float | None) -> str:
    return num_cell(value, "{:.4f}")


def sparkline(values: Iterable[float], width: int = 12) -> str:
    """A one-line sparkline of the last `width` finite values (htop's meter habit, fits a table cell)."""
    vals = [float(v) for v in values if v is not None and _finite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    if span <= 0:
        return SPARK_CHARS[3] * len(vals)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - lo) / span * top)] for v in vals)


def eta_text(eta_s: float | None) -> str:
    if eta_s is None or not _finite(eta_s) or eta_s < 0:
        return "-"
    eta_s = int(eta_s)
    h, rem = divmod(eta_s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _finite(x: object) -> bool:
    try:
        return math.isfinite(float(x))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def summary_text(summary: Any) -> str:
    """run, members, outer step, step/max, cluster tokens/s, loss and ETA: the header and the headless line."""
    members = summary.members if isinstance(summary.members, int) else len(summary.members)
    step = "-" if summary.step is None else str(summary.step)
    if summary.max_steps:
        step += f"/{summary.max_steps}"
    outer = "-" if summary.outer_step is None else str(summary.outer_step)
    return (f"run {summary.run} | members {members} | outer {outer} | step {step} | "
            f"{num_cell(summary.tokens_per_s)} tok/s | loss {loss_cell(summary.loss)} | "
            f"ETA {eta_text(summary.eta_s)}")
