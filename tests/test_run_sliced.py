"""engine.outer.groups.run_sliced: a bounded collective's wait. It ends the moment the collective does, even while
its watcher is inside a slow give_up() (a store round trip behind a busy link); a reason or a stop from the watcher
ends it while the collective still runs."""

from __future__ import annotations

import threading
import time

import pytest

from engine.mesh.protocol import Stopped
from engine.outer.groups import PeerLost, run_sliced


def test_the_wait_ends_when_the_collective_does_not_when_a_slow_check_returns():
    asked, release = threading.Event(), threading.Event()

    def slow_check() -> None:  # the store round trip, stuck until the test lets it go
        asked.set()
        release.wait(10)
        return None

    def collective() -> str:
        asked.wait(10)  # finishes while the watcher is inside its check
        return "mean"

    t0 = time.monotonic()
    try:
        assert run_sliced(collective, "test", 0.01, slow_check) == "mean"
        took = time.monotonic() - t0
    finally:
        release.set()
    assert took < 5, took  # the check was still stuck (it waits 10 s for the release)


def test_a_reason_or_a_stop_ends_the_wait_while_the_collective_still_runs():
    forever = threading.Event()
    checks = iter([None, None, "b stopped beating"])
    with pytest.raises(PeerLost, match="b stopped beating"):
        run_sliced(lambda: forever.wait(10), "test", 0.01, lambda: next(checks))

    def stop():
        raise Stopped("SIGTERM", "all-reduce")
    with pytest.raises(Stopped):
        run_sliced(lambda: forever.wait(10), "test", 0.01, stop)
    forever.set()


def test_the_collectives_own_error_is_raised_and_no_check_is_needed_for_a_quick_one():
    def broken():
        raise RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        run_sliced(broken, "test", 10.0, lambda: "never asked")
    assert run_sliced(lambda: 7, "test", 10.0, lambda: "never asked") == 7
