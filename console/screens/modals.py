"""Modal screens; each returns its answer with dismiss(result) and reaches into nothing else."""

from __future__ import annotations

from typing import Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList
from textual.widgets.option_list import Option


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no for a destructive action (drain, kill). `y`/enter confirms, `n`/escape cancels."""

    CSS_PATH = "modals.tcss"
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, confirm_label: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, id="question", markup=False)  # node names are data, not markup
            with Horizontal(classes="buttons"):
                yield Button(f"{self.confirm_label} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # the safe answer is the default

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class AddNodeScreen(ModalScreen[str | None]):
    """Pick a standby host from the profile, or type a new address (user@host:port or an ssh alias)."""

    CSS_PATH = "modals.tcss"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, standby: Sequence[str]) -> None:
        super().__init__()
        self.standby = list(standby)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Add a node: pick a spare host, or type a new address", id="question")
            if self.standby:
                yield OptionList(*(Option(Text(h), id=h) for h in self.standby), id="standby")
            else:
                yield Label("(no spare hosts in the profile: standby = true)", classes="dim")
            yield Input(placeholder="new address: host, user@host:port or an ~/.ssh/config alias", id="address")

    def on_mount(self) -> None:
        if self.standby:
            self.query_one("#standby", OptionList).focus()
        else:
            self.query_one("#address", Input).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if not value:
            self.notify("type an address, or escape to cancel", severity="warning")
            return
        self.dismiss(value)

    def action_cancel(self) -> None:
        self.dismiss(None)


QUIT_LEAVE = "leave"
QUIT_STOP = "stop"


class QuitScreen(ModalScreen[str | None]):
    """Quitting asks: leave training running (engines outlive the console) or stop it."""

    CSS_PATH = "modals.tcss"
    BINDINGS = [Binding("l", "answer('leave')", "Leave running"), Binding("s", "answer('stop')", "Stop training"),
                Binding("escape,c", "answer(None)", "Cancel")]

    def __init__(self, readonly: bool = False) -> None:
        super().__init__()
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Quit the console. Training on the hosts:", id="question")
            with Horizontal(classes="buttons"):
                yield Button("Leave running (l)", variant="primary", id=QUIT_LEAVE)
                if not self.readonly:
                    yield Button("Stop training (s)", variant="error", id=QUIT_STOP)
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(f"#{QUIT_LEAVE}", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_answer(event.button.id if event.button.id in (QUIT_LEAVE, QUIT_STOP) else None)

    def action_answer(self, answer: str | None) -> None:
        if answer == QUIT_STOP and self.readonly:
            return
        self.dismiss(answer)
