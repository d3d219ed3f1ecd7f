"""A node's progress: the counters every part of a run agrees on (checkpointed, handed to joiners)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Progress:
    step: int = 0  # inner optimizer steps completed
    outer_step: int = 0  # outer steps committed (0 without DiLoCo)
    tokens: int = 0  # tokens this node has trained on

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.outer_step, self.tokens = int(state["step"]), int(state["outer_step"]), int(state["tokens"])
