"""A wait's polls: soon at first, then once an interval (engine/mesh/polling.py). A plan or a decision lands
within milliseconds of the last arrival or post; a fixed 100 ms interval made each of an outer step's waits lose
up to a whole interval to it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.mesh.polling import FIRST_POLL_S, Polling


def polling(*, use_thread: bool, interval: float = 0.1) -> tuple[Polling, list[float]]:
    slept: list[float] = []
    heartbeat = SimpleNamespace(use_thread=use_thread, error=None, beat=lambda: None)
    m = SimpleNamespace(reset=False, state="training")
    cfg = SimpleNamespace(polling_interval=interval)
    return Polling(m, heartbeat, "a", None, cfg, sleep=slept.append, interrupt=None, can_resume=True), slept


def test_a_wait_polls_soon_then_backs_off_to_the_interval_and_a_new_wait_starts_over():
    p, slept = polling(use_thread=True)
    for _ in range(7):
        p.idle("outer step 3 attempt 0")
    assert slept == pytest.approx([FIRST_POLL_S * 2 ** k for k in range(5)] + [0.1, 0.1])
    assert sum(slept[:5]) < 0.16  # five looks in the time one fixed pause took half of
    slept.clear()
    p.idle("commit of outer step 3 attempt 0")  # the next wait: soon again
    assert slept == [FIRST_POLL_S]


def test_without_a_heartbeat_thread_the_waits_keep_the_fixed_interval():
    """Tests and the scale bench drive nodes by hand: each pause beats the heart, at the interval."""
    p, slept = polling(use_thread=False)
    for _ in range(3):
        p.idle("outer step 3 attempt 0")
    assert slept == [0.1, 0.1, 0.1]
