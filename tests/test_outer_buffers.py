"""The outer step's buffers: the fingerprint checksum, the flat views over the parameters, in-place updates
that reuse the same memory every outer step, and an abort that changes nothing (engine/outer/buffers.py)."""

from __future__ import annotations

import pytest
import torch

from engine.outer.buffers import SAMPLE, OuterBuffers, fingerprint
from test_diloco_math import FakeMesh, TinyInner, make_outer, make_plan


def test_fingerprint_sees_every_element_and_only_the_values():
    x = torch.randn(3 * SAMPLE + 7, generator=torch.Generator().manual_seed(0))
    base = fingerprint(x)
    assert fingerprint(x.clone()) == base and len(base) == 12
    stride = x.numel() // SAMPLE
    for i in (1, stride + 1, x.numel() - 2, x.numel() - 1):  # off the strided sample, and the odd last element
        y = x.clone()
        y[i] = torch.nextafter(y[i], torch.tensor(float("inf")))  # one ulp
        assert fingerprint(y) != base, f"element {i}"
    y = x.clone()
    y[0], y[stride] = x[stride], x[0]  # same multiset of values, other positions: the sample sees it
    assert fingerprint(y) != base
    assert fingerprint(x[:-1].clone()) != fingerprint(x[1:].clone())


def test_fingerprint_independent_of_threads():
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint(x)
        torch.set_num_threads(2)
        assert fingerprint(x) == one
    finally:
        torch.set_num_threads(before)


def test_buffers_map_parameters_of_any_dtype():
    params = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.randn(2, 2, 2)]
    bufs = OuterBuffers(params)
    bufs.capture(params)
    want = torch.cat([p.float().reshape(-1) for p in params])
    assert torch.equal(bufs.snapshot, want)
    moved = [p + 1 for p in params]
    for p, m in zip(params, moved):
        p.copy_(m)
    torch.testing.assert_close(bufs.pseudo_gradient(params), torch.full_like(want, -1.0), rtol=0, atol=2e-2)
    bufs.write_back(params)  # back to the snapshot, each in its own dtype
    assert params[1].dtype == torch.bfloat16
    assert torch.equal(torch.cat([p.float().reshape(-1) for p in params]), want)


def _state(outer, inner):
    return (outer.bufs.snapshot.clone(), outer.opt.state_dict()["momentum"].clone(),
            [p.clone() for p in inner.outer_params()])


def test_outer_steps_reuse_their_memory_and_an_abort_changes_nothing():
    inner = TinyInner(3)
    plans = [make_plan(1, 1, 0, ["a"], source="a"), make_plan(1, 2, 0, ["a"], source="a"),
             make_plan(2, 2, 1, ["a"], source="a"), make_plan(2, 3, 0, ["a"], source="a")]
    mesh = FakeMesh(plans, [True, False, True, True])
    events: list[dict] = []
    outer = make_outer(inner, mesh, events=events, inner_steps=1, outer_lr=0.7, outer_momentum=0.9)
    from engine.outer import Progress
    progress = Progress()
    outer.start(progress)
    ptrs = None
    for step in (1, 2, 3):
        inner.train_step(step)
        progress.step = step
        if step == 2:
            # the abort of attempt 0 must leave snapshot, momentum and parameters exactly as they were
            before = _state(outer, inner)
            real_commit = mesh.commit

            def spy(plan, ok):
                decision = real_commit(plan, ok)
                if not decision:
                    after = _state(outer, inner)
                    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
                    assert all(torch.equal(a, b) for a, b in zip(before[2], after[2]))
                return decision
            mesh.commit = spy
        outer.after_inner_step(progress)
        now = (outer.bufs.snapshot.data_ptr(), outer.bufs.pgrad.data_ptr(), outer.bufs.mean.data_ptr(),
               outer.opt.state_dict()["momentum"].data_ptr())
        assert ptrs is None or now == ptrs, "an outer step allocated new state buffers"
        ptrs = now
    assert progress.outer_step == 3 and inner.updates == 3
    steps = [e for e in events if e["type"] == "outer_step"]
    assert len(steps) == 3
    for e in steps:
        assert e["allreduce_s"] == e["wire_s"] + e["codec_s"]
        assert e["outer_s"] >= e["allreduce_s"] and e["compute_s"] >= 0
    assert steps[-1]["checksum"] == fingerprint(outer.bufs.snapshot)
    # the parameters equal the snapshot after a committed step
    flat = torch.cat([p.reshape(-1) for p in inner.outer_params()])
    assert torch.equal(flat, outer.bufs.snapshot)


# ------------------------------------------------------------------------------------------ overlap

def _overlap_vs_plain(decisions: list[bool], steps: int = 6):
    """H=1, sgd lr 1 without momentum, one node: every outer step hands back exactly the node's own progress, so
    the overlapped outer loop (applied one round late, rebased on the boundary) must equal plain training."""
    from engine.outer import Progress
    plain, inner = TinyInner(0), TinyInner(0)
    plans, k, attempt = [], 1, 0
    for ok in decisions:
        plans.append(make_plan(1 + len(plans), k, attempt, ["a"], source="a"))
        k, attempt = (k + 1, 0) if ok else (k, attempt + 1)
    mesh = FakeMesh(plans, decisions)
    events: list[dict] = []
    outer = make_outer(inner, mesh, events=events, inner_steps=1, outer_optimizer="sgd", outer_lr=1.0,
                       outer_momentum=0.0, overlap=True)
    progress = Progress()
    outer.start(progress)
    for step in range(1, steps + 1):
        plain.train_step(step)
        inner.train_step(step)
        progress.step = step
        assert outer.after_inner_step(progress) is False
    outer.flush()
    for p, q in zip(plain.model.parameters(), inner.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    return outer, progress, events


def test_overlap_h1_lr1_equals_plain_training_one_round_late():
    outer, progress, events = _overlap_vs_plain([True] * 6)
    assert progress.outer_step == 6 and progress.step == 6
    assert [e["outer_step"] for e in events if e["type"] == "outer_step"] == [1, 2, 3, 4, 5, 6]
    assert not outer.flight.busy
    outer.state_dict()  # allowed once flushed


def test_overlap_abort_in_flight_retries_the_same_pseudo_gradient():
    outer, progress, events = _overlap_vs_plain([True, False, True, True, True, True, True])
    assert progress.outer_step == 6
    assert sum("aborted" in e.get("message", "") for e in events if e["type"] == "warning") == 1


# ------------------------------------------------------------------------------------------ CUDA (GPU only)

_no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path is tested above)")


@pytest.mark.gpu
@_no_gpu
def test_gpu_fingerprint_and_codec_bytes_equal_the_cpu_ones():
    """A CPU node and a GPU node must report the same checksum and put the same bytes on the wire."""
    from engine.outer import allreduce as compression
    x = torch.randn(5, 1001, generator=torch.Generator().manual_seed(2))
    assert fingerprint(x.reshape(-1)) == fingerprint(x.reshape(-1).cuda())
    for name in ("bf16", "fp16", "int8"):
        width = 1001 * compression.bytes_per_element(name) + (8 if name == "int8" else 0)
        cpu = torch.empty(5, width, dtype=torch.uint8)
        gpu = cpu.cuda()
        compression.encode_into(cpu, x.clone(), name)
        compression.encode_into(gpu, x.cuda(), name)
        assert torch.equal(cpu, gpu.cpu()), name


@pytest.mark.gpu
@_no_gpu
def test_gpu_buffers_live_beside_the_parameters():
    params = [torch.randn(4, 4, device="cuda"), torch.randn(3, device="cuda")]
    bufs = OuterBuffers(params)
    assert bufs.snapshot.device.type == bufs.pgrad.device.type == bufs.mean.device.type == "cuda"
    bufs.capture(params)
    params[0].add_(1.0)
    assert float(bufs.pseudo_gradient(params)[:16].sum()) == pytest.approx(-16.0)


def test_finite_finds_one_nan_or_inf_anywhere_in_one_pass():
    from engine.outer.buffers import finite

    x = torch.randn(100_003)
    assert finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[77_777] = bad
        assert not finite(y), bad
    assert not finite(torch.full((4,), 3e19))  # squares past fp32: a round that far gone counts as diverged


def test_the_pseudo_gradients_norm_is_taken_once_and_forgotten_on_any_write(monkeypatch):
    """The finiteness check and the sentinel's row read one norm pass; a write through any view of the buffer, or
    another tensor, is never answered from it."""
    from engine.outer import buffers

    calls = []
    real = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda t, *a, **k: calls.append(1) or real(t, *a, **k))
    params = [torch.randn(6, 5), torch.randn(7)]
    bufs = OuterBuffers(params)
    bufs.capture(params)
    params[0].add_(0.5)
    pgrad = bufs.pseudo_gradient(params)
    assert buffers.finite(pgrad) and buffers.norm(pgrad) == pytest.approx(0.5 * 30 ** 0.5, rel=1e-6)
    assert len(calls) == 1  # the second read came from the first pass
    bufs.views(bufs.pgrad)[1][3] = float("nan")  # a write through a view of the storage
    assert not buffers.finite(pgrad) and len(calls) == 2
    other = pgrad.clone()
    assert buffers.norm(other) != buffers.norm(other) and len(calls) == 3  # another tensor: its own pass (NaN)


@pytest.mark.gpu
@_no_gpu
@pytest.mark.parametrize("name", ["none", "int8"])
def test_gpu_mean_equals_the_cpu_mean_and_takes_its_wire_buffers_from_prepare(name):
    """Two ranks (threads over gloo) take the weighted mean of the same inputs on the GPU and on the CPU: the
    bytes agree (the products and the division on the device round as on the host). Prepared beforehand
    (DilocoOuter.start), the GPU's mean takes every pinned host buffer it uses from the prepared ones."""
    import threading

    import torch.distributed as dist

    from engine.outer import allreduce
    from test_diloco_math import _group

    store, numel, results, errors = dist.HashStore(), 100_003, {}, []

    def rank(r):
        try:
            _rank(r)
        except BaseException as e:  # noqa: BLE001 - raised below, on the test's thread
            errors.append(e)

    def _rank(r):
        pg = _group(store, r, 2, f"gpu-{name}")
        x = torch.randn(numel, generator=torch.Generator().manual_seed(7 + r)) * (r + 1)
        cpu, _ = allreduce.weighted_mean(x, 1.0 + r, pg, name)
        ex = allreduce.Exchange("cuda")
        ex.prepare(numel, 2, name)
        prepared = {k: (t.data_ptr(), t.is_pinned()) for k, t in ex._bufs.items()}
        out = torch.empty(numel, device="cuda")
        gpu, _ = allreduce.weighted_mean(x.cuda(), 1.0 + r, pg, name, out=out, exchange=ex)
        used = {k: t.data_ptr() for k, t in ex._bufs.items() if k.endswith("@host")}
        results[r] = (cpu, gpu.cpu(), prepared, used)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert sorted(results) == [0, 1]
    for cpu, gpu, prepared, used in results.values():
        assert torch.equal(cpu, gpu)
        assert used and all(prepared[k] == (ptr, True) for k, ptr in used.items()), (prepared, used)


@pytest.mark.gpu
@_no_gpu
def test_the_means_helper_thread_runs_on_the_callers_cuda_stream():
    """An overlapped outer step's kernels run on a side stream; its mean's helper thread (groups.run_sliced) ran on
    its own default stream, unordered after the side stream's writes of the pseudo-gradient."""
    from engine.outer.groups import run_sliced

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        seen = run_sliced(torch.cuda.current_stream, "stream-test", 0.05, lambda: None)
    assert seen == side and seen != torch.cuda.default_stream()
