"""Streaming DiLoCo (diloco.fragments: engine/outer/cover.py, landing.py): outer step k syncs fragment (k - 1) % P
only, weighted by the tokens each node trained since that fragment's last sync; the other fragments keep each node's
own progress; a drain contributes the fragments it has not sent; the agreed snapshot is identical everywhere."""

from __future__ import annotations

import datetime
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist

from engine.config import DilocoConfig
from engine.outer import Progress
from engine.outer.buffers import fingerprint
from engine.outer.cover import spans
from engine.outer.optimizer import build_outer_optimizer
from procs import spawned_ranks
from test_diloco_math import FakeMesh, TinyInner, _group, make_outer, make_plan

P, H = 3, 3  # an outer step after every inner step, each syncing a third of the model
RATE = {"a": 100, "b": 300}  # tokens per inner step: b trains three times a's tokens (weights differ)


def test_spans_cover_every_element_once_in_about_equal_parts():
    for numel, parts in ((36, 3), (37, 3), (10, 4), (5, 5), (1000003, 7)):
        got = spans(numel, parts)
        assert got[0][0] == 0 and got[-1][1] == numel and len(got) == parts
        assert all(hi == lo2 for (_, hi), (lo2, _) in zip(got, got[1:]))
        sizes = [hi - lo for lo, hi in got]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) > 0


@pytest.mark.parametrize("bad,match", [
    ({"inner_steps": 4, "fragments": 3}, "must divide diloco.inner_steps"),
    ({"inner_steps": 6, "fragments": 3, "round": "time", "round_seconds": 5}, "needs diloco.round"),
    ({"inner_steps": 6, "fragments": 3, "overlap": True}, "choose one"),
])
def test_bad_fragment_settings_are_refused_with_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        DilocoConfig(enabled=True, **bad)


def test_more_fragments_than_values_is_refused():
    inner = TinyInner(0)  # 36 values
    with pytest.raises(ValueError, match=r"diloco.fragments \(37\): this rank holds only 36 values"):
        make_outer(inner, FakeMesh([], []), inner_steps=37, fragments=37)


def _flat(inner) -> torch.Tensor:
    return torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])


def _node(rank: int, store, prefix: str, plans, events, inner_steps: int = H, **diloco):
    inner = TinyInner(0)
    mesh = FakeMesh(plans, [True] * len(plans))
    outer = make_outer(inner, mesh, node="ab"[rank], min_nodes=2, inner_steps=inner_steps, fragments=P, events=events,
                       group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, prefix), **diloco)
    return inner, outer, mesh


SCENARIOS = ("sync", "end", "delay")


def _worker(rank: int, port: int, queue) -> None:
    """Node a or b of every two-node scenario below, one after another over one store (each its own groups)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    out: dict = {}
    for name in SCENARIOS:
        try:
            out[name] = globals()[f"_{name}_scenario"](rank, store)
        except Exception:  # the test of that scenario reports the traceback
            out[name] = traceback.format_exc()
            break  # the other node may wait in a collective of this one: nothing after it can pair up
    queue.put((rank, pickle.dumps(out)))


@pytest.fixture(scope="module")
def two_nodes() -> dict[str, tuple[dict, dict]]:
    """Each scenario's (node a's, node b's) results; one pair of processes for all (each start imports torch)."""
    got = spawned_ranks(_worker, 2, timeout=180)
    out = {}
    for name in SCENARIOS:
        a, b = got[0].get(name, "not run: an earlier scenario failed"), got[1].get(name, "not run")
        for r in (a, b):
            assert isinstance(r, dict), f"scenario {name}:\n{r}"
        out[name] = (a, b)
    return out


def _sync_scenario(rank: int, store) -> dict:
    """Seven outer steps of two nodes (fragments 0, 1, 2, 0, 1, 2, 0), Nesterov with momentum and fragment_alpha
    0.25; node b asks to drain at step 5 (fragment 1), and sends its last fragments (2 and 0) without training."""
    node = "ab"[rank]
    steps = 7 if node == "a" else 5
    plans = [make_plan(1, k, 0, ["a", "b"], source="a") for k in range(1, 8)]
    events: list = []
    inner, outer, mesh = _node(rank, store, "frag/", plans, events, outer_optimizer="nesterov", outer_lr=0.7,
                               outer_momentum=0.9, fragment_alpha=0.25)
    progress = Progress()
    outer.start(progress)
    out: dict = {"s0": outer.bufs.snapshot.clone(), "spans": outer.cover.spans, "records": [], "prepared": _wire(outer)}
    left = False
    for step in range(1, steps + 1):
        inner.train_step(100 * rank + step)
        progress.step, progress.tokens = step, step * RATE[node]
        before = _flat(inner)
        if node == "b" and step == 5:
            outer.request_drain()
        left = outer.after_inner_step(progress)
        out["records"].append({"step": step, "before": before, "after": _flat(inner),
                               "snapshot": outer.bufs.snapshot.clone()})
        if left:
            break
    out["left"], out["mesh_left"] = left, mesh.left
    out["events"] = [e for e in events if e["type"] in ("outer_step", "drained")]
    out["final"] = fingerprint(outer.bufs.snapshot)
    out["state"] = outer.state_dict()
    out["used"] = _wire(outer)
    return out


def _wire(outer) -> list[dict]:
    """Each fragment's wire buffers (address, shape), then the whole model's (which fragments never use)."""
    return [{k: (t.data_ptr(), t.shape) for k, t in ex._bufs.items()}
            for ex in [fb.exchange for fb in outer.cover.frag_bufs] + [outer.bufs.exchange]]


def test_each_outer_step_syncs_one_fragment_by_tokens_since_its_last_sync_and_a_drain_sends_the_rest(two_nodes):
    a, b = two_nodes["sync"]
    parts = a["spans"]
    outer_a = [e for e in a["events"] if e["type"] == "outer_step"]
    outer_b = [e for e in b["events"] if e["type"] == "outer_step"]
    # a: one outer step per inner step; b: steps 1-5, then its last two fragments (2, 0) at once and it leaves
    assert [(e["outer_step"], e["fragment"]) for e in outer_a] == [(1, 0), (2, 1), (3, 2), (4, 0), (5, 1), (6, 2),
                                                                  (7, 0)]
    assert [(e["outer_step"], e["fragment"]) for e in outer_b] == [(e["outer_step"], e["fragment"]) for e in outer_a]
    assert b["left"] and b["mesh_left"] == "drained" and b["events"][-1]["type"] == "drained"
    assert len(b["records"]) == 5  # it trained no step after the drain
    # the weights are the tokens each node trained since the fragment's last sync (not its round's, not its total)
    weights = [e["weights"] for e in outer_a]
    assert weights[:3] == [[100.0, 300.0], [200.0, 600.0], [300.0, 900.0]]  # first syncs: since the start
    assert weights[3:5] == [[300.0, 900.0]] * 2  # then every H = 3 steps
    # b's drain: fragments 2 (last synced at step 3) and 0 (at step 4) carry what b trained until step 5
    assert weights[5:] == [[300.0, 600.0], [300.0, 300.0]]
    # the snapshot is agreed on every member, after every outer step
    for ra, rb in zip(a["records"][:4], b["records"]):
        assert torch.equal(ra["snapshot"], rb["snapshot"]), ra["step"]
    assert a["final"] == b["final"]

    # the arithmetic, fragment by fragment, with an outer optimizer of its own per fragment (momentum per element)
    opts = [build_outer_optimizer("nesterov", 0.7, 0.9) for _ in parts]
    snap = a["s0"].clone()
    recs = {"a": a["records"], "b": b["records"]}
    for k in range(1, 8):  # outer step k: a trained up to step k, b up to step min(k, 5)
        f = (k - 1) % P
        lo, hi = parts[f]
        ra, rb = recs["a"][k - 1], recs["b"][min(k, 5) - 1]
        da, db = snap[lo:hi] - ra["before"][lo:hi], snap[lo:hi] - rb["before"][lo:hi]
        wa, wb = outer_a[k - 1]["weights"]
        g = (wa * da + wb * db) / (wa + wb)
        new = snap[lo:hi].clone()
        opts[f].step_(new, g.clone())
        torch.testing.assert_close(ra["snapshot"][lo:hi], new, rtol=0, atol=1e-6)
        snap[lo:hi] = new
        for name, r in (("a", ra), ("b", rb)) if k < 5 else (("a", ra),):
            # the synced fragment: 3/4 agreed, 1/4 the node's own; every other fragment untouched by the sync
            torch.testing.assert_close(r["after"][lo:hi], 0.75 * new + 0.25 * r["before"][lo:hi], rtol=0, atol=1e-6)
            rest = torch.ones_like(r["after"], dtype=torch.bool)
            rest[lo:hi] = False
            assert torch.equal(r["after"][rest], r["before"][rest])
    # b's last three fragments, from its weights at step 5 (no step trained in between)
    last = recs["b"][-1]
    for f in range(P):
        lo, hi = parts[f]
        torch.testing.assert_close(last["after"][lo:hi], 0.75 * snap[lo:hi] + 0.25 * last["before"][lo:hi],
                                   rtol=0, atol=1e-6)
    assert a["final"] == fingerprint(snap)
    assert a["state"]["fragments"] == P and a["state"]["fragment_tokens0"] == [700, 500, 600]  # a's last syncs


def _end_scenario(rank: int, store) -> dict:
    """Two nodes to train.max_steps = 4 (fragments 0, 1, 2, 0 at steps 1-4), fragment_alpha 0.5."""
    node = "ab"[rank]
    plans = [make_plan(1, k, 0, ["a", "b"], source="a") for k in range(1, 7)]
    events: list = []
    inner, outer, _ = _node(rank, store, "end/", plans, events, outer_optimizer="average", fragment_alpha=0.5)
    progress = Progress()
    outer.start(progress)
    before_last = None
    while not outer.finished(progress, 4):
        inner.train_step(100 * rank + progress.step + 1)
        progress.step, progress.tokens = progress.step + 1, (progress.step + 1) * RATE[node]
        if progress.step == 4:
            before_last = _flat(inner)
        outer.after_inner_step(progress)
    return {"params": _flat(inner), "snapshot": outer.bufs.snapshot.clone(), "before_last": before_last,
            "spans": outer.cover.spans, "outer": [(e["outer_step"], e["fragment"], e["step"]) for e in events
                                            if e["type"] == "outer_step"]}


def test_every_fragments_wire_buffers_are_prepared_at_start_and_no_others(two_nodes):
    """With min_nodes = 2, start() allocates each fragment's wire buffers for a mean of two (Exchange.prepare):
    the outer steps then allocate none, and the whole model's, which fragments never use, is never allocated."""
    for node in two_nodes["sync"] + two_nodes["delay"]:  # the delayed fragments' means run in a thread
        *fragments, whole = node["prepared"]
        assert all(fragments) and not whole
        assert node["used"] == node["prepared"]


def test_the_run_ends_with_every_fragment_synced_and_every_member_on_the_agreed_weights(two_nodes):
    a, b = two_nodes["end"]
    # step 4 syncs fragment 0; then fragments 1 and 2 at once, without training: every fragment synced at step 4
    assert a["outer"] == b["outer"] == [(1, 0, 1), (2, 1, 2), (3, 2, 3), (4, 0, 4), (5, 1, 4), (6, 2, 4)]
    assert torch.equal(a["snapshot"], b["snapshot"])
    # the end takes the agreed weights whole (no fragment_alpha): both members hold the same model, the snapshot
    assert torch.equal(a["params"], a["snapshot"]) and torch.equal(b["params"], b["snapshot"])
    # fragment 0, synced at step 4 itself, took the agreed weights whole too (fragment_alpha 0.5 mixed before)
    lo, hi = a["spans"][0]
    assert not torch.equal(a["before_last"][lo:hi], a["params"][lo:hi])


def _delay_scenario(rank: int, store) -> dict:
    """Two nodes, H = 9 in 3 fragments (a boundary every 3 steps); fragment_delay 2: the fragment of a boundary at
    step t lands at step t + 2, one step before the next boundary. Step 15 is the run's last: synchronous, whole."""
    node = "ab"[rank]
    plans = [make_plan(1, k, 0, ["a", "b"], source="a") for k in range(1, 8)]
    events: list = []
    inner, outer, _ = _node(rank, store, "delay/", plans, events, inner_steps=9, outer_optimizer="nesterov",
                            outer_lr=0.7, outer_momentum=0.5, fragment_alpha=0.5, fragment_delay=2)
    progress = Progress()
    outer.start(progress)
    out: dict = {"s0": outer.bufs.snapshot.clone(), "spans": outer.cover.spans, "records": [], "prepared": _wire(outer)}
    while not outer.finished(progress, 15):
        inner.train_step(100 * rank + progress.step + 1)
        progress.step, progress.tokens = progress.step + 1, (progress.step + 1) * RATE[node]
        before = _flat(inner)
        outer.after_inner_step(progress)
        out["records"].append({"before": before, "after": _flat(inner), "in_flight": outer.flight.busy,
                               "outer_step": progress.outer_step})
    out["snapshot"] = outer.bufs.snapshot.clone()
    out["outer"] = [(e["outer_step"], e["fragment"], e["step"], e["weights"]) for e in events
                    if e["type"] == "outer_step"]
    out["used"] = _wire(outer)
    return out


def test_a_delayed_fragment_lands_later_mixed_and_keeps_the_steps_trained_meanwhile(two_nodes):
    a, b = two_nodes["delay"]
    assert [o[:3] for o in a["outer"]] == [(1, 0, 3), (2, 1, 6), (3, 2, 9), (4, 0, 12), (5, 1, 15), (6, 2, 15),
                                           (7, 0, 15)]
    flying = [s for s in range(1, 16) if s % 3 in (0, 1) and 3 <= s <= 13]  # from a boundary to the step before landing
    assert [s for s, r in enumerate(a["records"], 1) if r["in_flight"]] == flying
    # the outer step counter moves when a fragment lands (steps 5, 8, 11, 14), not when it goes in flight
    assert [r["outer_step"] for r in a["records"]] == [0] * 4 + [1] * 3 + [2] * 3 + [3] * 3 + [4, 7]
    parts, opts = a["spans"], [build_outer_optimizer("nesterov", 0.7, 0.5) for _ in a["spans"]]
    snap = a["s0"].clone()
    for n in range(1, 5):  # the boundary of outer step n is step 3n; it lands at step 3n + 2
        f, t = (n - 1) % P, 3 * n
        lo, hi = parts[f]
        wa, wb = a["outer"][n - 1][3]
        g = (wa * (snap[lo:hi] - a["records"][t - 1]["before"][lo:hi])
             + wb * (snap[lo:hi] - b["records"][t - 1]["before"][lo:hi])) / (wa + wb)
        opts[f].step_(snap[lo:hi], g.clone())
        for r in (a, b):
            for s in (t, t + 1):  # in flight: the fragment's weights are the node's own
                assert torch.equal(r["records"][s - 1]["after"][lo:hi], r["records"][s - 1]["before"][lo:hi]), s
            # step t + 2: the agreed fragment mixed with the node's weights at the boundary, plus its two steps since
            landed, boundary = r["records"][t + 1], r["records"][t - 1]["before"][lo:hi]
            want = 0.5 * snap[lo:hi] + 0.5 * boundary + (landed["before"][lo:hi] - boundary)
            torch.testing.assert_close(landed["after"][lo:hi], want, rtol=0, atol=1e-6)
    assert torch.equal(a["snapshot"], b["snapshot"])
    assert torch.equal(a["records"][-1]["after"], a["snapshot"]) and torch.equal(b["records"][-1]["after"],
                                                                                   b["snapshot"])


class MasterInner(TinyInner):
    """Outer parameters that require grad, as DeepSpeed ZeRO's fp32 master partitions do (engine/inner/zero.py)."""

    def outer_params(self):
        return list(self.model.parameters())


def test_outer_parameters_that_require_grad_are_synced_in_place():
    """Defect: with inner.strategy zero2/zero3 the first fragment's pseudo-gradient failed ("sub(): functions with
    out=... arguments don't support automatic differentiation"): the fragment's copies ran outside no_grad."""
    inner = MasterInner(0)
    assert all(p.requires_grad for p in inner.outer_params())
    mesh = FakeMesh([make_plan(1, k, 0, ["a"], source="a") for k in (1, 2)], [True, True])
    outer = make_outer(inner, mesh, inner_steps=H, fragments=P, outer_optimizer="sgd", outer_lr=0.5,
                       outer_momentum=0.0)
    progress = Progress()
    outer.start(progress)
    s0 = outer.bufs.snapshot.clone()
    inner.train_step(1)
    own = _flat(inner).detach()
    progress.step, progress.tokens = 1, 100
    outer.after_inner_step(progress)
    lo, hi = outer.cover.spans[0]
    # one member: the mean is its own pseudo-gradient; half of it taken (lr 0.5) on fragment 0 only
    torch.testing.assert_close(_flat(inner).detach()[lo:hi], s0[lo:hi] - 0.5 * (s0[lo:hi] - own[lo:hi]),
                               rtol=0, atol=1e-6)
    assert torch.equal(_flat(inner).detach()[hi:], own[hi:]) and not outer.bufs.pgrad.requires_grad


@pytest.mark.parametrize("delay", [0, 1])
def test_a_node_left_out_that_rejoins_in_flight_takes_the_runs_step_and_tokens(delay):
    """b was left out (it arrived late) and is admitted again by the plan of outer step 6, from a at step 5 with
    5000 tokens. With step rounds it takes a's step and tokens and keeps the steps it trained meanwhile. Defect:
    with fragment_delay the re-join happened in flight and b kept its own (step 4, 4000 tokens) while its anchors
    counted from a's (6000): its next fragment's weight was -2000, its boundaries off by the steps it missed."""
    from engine.mesh.protocol import Excluded
    from test_outer_nonfinite import _gloo, in_threads

    store = dist.HashStore()
    plan = make_plan(1, 6, 0, ["a", "b"], joiners=["b"], source="a")

    class LeftOut(FakeMesh):
        def boundary(self, *args, **kwargs):
            raise Excluded("b arrived late: left out")

    nodes, out = {}, {}
    for name in "ab":
        inner = TinyInner(0)
        mesh = (FakeMesh if name == "a" else LeftOut)([plan], [True])
        outer = make_outer(inner, mesh, node=name, inner_steps=2, fragments=2, fragment_delay=delay,
                           outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0,
                           group_factory=lambda p, n, r: _gloo(dist.PrefixStore(f"g{p.generation}/", store),
                                                               p.rank_of(n), p.size))
        progress = Progress(step=5, outer_step=5, tokens=5000) if name == "a" else \
            Progress(step=2, outer_step=2, tokens=2000)
        outer.start(progress)
        nodes[name] = (inner, outer, progress)

    def run(name: str) -> None:
        inner, outer, progress = nodes[name]
        try:
            inner.train_step(3)
            progress.step, progress.tokens = progress.step + 1, progress.tokens + 1000
            outer.after_inner_step(progress)  # a: the boundary of outer step 6; b: left out, re-admitted
            inner.train_step(4)  # with fragment_delay, in flight
            progress.step, progress.tokens = progress.step + 1, progress.tokens + 1000
            outer.flush()
            out[name] = (progress, outer.cover.weight(progress, 0), fingerprint(outer.bufs.snapshot))
        except Exception:  # reported below
            out[name] = traceback.format_exc()
        finally:
            outer.close("completed")

    in_threads(run, "ab")
    assert all(isinstance(v, tuple) for v in out.values()) and len(out) == 2, out
    assert out["a"][0] == out["b"][0] == Progress(step=7, outer_step=6, tokens=7000), out
    assert out["b"][1] == 1000 and out["a"][2] == out["b"][2], out  # its step since the hand-off; the agreed weights


def test_a_run_resumed_at_its_last_boundary_before_it_committed_syncs_every_fragment():
    """A stop in the wait of the run's last outer step saves its checkpoint there, uncommitted. The resume sends that
    step's fragment at start; defect: the run then ended, every other fragment never synced since its own last
    boundary and the synced one mixed by fragment_alpha, so the nodes ended on different weights."""
    saved_inner = TinyInner(0)
    saved = make_outer(saved_inner, FakeMesh([], []), inner_steps=4, fragments=2, fragment_alpha=0.5)
    saved.start(Progress())  # the run's snapshot, as the checkpoint holds it
    saved_inner.train_step(1)
    state = saved.state_dict()
    inner = TinyInner(0)
    inner.model.load_state_dict(saved_inner.model.state_dict())
    events: list = []
    plans = [make_plan(1, k, 0, ["a"], source="a") for k in (2, 3)]
    outer = make_outer(inner, FakeMesh(plans, [True, True]), inner_steps=4, fragments=2, fragment_alpha=0.5,
                       events=events)
    outer.load_state_dict(state)
    progress = Progress(step=4, outer_step=1, tokens=400)  # step 4 is the last; outer step 2 did not commit
    outer.start(progress)
    assert outer.finished(progress, 4)
    assert [(e["outer_step"], e["fragment"]) for e in events if e["type"] == "outer_step"] == [(2, 1), (3, 0)]
    assert torch.equal(_flat(inner), outer.bufs.snapshot)  # every fragment on the agreed weights
