"""A resumed DiLoCo node continues the uninterrupted one, outer momentum included.

Every end-to-end resume test ran configs/debug-diloco.toml, whose outer momentum is 0, so an outer state saved
without its momentum (or loaded without it) resumed just as well there. Here one node (the mesh scripted, as in
test_diloco_math.py) runs with momentum on, is checkpointed mid-round, and a new node built from that state (other
initial weights, through torch.save / torch.load as engine/checkpoint.py does) must commit the same outer steps,
bit for bit: the same parameters, the same momentum and the same checksum.
"""

from __future__ import annotations

import io

import pytest
import torch

from engine.outer import Progress
from test_diloco_math import FakeMesh, TinyInner, make_outer, make_plan

H, ROUNDS, CUT = 2, 3, 3  # 3 outer steps of 2 inner steps; the checkpoint after inner step 3 (mid-round 2)


def flat_params(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


def _outer(inner, first_round: int, kind: str, fragments: int):
    plans = [make_plan(1, k, 0, ["a"], source="a") for k in range(first_round, ROUNDS * fragments + 1)]
    mesh = FakeMesh(plans, [True] * len(plans))
    events: list[dict] = []
    outer = make_outer(inner, mesh, events=events, inner_steps=H, outer_optimizer=kind, outer_lr=0.7,
                       outer_momentum=0.9, fragments=fragments, fragment_alpha=0.5 if fragments > 1 else 0.0)
    return outer, events


def _train(outer, inner, progress: Progress, steps) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Inner steps, each followed by the outer loop's hook: {outer step: (parameters, momentum) after it}."""
    after = {}
    for step in steps:
        inner.train_step(step)
        progress.step, progress.tokens = step, 64 * step
        before = progress.outer_step
        outer.after_inner_step(progress)
        if progress.outer_step != before:
            after[progress.outer_step] = (flat_params(inner.outer_params()), outer.opt.state_dict()["momentum"].clone())
    return after


def _checkpoint(obj):
    """Through bytes, as the checkpoint's rank file: nothing may survive by reference."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False, map_location="cpu")


@pytest.mark.parametrize("kind,fragments", [("nesterov", 1), ("sgd", 1), ("nesterov", 2)])
def test_resume_restores_the_outer_momentum_and_continues_the_uninterrupted_run(kind, fragments):
    """With diloco.fragments = 2 an outer step follows every inner step, each on half of the model: the resumed
    node must also know which half is next and what each half trained since its last sync."""
    full_inner = TinyInner(0)
    full, full_events = _outer(full_inner, 1, kind, fragments)
    full.start(Progress())
    want = _train(full, full_inner, Progress(), range(1, H * ROUNDS + 1))

    first_inner = TinyInner(0)
    first, _ = _outer(first_inner, 1, kind, fragments)
    progress = Progress()
    first.start(progress)
    _train(first, first_inner, progress, range(1, CUT + 1))
    assert progress.outer_step == CUT * fragments // H and first.opt.state_dict()["momentum"] is not None
    assert first.opt.state_dict()["momentum"].abs().sum() > 0
    saved = _checkpoint({"model": first_inner.model.state_dict(), "optim": first_inner.opt.state_dict(),
                         "progress": progress.state_dict(), "outer": first.state_dict()})

    inner = TinyInner(99)  # other initial weights: everything must come from the checkpoint
    inner.model.load_state_dict(saved["model"])
    inner.opt.load_state_dict(saved["optim"])
    resumed, events = _outer(inner, progress.outer_step + 1, kind, fragments)
    resumed_progress = Progress()
    resumed_progress.load_state_dict(saved["progress"])
    resumed.load_state_dict(saved["outer"])
    assert resumed.opt.state_dict()["momentum"] is not None, "the outer momentum was not restored"
    assert torch.equal(resumed.opt.state_dict()["momentum"], first.opt.state_dict()["momentum"])
    # what each fragment trained since its last sync (its weight in the next mean of it)
    assert resumed.state_dict().get("fragment_tokens0") == first.state_dict().get("fragment_tokens0")
    resumed.start(resumed_progress)
    got = _train(resumed, inner, resumed_progress, range(CUT + 1, H * ROUNDS + 1))

    assert sorted(got) == list(range(progress.outer_step + 1, ROUNDS * fragments + 1))
    for k, (params, momentum) in got.items():
        assert torch.equal(params, want[k][0]), f"outer step {k}: parameters differ from the uninterrupted run's"
        assert torch.equal(momentum, want[k][1]), f"outer step {k}: momentum differs from the uninterrupted run's"
    sums = {e["outer_step"]: e["checksum"] for e in events if e["type"] == "outer_step"}
    full_sums = {e["outer_step"]: e["checksum"] for e in full_events if e["type"] == "outer_step"}
    assert sums == {k: full_sums[k] for k in got}


def test_a_fragments_checkpoint_resumed_with_time_rounds_is_refused():
    """A fragments run counts an outer step per fragment; time rounds read outer_step as rounds, so the resumed run
    was P times further into its length and LR schedule (stopped at step 500 of 1000 with P = 4: finished at once)."""
    fragmented = make_outer(TinyInner(0), FakeMesh([], []), inner_steps=4, fragments=2)
    timed = make_outer(TinyInner(0), FakeMesh([], []), inner_steps=4, round="time", round_seconds=5)
    with pytest.raises(ValueError, match=r"synced the model in 2 fragments, so its outer steps count fragments, not "
                                         r"rounds: .* resume it with diloco.round = \"steps\"$"):
        timed.load_state_dict(fragmented.state_dict())
    make_outer(TinyInner(0), FakeMesh([], []), inner_steps=4).load_state_dict(fragmented.state_dict())  # steps: fine
