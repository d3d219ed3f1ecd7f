"""An abandoned exchange writes only into its own attempt's buffers.

gloo cannot cancel a collective: when a member gives up on one (a peer stopped beating, the attempt was decided
without it), the collective's helper thread goes on, and may run to its end seconds later, when the slow peer's
packets finally arrive. OuterBuffers.renew_scratch gives the next attempt fresh mean and wire buffers for that
reason. The seed-44 soak (docs/reliability.md) found the hole: the helper thread stuck in the sentinel's gather read
`bufs.mean` only when it went on to the mean, after the renewal, so it wrote the old attempt's mean into the
buffer of an outer step in progress (between its norm and its update): that node's weights left the others' for 24
outer steps, each with the same members and the same mean norm.
"""

from __future__ import annotations

import threading

import torch

from engine.outer.buffers import OuterBuffers
from engine.outer.codec import Dense
from engine.outer.exchange import exchange
from engine.outer.groups import PeerLost
from engine.outer.sentinel import Sentinel


class AbandoningLinks:
    """MeshLinks' part in exchange(), where every collective is given up at once (PeerLost) and its helper thread
    goes on only when `resume` is set, as a gloo collective does when a slow peer's data arrives."""

    def __init__(self) -> None:
        self.resume = threading.Event()
        self.thread: threading.Thread | None = None
        self.failed_plans: list[object] = []

    def group(self, plan):
        return None  # no peers: the mean of one is its own pseudo-gradient (written into `out`)

    def bounded(self, plan, what, fn):
        def later() -> None:
            self.resume.wait(10)
            fn()
        self.thread = threading.Thread(target=later, daemon=True)
        self.thread.start()
        raise PeerLost(f"{what}: c stopped beating")

    def failed(self, plan, error) -> None:
        self.failed_plans.append(plan)


class Plan:
    members = contributors = ("a", "b")
    outer_step, attempt = 7, 0


def test_an_abandoned_exchange_never_writes_into_the_buffers_of_a_later_attempt():
    params = [torch.zeros(6), torch.zeros(4)]
    bufs = OuterBuffers(params)
    pgrad = torch.arange(10, dtype=torch.float32)
    links = AbandoningLinks()
    sentinel = Sentinel(ratio=10.0, min_cosine=-0.1, local=None, emit=lambda *a, **k: None)
    old_mean = bufs.mean
    out = exchange(Plan(), pgrad, 1.0, node_id="a", links=links, sentinel=sentinel, bufs=bufs, codec=Dense("none"))
    assert out.stats is None and "c stopped beating" in out.reason and links.failed_plans
    assert bufs.mean is not old_mean  # renewed: the next attempt's mean is a buffer of its own
    bufs.mean.fill_(7.0)  # the next attempt's mean, between its norm and the outer optimizer's update
    links.resume.set()  # the abandoned collective runs to its end now
    links.thread.join(10)
    assert not links.thread.is_alive()
    assert torch.equal(bufs.mean, torch.full((10,), 7.0)), bufs.mean  # untouched by the old attempt
    assert torch.equal(old_mean, pgrad)  # the old attempt wrote where it was told to, when it was started
