"""`?`: the keys, k9s-style, and where the rest lives (the command palette)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

KEYS = """\
# ZeroBand Console

| key | does |
|---|---|
| `↑` `↓` | select a node |
| `space` | mark / unmark the node (actions apply to every marked node) |
| `a` | add a node: a standby host from the profile, or a new address |
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
            yield Markdown(KEYS + (READONLY_NOTE if self.readonly else ""))

    def action_close(self) -> None:
        self.dismiss(None)
