"""A wait's polls: every 2 ms at first, then never later than an eighth of the wait so far, up to the interval
(engine/mesh/polling.py). A plan or a decision lands within milliseconds of the last arrival or post; a fixed 100 ms
interval made each of an outer step's waits lose up to a whole interval to it, and pauses doubling from 5 ms up to
half the wait so far."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.mesh.polling import FIRST_POLL_S, LATE, Polling


def polling(*, use_thread: bool, interval: float = 0.1) -> tuple[Polling, list[float]]:
    slept: list[float] = []
    heartbeat = SimpleNamespace(use_thread=use_thread, error=None, beat=lambda: None)
    m = SimpleNamespace(reset=False, state="training")
    cfg = SimpleNamespace(polling_interval=interval)
    return Polling(m, heartbeat, "a", None, cfg, sleep=slept.append, interrupt=None, can_resume=True), slept


def test_a_wait_polls_soon_then_backs_off_to_the_interval_and_a_new_wait_starts_over():
    p, slept = polling(use_thread=True)
    for _ in range(80):
        p.idle("outer step 3 attempt 0")
    assert slept[:8] == pytest.approx([FIRST_POLL_S] * 8)  # 2 ms apart until 16 ms have passed
    for k, pause in enumerate(slept):
        waited = sum(slept[:k])
        # never later than 2 ms or an eighth of the wait so far: what it waits for is seen at most that late
        assert pause <= max(FIRST_POLL_S, LATE * waited) + 1e-12 and pause <= 0.1
        assert pause == pytest.approx(min(0.1, max(FIRST_POLL_S, LATE * waited)))
    assert 20 <= sum(1 for k in range(len(slept)) if sum(slept[:k]) < 1.0) <= 50  # a 1 s wait polls ~45 times
    assert slept[-3:] == pytest.approx([0.1] * 3)  # a long wait: once an interval
    slept.clear()
    p.idle("commit of outer step 3 attempt 0")  # the next wait: soon again
    assert slept == [FIRST_POLL_S]


def test_without_a_heartbeat_thread_the_waits_keep_the_fixed_interval():
    """Tests and the scale bench drive nodes by hand: each pause beats the heart, at the interval."""
    p, slept = polling(use_thread=False)
    for _ in range(3):
        p.idle("outer step 3 attempt 0")
    assert slept == [0.1, 0.1, 0.1]
