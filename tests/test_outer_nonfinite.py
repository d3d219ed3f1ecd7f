"""One non-finite element is enough to leave a node's round out of the mean (engine/outer/diloco.py).

The end-to-end test (tests/test_diverged.py) fills a whole parameter with NaN and trains on, by which time every
element is NaN: a check that looked at only part of the pseudo-gradient, or only asked whether any element is
finite, passed it. Here two nodes run one outer step over a real gloo group (two threads of this process, the mesh
scripted) and b's pseudo-gradient has a single NaN: b must send weight 0, the mean must be a's alone, and both
must end with a's finite weights (b with fresh optimizer state).
"""

from __future__ import annotations

import datetime
import math
import threading

import pytest
import torch
import torch.distributed as dist

from engine.outer import Progress
from test_diloco_math import FakeMesh, TinyInner, make_outer, make_plan

POISONED = (2, 5)  # one element inside the weight matrix: neither the first nor the last of the flat vector


class Inner(TinyInner):
    def __init__(self, seed: int):
        super().__init__(seed)
        self.resets = 0

    def reset_optimizer_state(self) -> None:
        self.resets += 1
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)


def _gloo(store, rank: int, size: int) -> dist.ProcessGroup:
    pg = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=20))
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def in_threads(run, names: str, timeout: float = 60) -> None:
    """run(name) for each node in a thread of its own, the nodes' collectives pairing over their gloo groups;
    every thread ends within `timeout` (an outer step that hung fails here)."""
    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "an outer step hung"


def _flat(inner) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in inner.outer_params()])


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_single_nan_element_gives_the_round_weight_zero(overlap):
    store = dist.HashStore()
    plan = make_plan(1, 1, 0, ["a", "b"], source="a")
    nodes, events, errors = {}, {"a": [], "b": []}, []
    for name in "ab":
        inner = Inner(0)  # one start, as after the run's formation
        mesh = FakeMesh([plan], [True])
        outer = make_outer(inner, mesh, node=name, events=events[name], inner_steps=1, outer_optimizer="sgd",
                           outer_lr=1.0, outer_momentum=0.0, overlap=overlap,
                           group_factory=lambda p, n, r: _gloo(dist.PrefixStore(f"g{p.generation}/", store),
                                                               p.rank_of(n), p.size))
        progress = Progress()
        outer.start(progress)  # the snapshot: the weights every member starts the round from
        nodes[name] = (inner, outer, progress)
    start = _flat(nodes["a"][0])
    a_inner = nodes["a"][0]
    a_inner.train_step(1)
    a_trained = _flat(a_inner)
    b_inner = nodes["b"][0]
    b_inner.train_step(2)
    with torch.no_grad():
        b_inner.model.weight[POISONED] = float("nan")
    assert int((~torch.isfinite(_flat(b_inner))).sum()) == 1

    def node(name: str) -> None:
        inner, outer, progress = nodes[name]
        try:
            progress.step = 1
            assert outer.after_inner_step(progress) is False
            outer.flush()  # overlap: the outer step in flight lands
            assert progress.outer_step == 1
        except BaseException as e:  # noqa: BLE001 - reported by the test thread below
            errors.append((name, e))
        finally:
            outer.close("completed")

    in_threads(node, "ab")
    assert not errors, errors

    for name in "ab":
        steps = [e for e in events[name] if e["type"] == "outer_step"]
        assert len(steps) == 1, events[name]
        # the weights as they came off the wire: a's alone (> 0), b's 0 is not listed
        assert steps[0]["contributors"] == ["a"] and len(steps[0]["weights"]) == 1 and steps[0]["weights"][0] > 0, \
            steps[0]
        assert math.isfinite(steps[0]["pgrad_norm"])
        got = _flat(nodes[name][0])
        assert bool(torch.isfinite(got).all()), f"{name}'s weights are not finite"
        # lr 1, no momentum, b's weight 0: the new weights are a's own, whatever b trained
        torch.testing.assert_close(got, start - (start - a_trained), rtol=0, atol=1e-6)
    said = [e["message"] for e in events["b"] if e["type"] == "warning"]
    assert len(said) == 1 and "not finite" in said[0], said
    assert (nodes["a"][0].resets, nodes["b"][0].resets) == (0, 1)
    assert events["a"][-1]["checksum"] == events["b"][-1]["checksum"]


def test_a_mean_beyond_the_codecs_range_stops_every_member_before_it_commits():
    """fp16 ends at 65504: a finite pseudo-gradient element beyond it (the sentinel off, or not flagging it) made
    the mean inf, and the commit put inf into every member's snapshot. Every member now stops before its vote, with
    one line that names the codec, on the weights it had."""
    store = dist.HashStore()
    plan = make_plan(1, 1, 0, ["a", "b"], source="a")
    nodes, errors = {}, {}
    for name in "ab":
        inner = Inner(0)
        outer = make_outer(inner, FakeMesh([plan], [True]), node=name, inner_steps=1, compression="fp16",
                           sentinel_ratio=0, group_factory=lambda p, n, r: _gloo(
                               dist.PrefixStore(f"g{p.generation}/", store), p.rank_of(n), p.size))
        outer.start(Progress())
        nodes[name] = (inner, outer)
    snapshot = nodes["a"][1].bufs.snapshot.clone()
    nodes["b"][0].train_step(2)
    with torch.no_grad():
        nodes["b"][0].model.weight[POISONED] = -2e5  # its pseudo-gradient there about 2e5: finite in fp32, the mean 1e5

    def node(name: str) -> None:
        inner, outer = nodes[name]
        try:
            outer.after_inner_step(Progress(step=1))
        except Exception as e:  # noqa: BLE001 - the assertion below
            errors[name] = e
        finally:
            outer.close("failed")

    in_threads(node, "ab")
    assert sorted(errors) == ["a", "b"], errors
    assert all(str(e).startswith("outer step 1: the mean of finite pseudo-gradients is not finite: a value beyond "
                                 "diloco.compression = 'fp16''s range") for e in errors.values()), errors
    assert all(torch.equal(outer.bufs.snapshot, snapshot) for _, outer in nodes.values())  # nothing committed


@pytest.mark.parametrize("loop", [{"inner_steps": 1}, {"inner_steps": 2, "fragments": 2}], ids=["diloco", "fragments"])
def test_a_joiner_whose_admission_a_store_restart_voided_joins_the_re_formed_run(loop):
    """b waits for admission when the store restarts empty: its wait raised Reformed out of DilocoOuter.start (a
    traceback, exit 1). Now it joins the re-formed run, which makes it a joiner (it arrives with nothing to give)
    and hands it a's state and step."""
    from engine.mesh.protocol import Reformed

    store = dist.HashStore()
    plan = make_plan(1, 6, 0, ["a", "b"], joiners=["b"], source="a", forming=True)

    class VoidedAdmission(FakeMesh):
        def wait_admission(self):
            raise Reformed("node b: mesh admission: the membership store restarted empty; the run re-forms")

        def boundary(self, outer_step, attempt, *, contributing, draining, budget=None):
            assert not contributing  # it has no round of the run to give
            return self.plans.pop(0)

    nodes, errors, events = {}, {}, {"a": [], "b": []}
    for name in "ab":
        inner = Inner(0 if name == "a" else 1)  # b's own (stale) weights differ
        mesh = FakeMesh([plan], [True]) if name == "a" else VoidedAdmission([plan], [True], joiner=True)
        outer = make_outer(inner, mesh, node=name, events=events[name], **loop, group_factory=lambda p, n, r:
                           _gloo(dist.PrefixStore(f"g{p.generation}/", store), p.rank_of(n), p.size))
        nodes[name] = (inner, outer, Progress(step=5, outer_step=5, tokens=500) if name == "a" else Progress())

    def node(name: str) -> None:
        inner, outer, progress = nodes[name]
        try:
            outer.start(progress)  # b: its admission voided, then the re-formed run's plan
            if name == "a":
                inner.train_step(6)
                progress.step, progress.tokens = 6, 600
                outer.after_inner_step(progress)  # the re-formation's outer step: a sends b the state
        except Exception as e:  # noqa: BLE001 - the assertion below
            errors[name] = e
        finally:
            outer.close("completed")

    in_threads(node, "ab")
    assert not errors, errors
    (a_inner, a, a_progress), (b_inner, b, b_progress) = nodes["a"], nodes["b"]
    assert torch.equal(a.bufs.snapshot, b.bufs.snapshot)
    if "fragments" not in loop:  # with fragments a keeps its own progress on the fragment not synced
        assert torch.equal(_flat(a_inner), _flat(b_inner))
    assert (b_progress.step, b_progress.outer_step) == (a_progress.step, a_progress.outer_step) == (6, 6)
    assert any("restarted empty" in e.get("message", "") for e in events["b"] if e["type"] == "warning")
