"""Across nodes: the outer loop that wraps the inner loop (docs/architecture.md).

build.py is the factory the training loop calls and the seam it sees (build_outer, Outer, NoOuter), progress.py its
counters; the DiLoCo loop (diloco.py) is one outer step's story (step.py) told by parts picked from the config: the
landing (landing.py), the cover (cover.py), the codec (codec.py, allreduce.py), the outer optimizer (optimizer.py),
the exchange (exchange.py), the step in flight (flight.py), the buffers where the parameters live (buffers.py) and
the state hand-off to joiners (handoff.py).
"""

from engine.outer.build import Diverged, NoOuter, Outer, build_outer
from engine.outer.progress import Progress

__all__ = ["Diverged", "NoOuter", "Outer", "Progress", "build_outer"]
