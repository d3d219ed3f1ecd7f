"""The outer step in flight, a part of the outer loop: one outer step running in a background thread while the next
round trains (diloco.overlap; diloco.fragments with fragment_delay), and the bookkeeping of it.

    flight.launch(progress, run, compute_s=..., land_in=tau)   run(frozen) in a thread; frozen: the boundary's counters
    flight.lands_by(step)                                      due to land after this inner step (tau steps in, or done)
    err = flight.wait()                                        joined (bounded): what it raised, or None
    flight.settle()                                            the round's counters onto the live ones

The thread runs the outer step's whole story (mesh boundary, exchange, commit, retries, hand-offs) on a copy of the
node's counters as of the boundary (`frozen`), so that the training thread's own counters move on meanwhile; when it
lands, the live counters take the round's outer step and, where a hand-off in flight rewrote step and tokens (a
re-join), those plus what trained since the boundary. On a GPU its kernels run on a CUDA stream of their own, ordered
after the boundary's work, so that they run beside the training's. `committed` says whether the step in flight
committed (its result waits to land): a stop that comes after that lands it like any other.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Callable

import torch

from engine.outer.progress import Progress


class Flight:
    def __init__(self, device: torch.device, timeout_s: float):
        self.device, self.timeout_s = device, timeout_s  # timeout_s: how long an outer step may take at most
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream: Any = None
        self._counters: tuple[Progress, Progress, int, int] | None = None  # frozen, live, live's step and tokens
        self.compute_s = 0.0  # seconds of inner steps in the round it closes (its outer_step event)
        self.land_at: int | None = None  # the inner step at which it lands (None: as soon as it is done)
        self.committed = False  # it committed: its result waits to land

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def on_it(self) -> bool:
        """True on the thread of the outer step in flight."""
        return self._thread is not None and threading.current_thread() is self._thread

    def lands_by(self, step: int) -> bool:
        """After inner step `step`: whether the outer step in flight is due to land now."""
        t = self._thread
        return t is not None and (not t.is_alive() if self.land_at is None else step >= self.land_at)

    def launch(self, progress: Progress, run: Callable[[Progress], None], *, compute_s: float,
               land_in: int | None, name: str) -> None:
        """run(frozen) in a background thread, frozen a copy of progress as of the boundary; it lands `land_in`
        inner steps later (None or 0: as soon as it is done). What it raises, wait() returns."""
        frozen = copy.copy(progress)
        self._counters = (frozen, progress, progress.step, progress.tokens)
        self.land_at = progress.step + land_in if land_in else None
        self.committed, self.compute_s, self._error = False, compute_s, None
        stream = self._side_stream()

        def body() -> None:
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    run(frozen)
                    if stream is not None:
                        stream.synchronize()  # its results are complete before the training thread lands them
            except BaseException as e:  # noqa: BLE001 - handed to the training thread (wait)
                self._error = e

        self._thread = threading.Thread(target=body, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> BaseException | None:
        """Join the outer step in flight (bounded by timeout_s) and return what it raised (None: nothing). The
        live counters take the round's outer step either way (settle() does the rest)."""
        thread = self._thread
        assert thread is not None and self._counters is not None, "no outer step in flight"
        thread.join(timeout=self.timeout_s)
        if thread.is_alive():
            raise RuntimeError(f"diloco: the outer step in flight did not finish within {self.timeout_s:g}s")
        self._thread = None
        frozen, live = self._counters[0], self._counters[1]
        live.outer_step = frozen.outer_step
        err, self._error = self._error, None
        return err

    def settle(self) -> None:
        """The round's counters (a hand-off's step and tokens) plus what trained since the boundary."""
        assert self._counters is not None
        frozen, live, step0, tokens0 = self._counters
        live.step, live.tokens = frozen.step + live.step - step0, frozen.tokens + live.tokens - tokens0
        live.outer_step = frozen.outer_step

    def done(self, timeout: float) -> bool:
        """Wait until the outer step in flight has ended, without landing it (tests); True when none runs."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout)
        return thread is None or not thread.is_alive()

    def close(self) -> None:
        """At the end: an outer step in flight ends first (bounded); what it raised is dropped."""
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
            self._thread = None

    def _side_stream(self) -> Any:
        """The CUDA stream of the outer step in flight (None on CPU), ordered after the boundary's work."""
        if self.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream
