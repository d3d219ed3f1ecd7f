"""Rounds by steps or by time, and the mean weighted by each node's tokens (engine/outer/rounds.py)."""

from __future__ import annotations

import datetime
import pickle
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

from engine.config import DilocoConfig
from engine.outer import Progress
from engine.outer.rounds import RoundClock
from engine.outer.schedule import Schedule
from procs import spawned_ranks
from test_diloco_math import FakeMesh, TinyInner, _group, make_outer, make_plan


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def timed(seconds: float = 10.0, h: int = 4, clock: Clock | None = None) -> RoundClock:
    return Schedule(DilocoConfig(enabled=True, inner_steps=h, round="time", round_seconds=seconds)).round_clock(
        clock or Clock())


def test_step_rounds_end_every_h_steps_and_weigh_their_tokens():
    rounds = Schedule(DilocoConfig(enabled=True, inner_steps=3)).round_clock()
    p = Progress()
    rounds.resume(p)
    ends = []
    for step in range(1, 10):
        p.step, p.tokens = step, step * 64
        if rounds.due(p):
            ends.append((step, rounds.close(p)))
            rounds.begin(p)
    assert ends == [(3, 192), (6, 192), (9, 192)]
    assert not rounds.finished(Progress(step=8), 9) and rounds.finished(Progress(step=9), 9)
    assert rounds.step_for_schedule(p) is None  # the schedule follows the node's own steps


def test_time_rounds_end_at_the_plans_deadline_whatever_the_speed():
    clock = Clock()
    fast, slow = timed(clock=clock), timed(clock=clock)
    plan = SimpleNamespace(deadline=clock.t + 10.0)
    pf, ps = Progress(), Progress()
    for r, p in ((fast, pf), (slow, ps)):
        r.resume(p)
        r.begin(p, plan)
    steps = {"fast": 0, "slow": 0}
    while clock.t < 1020:
        clock.t += 0.5
        for name, r, p, every in (("fast", fast, pf, 1), ("slow", slow, ps, 2)):
            if int(clock.t * 2) % every:
                continue  # the slow node finishes a step every other tick
            p.step += 1
            p.tokens += 100
            if r.due(p):
                steps[name] = (p.step, r.close(p), clock.t)
                r.begin(p)  # no plan: the next deadline is chained
        if steps["fast"] and steps["slow"]:
            break
    (_, ftok, ft), (_, stok, st) = steps["fast"], steps["slow"]
    assert ft == st == 1010.0  # both end their round at the deadline, on the same tick
    assert ftok == 2 * stok == 2000  # ... having trained what their speed allowed: the fast one twice the tokens
    assert fast.deadline == slow.deadline == 1020.0  # chained: one round later


def test_a_node_ends_its_round_at_the_agreed_deadline_not_at_one_it_chains_itself():
    """The plan's deadline is the planner's (its clock when it wrote the plan, plus a round): every member ends
    there, whatever it would have chained itself (its last deadline plus a round). The test above gives the plan
    the deadline the node computes anyway; here the agreed one is 4 s earlier, then 7 s later, than the node's."""
    for agreed_in in (6.0, 17.0):
        clock = Clock()
        r = timed(seconds=10.0, clock=clock)
        p = Progress()
        r.resume(p)
        r.begin(p)  # before the first plan: its own chain, now + a round
        assert r.deadline == 1010.0
        clock.t = 1010.5  # the boundary's plan came half a second after that deadline
        r.begin(p, SimpleNamespace(deadline=clock.t - 0.5 + agreed_in))  # the node alone would chain 1020
        assert r.deadline == 1010.0 + agreed_in
        r.due(p)  # the round's first step starts now; steps of 0.25 s
        ended = None
        while ended is None and clock.t < 1040:
            clock.t += 0.25
            p.step += 1
            if r.due(p):
                ended = clock.t
        assert ended == 1010.0 + agreed_in, (agreed_in, ended)


def test_the_outer_loop_ends_each_round_at_its_plans_deadline():
    """Through DilocoOuter: the deadline a committed plan carries is the next round's end, not the node's own chain
    (its last deadline plus a round): the plans say 3 s later (1023, not 1020), then 2.5 s earlier (1030.5, not
    1033)."""
    from dataclasses import replace
    clock = Clock()
    plans = [replace(make_plan(1, 1, 0, ["a"], source="a"), deadline=1023.0),
             replace(make_plan(1, 2, 0, ["a"], source="a"), deadline=1030.5),
             replace(make_plan(1, 3, 0, ["a"], source="a"), deadline=1040.5)]
    inner = TinyInner(0)
    outer = make_outer(inner, FakeMesh(plans, [True] * 3), inner_steps=4, round="time", round_seconds=10.0,
                       clock=clock)
    p = Progress()
    outer.start(p)
    ends = []
    while len(ends) < 3 and clock.t < 1060:
        clock.t += 0.5
        inner.train_step(p.step)
        p.step, p.tokens = p.step + 1, p.tokens + 64
        outer.after_inner_step(p)
        if p.outer_step > len(ends):
            ends.append(clock.t)
    assert ends == [1010.0, 1023.0, 1030.5], ends  # the first round, before any plan: the node's own chain
    assert outer.rounds.deadline == 1040.5


def test_a_late_begin_gets_a_fresh_round_not_a_deadline_already_gone():
    clock = Clock()
    r = timed(clock=clock)
    r.begin(Progress())
    clock.t += 35  # a long outer step (or a stall) past two deadlines
    r.begin(Progress())
    assert r.deadline == clock.t + 10


def test_time_rounds_measure_the_run_in_rounds_and_the_schedule_by_the_round_clock():
    clock = Clock()
    r = timed(seconds=10, h=4, clock=clock)
    r.begin(Progress(), SimpleNamespace(deadline=clock.t + 10))
    clock.t += 5  # halfway through round 3 (outer_step 2 committed)
    assert r.step_for_schedule(Progress(step=77, outer_step=2)) == 10  # 4 * (2 + 0.5), whatever its own steps
    assert not r.finished(Progress(step=500, outer_step=4), max_steps=20)  # 20 / 4 = 5 rounds
    assert r.finished(Progress(step=3, outer_step=5), max_steps=20)


def test_a_checkpoint_keeps_the_rounds_tokens_and_an_old_one_is_guessed_from_its_steps():
    r = Schedule(DilocoConfig(enabled=True, inner_steps=5)).round_clock()
    p = Progress(step=10, outer_step=2, tokens=1000)
    r.resume(p)
    r.begin(p)
    p.step, p.tokens = 13, 1350  # this round's steps held more tokens than the run's average
    saved = r.state_dict()
    again = Schedule(DilocoConfig(enabled=True, inner_steps=5)).round_clock()
    again.load_state_dict(saved)
    again.resume(p)
    assert again.close(p) == 350  # from the checkpointed round start; a guess from the steps says 312
    old = Schedule(DilocoConfig(enabled=True, inner_steps=5)).round_clock()  # a checkpoint without the key
    old.resume(p)
    assert old.close(p) == 312  # 3 steps since the last committed boundary, 1350 / 13 tokens each
    # saved at a boundary before it committed: that round's tokens are still known at the resume
    p.step, p.tokens = 15, 1500
    assert r.pending_at_resume(p) and r.close(p) == 500


def test_time_rounds_need_their_length():
    import pytest
    with pytest.raises(ValueError, match="round_seconds"):
        DilocoConfig(enabled=True, round="time")


# ------------------------------------------------------------------------ the weighted mean, on two real ranks

def _weighted_worker(rank: int, port: int, queue) -> None:
    """Nodes a and b start from the same weights; a trains 3 steps of 100 tokens, b 1 step: with sgd lr 1 and no
    momentum the outer step makes both (3 * a + 1 * b) / 4, the token-weighted mean of their models."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
        node = "ab"[rank]
        inner = TinyInner(0)
        plan = make_plan(1, 1, 0, ["a", "b"], source="a")
        events: list[dict] = []
        outer = make_outer(inner, FakeMesh([plan], [True]), node=node, events=events, inner_steps=1,
                           outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0,
                           group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, "tok/"))
        progress = Progress(step=0, outer_step=0, tokens=0)
        outer.start(progress)
        for i in range(3 if node == "a" else 1):
            inner.train_step(10 * rank + i)
        local = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        progress.step, progress.tokens = 1, 300 if node == "a" else 100
        outer.after_inner_step(progress)
        after = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        step = [e for e in events if e["type"] == "outer_step"][0]
        queue.put((rank, pickle.dumps({"local": local, "after": after, "weights": step["weights"]})))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


def test_the_mean_weighs_each_node_by_the_tokens_of_its_round():
    got = spawned_ranks(_weighted_worker, 2, timeout=60)
    expected = (3 * got[0]["local"] + 1 * got[1]["local"]) / 4
    for rank in (0, 1):
        assert got[rank]["weights"] == [300.0, 100.0]
        torch.testing.assert_close(got[rank]["after"], expected, rtol=0, atol=1e-6)
    assert torch.equal(got[0]["after"], got[1]["after"])  # identical on every member


def test_a_slow_node_does_not_start_a_step_that_would_end_well_past_the_deadline():
    """Steps of 3 s against a deadline 10 s away: the round ends after the step ending at 9 s (the next would end
    at 12 s, two seconds late), not after the one that ends late at 12 s."""
    clock = Clock()
    r = timed(seconds=10.0, clock=clock)
    r.begin(Progress(), SimpleNamespace(deadline=clock.t + 10.0))
    p, ended = Progress(), None
    r.due(p)  # the round's first step starts now
    for step in range(1, 6):
        clock.t += 3.0
        p.step = step
        if r.due(p):
            ended = clock.t - 1000.0
            break
    assert ended == 9.0


def test_a_round_ends_before_a_step_that_would_end_more_than_half_a_step_late_and_not_before_one_that_would_not():
    """Both sides of the half-step rule: steps of 3 s, the next one ending at 12 s. With the deadline at 10.4 s it
    would end 1.6 s late (over half a step): the round ends at 9 s. At 10.6 s it would end 1.4 s late (under half
    a step): the node takes it and ends at 12 s, nearer the deadline than at 9 s."""
    for deadline, expected in ((10.4, 9.0), (10.6, 12.0)):
        clock = Clock()
        r = timed(seconds=10.0, clock=clock)
        r.begin(Progress(), SimpleNamespace(deadline=clock.t + deadline))
        p, ended = Progress(), None
        r.due(p)
        for step in range(1, 6):
            clock.t += 3.0
            p.step = step
            if r.due(p):
                ended = clock.t - 1000.0
                break
        assert ended == expected, (deadline, ended)


def test_the_straggler_grace_is_the_setting_or_a_quarter_round():
    """diloco.straggler_grace = 0 (the default): a quarter of diloco.round_seconds."""
    timed_cfg = dict(enabled=True, round="time", round_seconds=10.0)
    assert DilocoConfig(**timed_cfg).grace == 2.5
    assert DilocoConfig(**timed_cfg, straggler_grace=0.5).grace == 0.5


def test_a_resume_under_another_max_steps_names_the_lr_where_the_round_clock_is(tmp_path):
    """With time rounds the LR follows the round clock (H per committed round), not the node's own steps: the
    warning of a stretched schedule gave the LR at the node's step (25), past both schedules' end (the same
    figure twice), while the run resumes at round 4, where the stretched cosine goes back up."""
    from engine.config import load_config
    from engine.session import schedule_note
    path = tmp_path / "c.toml"
    path.write_text("[data]\nfake = true\n[diloco]\nenabled = true\ninner_steps = 3\nround = \"time\"\n"
                    "round_seconds = 2\n[optim]\nlr = 3e-3\nwarmup_steps = 0\n[train]\nmax_steps = 18\n")
    note = schedule_note(load_config(path), {"max_steps": 12, "step": 25, "progress": {"outer_step": 4}})
    assert "stretched to 18 steps (lr at round 4: 9.75e-04, was 3.00e-04)" in note, note
    steps = load_config(path, ["--diloco.round=steps"])  # step rounds: the node's own step
    assert "(lr at step 12: 9.75e-04, was 3.00e-04)" in schedule_note(steps, {"max_steps": 12, "step": 12})


def test_a_last_round_cut_short_is_said_and_the_run_does_not_end_agreed(tmp_path):
    """Step rounds average at multiples of H only: with max_steps not one, the last steps are never averaged and
    every node ends on its own weights (so nodes sharing an export folder must not take one another's for the
    run's). Time rounds end at a boundary; fragments sync every fragment at the last step."""
    from engine.config import load_config
    from engine.session import ends_agreed, unsynced_tail_note
    path = tmp_path / "c.toml"
    path.write_text("[data]\nfake = true\n[diloco]\nenabled = true\ninner_steps = 30\n[train]\nmax_steps = 100\n")
    cut = load_config(path)
    assert not ends_agreed(cut) and unsynced_tail_note(cut) == (
        "train.max_steps (100) is not a multiple of diloco.inner_steps (30): the last 10 steps are never averaged, "
        "and each node ends on its own weights (checkpoint, export)")
    for ok in (["--train.max_steps=90"], ["--diloco.round=time", "--diloco.round_seconds=5"],
               ["--diloco.fragments=3"]):
        assert ends_agreed(load_config(path, ok)) and unsynced_tail_note(load_config(path, ok)) is None, ok
    alone = load_config(path, ["--diloco.enabled=false"])
    assert not ends_agreed(alone) and unsynced_tail_note(alone) is None  # no DiLoCo: nothing to average


def test_the_schedule_says_when_a_sync_is_due_and_what_it_covers():
    """The one reader of inner_steps, fragments and round: an outer step every H / P steps, outer step k covering
    fragment (k - 1) % P; time rounds count the run in rounds of H steps; the run ends agreed where its last step
    is a boundary (time rounds, fragments) or H divides max_steps."""
    whole = Schedule(DilocoConfig(enabled=True, inner_steps=6))
    assert [s for s in range(1, 19) if whole.due_at(s)] == [6, 12, 18]
    assert [whole.fragment_of(k) for k in (1, 2, 3)] == [0, 0, 0]
    parts = Schedule(DilocoConfig(enabled=True, inner_steps=6, fragments=3))
    assert [s for s in range(1, 13) if parts.due_at(s)] == [2, 4, 6, 8, 10, 12]
    assert [parts.fragment_of(k) for k in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    assert parts.boundaries_before(7) == 3 and parts.step_of_boundary(3) == 6
    assert (whole.ends_agreed(18), whole.ends_agreed(17), whole.unsynced_tail(17)) == (True, False, 5)
    assert parts.ends_agreed(17) and parts.unsynced_tail(17) == 0  # every fragment is synced at the last step
    timed_ = Schedule(DilocoConfig(enabled=True, inner_steps=4, round="time", round_seconds=5))
    assert timed_.timed and timed_.ends_agreed(17) and timed_.rounds(17) == 5 and timed_.rounds(16) == 4
    assert timed_.lr_step(2.5) == 10
    off = Schedule(DilocoConfig(enabled=False, inner_steps=4))
    assert not off.ends_agreed(16) and off.unsynced_tail(17) == 0  # no DiLoCo: nothing to average
