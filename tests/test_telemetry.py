"""Telemetry schema: events round-trip through the JSON-lines encoding; malformed lines are rejected."""

from __future__ import annotations

import io
import json

import pytest

from engine.telemetry import SCHEMA_VERSION, BadEvent, Telemetry, encode, format_human, make_event, parse_line


def test_round_trip_every_engine_event():
    samples = {
        "run_start": dict(pid=1, host="h", world_size=2, config_digest="abc", strategy="ddp", max_steps=10),
        "state": dict(state="training"),
        "step": dict(step=3, loss=2.5, lr=1e-3, tokens_per_s=1000.0, grad_norm=None),
        "eval": dict(step=3, loss=2.4),
        "checkpoint": dict(step=3, path="/x", seconds=0.1),
        "export": dict(step=3, path="/y"),
        "resource": dict(device="cpu", util=12.5, mem_used=1, mem_total=2),
        "warning": dict(message="w"), "error": dict(message="e"),
        "drained": dict(outer_step=0, step=3),
        "run_end": dict(status="completed", step=3),
    }
    for type_, fields in samples.items():
        event = make_event(type_, "node-a", 0, ts=1.0, **fields, extra_field=[1, 2])
        assert parse_line(encode(event)) == event


def test_emitter_writes_json_and_human_lines():
    out, human = io.StringIO(), io.StringIO()
    tele = Telemetry("n", 1, json_out=out, human_out=human)
    tele.emit("step", step=5, loss=1.25, lr=1e-3, tokens_per_s=10.0, grad_norm=0.5)
    event = parse_line(out.getvalue().splitlines()[0])
    assert event["v"] == SCHEMA_VERSION and event["node"] == "n" and event["rank"] == 1 and event["loss"] == 1.25
    assert "step      5 loss 1.2500" in human.getvalue()
    silent = io.StringIO()
    Telemetry("n", 1, json_out=silent, enabled=False).emit("state", state="left")
    assert silent.getvalue() == ""


def test_an_outer_step_without_the_optional_seconds_still_has_a_line():
    """compute_s, wire_s, codec_s and outer_s are optional (an older engine's run, read by a console attached to it):
    the line of such an event raised KeyError when the console's log pane formatted it, and ended the app."""
    base = dict(outer_step=7, step=70, generation=2, members=["a", "b"], pgrad_norm=0.5, bytes_sent=10,
                allreduce_s=1.25, checksum="c0ffee")
    old = format_human(make_event("outer_step", "a", 0, ts=1.0, **base))
    assert old == "[a:0] outer    7 gen 2 members 2 pgrad 0.5000 allreduce 1.25s sum c0ffee"
    new = format_human(make_event("outer_step", "a", 0, ts=1.0, **base, compute_s=9.0, outer_s=1.5, wire_s=1.0,
                                  codec_s=0.25))
    assert new == ("[a:0] outer    7 gen 2 members 2 pgrad 0.5000 compute 9.00s outer 1.50s (wire 1.00s codec 0.25s)"
                   " sum c0ffee")
    between = format_human(make_event("outer_step", "a", 0, ts=1.0, **base, compute_s=9.0, outer_s=1.5))
    assert between == ("[a:0] outer    7 gen 2 members 2 pgrad 0.5000 compute 9.00s outer 1.50s (allreduce 1.25s)"
                       " sum c0ffee")


@pytest.mark.parametrize("line, reason", [
    ("not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"type": "step"}', "schema version"),
    ('{"v": 99, "type": "step"}', "newer"),
    ('{"v": 1, "type": "nope", "ts": 1, "node": "n", "rank": 0}', "unknown event type"),
    ('{"v": 1, "type": "eval", "ts": 1, "node": "n", "rank": 0, "step": 1}', "missing field 'loss'"),
    ('{"v": 1, "type": "eval", "ts": 1, "node": "n", "rank": 0, "step": "1", "loss": 2}', "field 'step'"),
    ('{"v": 1, "type": "eval", "ts": 1, "node": "n", "rank": 0, "step": true, "loss": 2}', "field 'step'"),
    ('{"v": 1, "type": "eval", "ts": "x", "node": "n", "rank": 0, "step": 1, "loss": 2}', "common fields"),
])
def test_malformed_lines_are_rejected(line, reason):
    with pytest.raises(BadEvent, match=reason):
        parse_line(line)


def test_make_event_refuses_a_bad_producer_value():
    with pytest.raises(BadEvent):
        make_event("run_end", "n", 0, status="completed", step=1.5)
    assert json.loads(encode(make_event("run_end", "n", 0, status="completed", step=1)))["step"] == 1


def test_resource_monitor_emits_valid_cpu_samples_and_stops():
    import time

    from engine.resources import ResourceMonitor
    events = []
    monitor = ResourceMonitor(lambda **f: events.append(make_event("resource", "n", 0, **f)), 0.05, gpu_indices=[])
    assert monitor.kind == "cpu"  # no GPU asked for: psutil, never NVML
    monitor.start()
    deadline = time.monotonic() + 10
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    monitor.stop()
    assert len(events) >= 2 and not monitor._thread.is_alive()
    e = events[0]
    assert e["device"] == "cpu" and 0 <= e["util"] <= 100 and 0 < e["mem_used"] < e["mem_total"]
    count = len(events)
    time.sleep(0.2)
    assert len(events) == count  # nothing after stop()


def test_the_first_resource_sample_comes_at_once_whatever_the_interval():
    """A node that has just joined shows its figures at once: the first sample comes FIRST_SAMPLE_S after the
    start, not one (minutes-long) interval later."""
    import time

    from engine.resources import FIRST_SAMPLE_S, ResourceMonitor
    events = []
    monitor = ResourceMonitor(lambda **f: events.append(time.monotonic()), 60, gpu_indices=[]).start()
    started = time.monotonic()
    try:
        while not events and time.monotonic() < started + 10:
            time.sleep(0.02)
    finally:
        monitor.stop()
    assert len(events) == 1 and events[0] - started < FIRST_SAMPLE_S + 1.0


def test_gpus_without_nvml_fall_back_to_cpu_and_say_why():
    """Asking for GPU 0 where NVML cannot load (no driver here; on a GPU host, a real sample) never breaks the
    sampler: it reports CPU figures and gives the reason the engine emits as a warning."""
    import torch

    from engine.resources import ResourceMonitor
    monitor = ResourceMonitor(lambda **f: None, 60, gpu_indices=[0])
    try:
        if torch.cuda.is_available():
            assert monitor.kind == "gpu" and monitor.fallback_reason is None
            sample = monitor.sampler.samples()[0]
            assert sample["device"] == "gpu" and sample["mem_total"] > 0 and "temp_c" in sample
        else:
            assert monitor.kind == "cpu" and monitor.fallback_reason.startswith("NVML unavailable")
            assert monitor.sampler.samples()[0]["device"] == "cpu"
    finally:
        monitor.stop()


def test_nvml_follows_cuda_visible_devices():
    """cuda:i is the i-th GPU CUDA_VISIBLE_DEVICES lists; NVML numbers GPUs physically, so sample that one."""
    from engine.resources import nvml_ids
    from engine.world import read_world

    assert read_world({}).visible_gpus is None
    world = read_world({"CUDA_VISIBLE_DEVICES": "4,5, 6,7"})
    assert world.visible_gpus == ("4", "5", "6", "7")
    assert nvml_ids([0, 1], world.visible_gpus) == ["4", "5"]
    assert nvml_ids([0, 1], None) == ["0", "1"]
    uuid = "GPU-8c2a1f0e-0000-4000-8000-000000000001"
    assert nvml_ids([0], (uuid,)) == [uuid]


def test_the_facts_only_some_events_carry_are_typed_too():
    """run_start's run and diloco, state's facts, step's tokens and epoch, a GPU's index: documented fields that no
    schema checked, so a producer could send any type and the console's reader took it."""
    start = dict(pid=1, host="h", world_size=2, config_digest="abc", strategy="ddp", max_steps=10)
    make_event("run_start", "n", 0, **start, run="r", diloco=True, dataset=None)  # a bool where a bool belongs
    make_event("resource", "n", 0, device="gpu", util=1.0, mem_used=1, mem_total=2, index="GPU-5d1c", temp_c=40)
    for type_, fields, bad in [("run_start", start, {"diloco": "yes"}), ("step", dict(step=3, loss=2.5, lr=1e-3,
                               tokens_per_s=1.0, grad_norm=None), {"tokens": True}),
                               ("state", dict(state="training"), {"params": 1.5}),
                               ("heartbeat", dict(seq=1, peers={}), {"rtt_ms": "1"})]:
        with pytest.raises(BadEvent, match=f"field '{next(iter(bad))}'"):
            make_event(type_, "n", 0, **fields, **bad)


def test_a_membership_line_counts_the_members_the_change_leaves():
    """Defect: a node that finished the run said `membership left node-0 -> 3 members` while two stayed (the plan's
    members hold a leaving node for its last round); a death already counted the members that stay."""
    from console.nodes import MembershipEvent
    from console.widgets.panes import timeline_line

    plan = ["node-0", "node-1", "node-2"]
    cases = [("left", "node-0", plan, 2), ("drained", "node-1", plan, 2), ("dead", "node-2", plan[:2], 2),
             ("joined", "node-3", plan + ["node-3"], 4)]
    for change, subject, members, after in cases:
        event = make_event("membership", "node-0", 0, ts=1.0, change=change, subject=subject, generation=3,
                           members=members)
        assert format_human(event).endswith(f"membership {change} {subject} -> {after} members")
        entry = MembershipEvent(1.0, change, subject, 3, tuple(members), "node-0")
        assert timeline_line(entry).endswith(f"{subject} {change} gen 3 -> {after} members")
