"""Across nodes: the outer loop that wraps the inner loop (docs/architecture.md).

protocol.py is the seam the training loop sees (Outer, NoOuter, build_outer) and progress.py its counters; the
DiLoCo loop (diloco.py) is built of the outer optimizer (optimizer.py), the buffers where the parameters live
(buffers.py), the weighted-mean all-reduce and its codecs (allreduce.py), overlap (overlap.py) and the state
hand-off to joiners (handoff.py).
"""

from engine.outer.progress import Progress
from engine.outer.protocol import Diverged, NoOuter, Outer, build_outer

__all__ = ["Diverged", "NoOuter", "Outer", "Progress", "build_outer"]
