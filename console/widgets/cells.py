"""Pure formatting of fleet values into table cells and status text (no Textual, no I/O).

Kept apart from the widgets so the headless status line and the table render the same numbers, and so
each format is unit-tested without an app.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from rich.text import Text

from console.nodes import HostState, NodeState

# htop/k9s habit: green is healthy, yellow is in transition, red is lost, dim is gone. Keyed by the words of the
# one vocabulary (engine/states.py) and the console's own (console/nodes.py HostState), never typed by hand.
STATE_STYLES: dict[str, str] = {
    HostState.SPARE.value: "dim",
    HostState.OFF.value: "dim",
    NodeState.STARTING.value: "cyan",
    NodeState.JOINING.value: "bold cyan",
    NodeState.TRAINING.value: "bold green",
    NodeState.DRAINING.value: "yellow",
    NodeState.STANDBY.value: "yellow",  # stepped out on a slow link: it asks to join again once the link is healthy
    NodeState.LEFT.value: "dim",
    NodeState.DEAD.value: "bold red",
    HostState.UNREACHABLE.value: "bold magenta",
    HostState.FAILED.value: "bold white on red",
}

REASON_STATES = frozenset(s.value for s in (NodeState.DEAD, HostState.UNREACHABLE, HostState.FAILED, NodeState.LEFT))
# silent on purpose (or never started): their heartbeat age is no alarm and their figures are not current
QUIET_STATES = frozenset(s.value for s in (NodeState.LEFT, HostState.SPARE, HostState.OFF, HostState.FAILED))

SPARK_CHARS = "▁▂▃▄▅▆▇█"
HUGE = 1e9  # past this a number is shown in exponent form: it fits its column and is garbage anyway


def state_name(state: object) -> str:
    """The lower-case name of a NodeState or HostState (str Enums) or of a plain string."""
    value = getattr(state, "value", state)
    return str(value).lower() if value is not None else "?"


def state_cell(state: object) -> Text:
    """The state alone: its reason is longer than any column (it goes where it fits: `reason_text`)."""
    name = state_name(state)
    return Text(name, style=STATE_STYLES.get(name, ""))


def reason_text(state: object, reason: str | None) -> str:
    """Why a node is where it is, for the states that need a why (the detail view, the log title, `status`)."""
    if reason and state_name(state) in REASON_STATES:
        return " ".join(str(reason).split())
    return ""


def why_text(node: Any) -> str:
    """The state's reason (reason_text), or while the first step compiles, that it does: a first step that takes a
    minute reads as a hung node unless something says why (`status`, the log pane's title; the detail view has it
    in full)."""
    why = reason_text(node.state, node.reason)
    compiling = getattr(node, "compile", None)
    if not why and compiling and compiling.startswith("compiling"):
        return compiling
    return why


def shows_figures(state: object) -> bool:
    """Whether a node's last resource sample is current: a node that no longer runs uses nothing, and its last
    sample would read as a live 100% CPU."""
    name = state_name(state)
    return name not in QUIET_STATES and name != NodeState.DEAD.value


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


def gpu_cells(devices: Any) -> tuple[Text, Text] | None:
    """A node of several GPUs in one row: mean and minimum utilization (an idle straggler shows in the minimum),
    and the memory of the fullest (the one that runs out first). None when it has fewer than two GPUs."""
    gpus = [d for d in devices.values() if d.kind == "gpu" and _finite(d.util)]
    if len(gpus) < 2:
        return None
    utils = [float(d.util) for d in gpus]
    mean, low = sum(utils) / len(utils), min(utils)
    fullest = max(gpus, key=lambda d: d.mem_used / d.mem_total if d.mem_total else 0.0)
    util = Text(f"{len(gpus)}GPU {mean:.0f}%", style=_util_style(mean))
    util.append(f" ↓{low:.0f}", style=_util_style(low))
    return util, Text(f"max {human_bytes(fullest.mem_used)}/{human_bytes(fullest.mem_total)}")


def store_text(store: Any) -> Text:
    """The store's health for the header: up, where, a round trip and its keys; a dead store is an alert that says
    what is happening and what to do."""
    if store.address is None and store.state == "off":
        return Text("")  # no TCP store in this run (the etcd backend: the summary shows its members)
    where = store.address or "?"
    if store.bind:
        where += f" (listening on {store.bind})"
    if store.state == "up":
        rtt = "-" if store.rtt_ms is None else f"{store.rtt_ms:.1f}ms"
        keys = "-" if store.keys is None else f"{store.keys}"
        text = Text("store ", style="bold")
        text.append(f"{where} up", style="green")
        text.append(f" | rtt {rtt} | {keys} keys" + (f" | restarted {store.restarts}x" if store.restarts else ""))
        if store.reason:
            text.append(f" | {store.reason}", style="yellow")
        return text
    if store.state in ("down", "restarting", "unreachable"):
        todo = {"down": "engines keep their state and wait for it",
                "restarting": "the console restarted it; engines re-form the run",
                "unreachable": "the console cannot reach its host"}[store.state]
        return Text(f"STORE {store.state.upper()} {where}: {store.reason or ''} -- {todo}",
                    style="bold white on red")
    return Text(f"store {where} {store.state}", style="dim")


def outer_line(rnd: Any) -> str:
    """One outer step for the headless output and the chart's caption: compute against communication and idle."""
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}s"

    compute = s(rnd.compute_s) + ("~" if rnd.derived and rnd.compute_s is not None else "")
    if rnd.wire_s is not None or rnd.codec_s is not None:
        comm = f"wire {s(rnd.wire_s)} codec {s(rnd.codec_s)}"
    else:
        comm = f"allreduce {s(rnd.allreduce_s)}"
    ratio = ""
    if rnd.compute_s:
        spent = (rnd.wire_s or 0.0) + (rnd.codec_s or 0.0) if rnd.wire_s is not None else rnd.allreduce_s
        ratio = f" ({100 * spent / (rnd.compute_s + spent):.0f}% comm)"
    shares = getattr(rnd, "shares", None)
    split = f" | shares {share_text(shares)}" if shares and len(shares) > 1 else ""
    return (f"outer {rnd.outer_step}: compute {compute} {comm} idle {s(rnd.idle_s)}{ratio} | "
            f"{rnd.members} members | {bytes_text(rnd)}{split}")


def bytes_text(rnd: Any, short: bool = False) -> str:
    """An outer step's bytes on the wire (every reporter's), and their part of what the same exchanges would have
    sent uncompressed when every reporter said: "1.2M sent (1/98 of fp32)", or `short`, where a narrow chart's
    legend has no room for more, "1.2M = 1/98 fp32". An older engine's step: the bytes."""
    sent = human_bytes(rnd.bytes_sent)
    fp32, told = getattr(rnd, "fp32_bytes", 0), getattr(rnd, "fp32_reporters", 0)
    if not fp32 or not rnd.bytes_sent or told < rnd.reporters:
        return sent if short else f"{sent} sent"
    factor = fp32 / rnd.bytes_sent
    return f"{sent} = 1/{factor:.0f} fp32" if short else f"{sent} sent (1/{factor:.3g} of fp32)"


def share_text(shares: dict[str, float]) -> str:
    """Each contributor's share of an outer step's mean (its round's tokens), biggest first: "a 67% b 33%"."""
    return " ".join(f"{n} {100 * v:.0f}%" for n, v in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0])))


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
        return Text(_whole_seconds(age), style="dim")
    if age < timeout / 3:
        # healthy: whole seconds; tenths would change every cell on every redraw for no information
        return Text(_whole_seconds(age), style="green")
    # tenths while they tell something (a late beat); a node silent for minutes reads in whole seconds, so the
    # text stays within the table's six-character heartbeat column
    text = f"{age:.1f}s" if age < 100 else _whole_seconds(age)
    return Text(text, style="yellow" if age < timeout else "bold red")


def _whole_seconds(age: float) -> str:
    """At most six characters: seconds up to 99999 (27 hours), then hours."""
    return f"{age:.0f}s" if age < 99_999.5 else f"{age / 3600:.0f}h"


def num_cell(value: float | None, fmt: str = "{:,.0f}") -> str:
    if value is None or not _finite(value):
        return "-"
    if abs(float(value)) >= HUGE:  # a garbage 1e308 would be 300 digits wide
        return f"{float(value):.3g}"
    return fmt.format(value)


def loss_cell(value: float | None) -> str:
    return num_cell(value, "{:.4f}")


SI_SUFFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def fit_num(value: float | None, fmt: str = "{:,.0f}", width: int = 7) -> str:
    """num_cell's text where it fits `width` characters; else fewer decimals (a loss of 123.4567 reads 123.457),
    then as many significant digits as fit with a suffix (1234567 reads 1.235M): a table column never cuts a
    number, which would show another number."""
    text = num_cell(value, fmt)
    if len(text) <= width:
        return text
    assert value is not None  # num_cell gave a number: value is a finite number
    v = float(value)
    if "." in fmt:
        for decimals in range(int(fmt.split(".")[1][0]) - 1, -1, -1):
            text = f"{v:.{decimals}f}"
            if len(text) <= width:
                return text
    for scale, suffix in SI_SUFFIXES:
        if abs(v) >= scale:
            for digits in range(4, 0, -1):
                text = f"{v / scale:.{digits}g}{suffix}"
                if len(text) <= width and "e" not in text:
                    return text
            break
    return f"{v:.0e}"  # past the largest suffix (garbage): the shortest form that still says how big


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


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def summary_text(summary: Any) -> str:
    """run, members, outer step, step/max, cluster tokens/s, loss and ETA (once the run ended, how): the header and
    the headless line."""
    members = summary.members if isinstance(summary.members, int) else len(summary.members)
    step = "-" if summary.step is None else str(summary.step)
    if summary.max_steps:
        step += f"/{summary.max_steps}"
    outer = "-" if summary.outer_step is None else str(summary.outer_step)
    rounds = getattr(summary, "rounds", None)
    if rounds:  # time rounds: the run is its outer steps; each node counts its own steps
        outer += f"/{rounds}"
    store = f" | {summary.store}" if getattr(summary, "store", None) else ""
    ended = getattr(summary, "ended", None)  # a completed run looked like a stopped one: "loss -", a stale ETA
    if ended:  # first and short: the header is cut at its right edge (80 columns)
        return f"run {summary.run} {ended} | outer {outer} | step {step} | loss {loss_cell(summary.loss)}{store}"
    # loss before tokens/s: at 80 columns the header is cut at its right edge, and the loss is the run's own figure
    # (each node's tokens/s shows in the table)
    return (f"run {summary.run} | members {members} | outer {outer} | step {step} | "
            f"loss {loss_cell(summary.loss)} | {num_cell(summary.tokens_per_s)} tok/s | "
            f"ETA {eta_text(summary.eta_s)}{store}")
