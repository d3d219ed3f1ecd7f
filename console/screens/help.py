"""`?`: the keys, k9s-style, and where the rest lives (the command palette)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from console.nodes import HostState, NodeState, Shown

KEYS = """\
# ZeroBand Console

| key | does |
|---|---|
| `↑` `↓` | select a node |
| `space` | mark / unmark the node (actions apply to every marked node) |
| `a` | add a node: a spare host (`standby = true` in the profile), or a new address |
| `d` | drain: the node finishes its outer round, hands off and leaves |
| `k` | kill: the process group ends now; the mesh declares it dead |
| `r` | restart a dead, failed or left node |
| `enter` | the selected node in full: every GPU, each rank, command line, checkpoints, last events |
| `l` | the selected node's full log |
| `/` | filter nodes by name, host or state (`escape` clears) |
| `t` | sparkline of tokens/s or loss |
| `c` | where one chart fits (under 17 rows below the table, as at 80x24): the loss or the outer steps |
| `ctrl+p` | command palette: every action by name |
| `?` | this help |
| `q` | quit: leave training running, or stop it (once the run has ended, at once) |

The table fits the terminal's width: node, state, util, heartbeat (`hb`), loss and tokens/s always show; where
the rest do not fit, host hides first, then the trend, memory and step (`enter` shows a node's host, memory and
step). Numbers too long for their column are shortened, never cut: `1.235M` tokens/s, a loss of `123.457`.

Heartbeat ages turn yellow at a third of the mesh's heartbeat timeout and red past it.
Without a GPU the util column shows the host's CPU% (the whole machine's: nodes sharing a machine show the same
figure) and the memory column the engine process's RSS. A node of several GPUs shows
their mean utilization with the lowest after `↓`, and the memory of the fullest GPU.
The header's second line is the store: its address, a round trip, its keys; red when it is down.
The lower chart is each outer step: compute against all-reduce (wire, codec) and idle time.
"""

# the state column's words: the node states a node's events say, and dead (engine/states.py), then the console's
# own words for a host that is no node of the mesh right now (console/nodes.py HostState); tests/test_states.py
# holds this table to both sets. The mesh's standby goes out as a warning, not a state event: not shown.
STATE_MEANINGS: dict[Shown, str] = {
    NodeState.STARTING: "its process is up, not in the mesh yet",
    NodeState.JOINING: "asked to join the running mesh; waits for admission and the state",
    NodeState.TRAINING: "a member: trains its rounds, contributes to each outer step",
    NodeState.DRAINING: "a member that leaves after its next outer step",
    NodeState.LEFT: "exited on purpose (completed, drained, stopped: the reason says)",
    NodeState.DEAD: "its process is gone, or the mesh declared it dead",
    HostState.SPARE: "a spare host of the profile: nothing runs, `a` adds it",
    HostState.OFF: "a host of the run with nothing running",
    HostState.UNREACHABLE: "the console cannot reach the host (the engine may still run)",
    HostState.FAILED: "it could not start, or ended with an error",
}
STATES = ("\n## States\n\n| state | means |\n|---|---|\n"
          + "".join(f"| `{state.value}` | {meaning} |\n" for state, meaning in STATE_MEANINGS.items())
          + f"\nThe last {len(HostState)} are the console's words for a host, not states of the mesh. A node that "
            "steps out of an outer step on a slow link (the mesh's `standby`) shows `joining`: it asks to join "
            "again.\n")

READONLY_NOTE = "\n**Read-only**: add, drain, kill, restart and stop are hidden.\n"


class HelpScreen(ModalScreen[None]):
    CSS_PATH = "modals.tcss"
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; background: $background 60%; }
    HelpScreen > VerticalScroll { width: 84; max-width: 100%; height: auto; max-height: 90%; border: thick $accent;
                                  background: $surface; padding: 0 1; }
    """

    def __init__(self, readonly: bool = False) -> None:
        super().__init__()
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(KEYS + STATES + (READONLY_NOTE if self.readonly else ""))

    def action_close(self) -> None:
        self.dismiss(None)
