"""DiLoCo numerics: outer-optimizer arithmetic by hand, the compressed weighted mean over real gloo groups
(3 spawned processes), rollback of an aborted outer step, the joiner hand-off, and H=1/lr=1/momentum=0 equal
to plain training. The mesh is replaced by scripted fakes here; tests/test_diloco_e2e.py uses the real one."""

from __future__ import annotations

import datetime
import json
import pickle
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine.outer import allreduce as compression
from engine.outer import handoff
from procs import spawned_ranks
from engine.config import DilocoConfig, MeshConfig
from engine.outer.diloco import DilocoOuter
from engine.outer.local import LocalRanks
from engine.outer.optimizer import Stateless, build_outer_optimizer, flat_params
from engine.mesh.protocol import Plan
from engine.outer import Progress
from engine.telemetry import Telemetry

SIZE = 3
NUMEL = 10_007  # not a multiple of the group size: exercises the padding


# ------------------------------------------------------------------------------------------ pure arithmetic

def test_nesterov_two_steps_match_hand_computation():
    opt = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    s = torch.tensor([1.0, 2.0])
    g1 = torch.tensor([0.1, -0.2])
    p1 = opt.propose(s, g1)
    # step 1: buf = g1; update = g1 + 0.9 * g1 = 1.9 g1; p = s - 0.7 * 1.9 * g1
    assert torch.allclose(p1.params, torch.tensor([1.0 - 0.133, 2.0 + 0.266]), atol=1e-6)
    opt.commit(p1)
    g2 = torch.tensor([0.3, 0.0])
    p2 = opt.propose(p1.params, g2)
    # step 2: buf = 0.9 * g1 + g2 = [0.39, -0.18]; update = g2 + 0.9 * buf = [0.651, -0.162]
    assert torch.allclose(p2.momentum, torch.tensor([0.39, -0.18]), atol=1e-6)
    assert torch.allclose(p2.params, p1.params - 0.7 * torch.tensor([0.651, -0.162]), atol=1e-6)


def test_sgd_momentum_and_average_by_hand():
    sgd = build_outer_optimizer("sgd", lr=0.5, momentum=0.5)
    s, g = torch.tensor([1.0]), torch.tensor([0.2])
    sgd.commit(sgd.propose(s, g))
    p = sgd.propose(s, g)  # buf = 0.5 * 0.2 + 0.2 = 0.3; p = 1 - 0.5 * 0.3
    assert torch.allclose(p.params, torch.tensor([0.85]))
    plain = build_outer_optimizer("sgd", lr=0.5, momentum=0.0)
    assert plain.propose(s, g).momentum is None and torch.allclose(plain.propose(s, g).params, torch.tensor([0.9]))
    avg = build_outer_optimizer("average", lr=0.7, momentum=0.9)  # lr and momentum are ignored: p = s - g
    assert torch.allclose(avg.propose(s, g).params, torch.tensor([0.8]))


def test_a_reserved_momentum_is_the_memory_the_first_step_writes_into():
    """reserve() takes the momentum's memory at start (touched), so the first outer step does not fault in 4 bytes
    per parameter at a boundary; the step's numbers are those of an optimizer without it, and momentum stays None
    (no outer step yet) until that step. A proposal never takes the reserve; a restored momentum frees it."""
    s, g = torch.randn(6), torch.randn(6)
    plain, opt = build_outer_optimizer("nesterov", 0.7, 0.9), build_outer_optimizer("nesterov", 0.7, 0.9)
    opt.reserve(6, "cpu")
    assert opt.momentum is None
    reserved = opt._spare.data_ptr()
    proposal = opt.propose(s, g)
    assert opt.momentum is None and opt._spare is not None  # nothing of the optimizer changed
    assert proposal.momentum.data_ptr() != reserved  # nor does the proposal share its memory
    a, b = s.clone(), s.clone()
    plain.step_(a, g.clone())
    opt.step_(b, g.clone())
    assert torch.equal(a, b) and torch.equal(plain.momentum, opt.momentum)
    assert opt.momentum.data_ptr() == reserved and opt._spare is None
    restored = build_outer_optimizer("nesterov", 0.7, 0.9)
    restored.reserve(6, "cpu")
    restored.load_state_dict({"kind": "nesterov", "momentum": torch.ones(6)})
    assert restored._spare is None
    committed = build_outer_optimizer("nesterov", 0.7, 0.9)
    committed.reserve(6, "cpu")
    committed.commit(committed.propose(s, g))  # a committed proposal brings its own momentum
    assert committed._spare is None and torch.equal(committed.momentum, plain.momentum)
    for kind, beta in (("average", 0.9), ("sgd", 0.0)):  # keeps no momentum: reserves nothing
        none = build_outer_optimizer(kind, 0.7, beta)
        none.reserve(6, "cpu")
        assert isinstance(none, Stateless) and none.state_dict() == {"kind": kind, "momentum": None}, kind


def test_propose_leaves_state_untouched_until_commit():
    opt = build_outer_optimizer("nesterov", lr=0.7, momentum=0.9)
    s, g = torch.randn(5), torch.randn(5)
    opt.commit(opt.propose(s, g))
    before = opt.momentum.clone()
    s_before = s.clone()
    opt.propose(s, torch.randn(5))  # computed, never committed: an aborted outer step
    assert torch.equal(opt.momentum, before) and torch.equal(s, s_before)


def test_unknown_names_are_one_line_errors():
    with pytest.raises(ValueError, match="diloco.outer_optimizer: unknown 'adam'"):
        build_outer_optimizer("adam", 0.7, 0.9)
    with pytest.raises(ValueError, match="compression: unknown 'int4'"):
        compression.weighted_mean(torch.zeros(3), 1.0, None, "int4")


def test_int8_codec_roundtrip_bound_and_constant_chunks():
    rows = torch.randn(4, 1000)
    rows[2] = 3.25  # a constant chunk decodes exactly
    payload, meta = compression.encode(rows, "int8")
    assert payload.dtype == torch.uint8 and payload.shape == (4, 1000)
    back = compression.decode(payload, meta, "int8")
    scale = (rows.amax(1) - rows.amin(1)) / 255
    assert torch.all((back - rows).abs().amax(1) <= scale / 2 + 1e-6)
    assert torch.equal(back[2], rows[2])


def test_what_a_mean_sends_does_not_depend_on_the_device():
    """Every rank of a run runs the same collectives, whatever its device (a run may mix CPU and GPU nodes; a
    mixed run is in tests/test_gpu.py): the bytes a mean counts depend on the codec and the group alone."""
    for codec in compression.COMPRESSIONS:
        cpu, gpu = (compression.bytes_sent(15_000_017, 3, codec, device) for device in ("cpu", "cuda"))
        assert cpu == gpu > 0, codec


# ------------------------------------------------------------------------------------------ fakes

def make_plan(generation, outer_step, attempt, members, joiners=(), source=None, leaving=(), forming=False):
    """A real mesh Plan; every member that is not a joiner contributes."""
    return Plan(generation=generation, outer_step=outer_step, attempt=attempt, members=tuple(sorted(members)),
                joiners=tuple(joiners), source=source, leaving=tuple(leaving),
                contributors=tuple(m for m in sorted(members) if m not in joiners), forming=forming)


class FakeMesh:
    """Scripted: boundary() returns the next plan; commit() returns the next decision (and records votes)."""

    def __init__(self, plans: list[make_plan], decisions: list[bool], joiner: bool = False):
        self.plans, self.decisions, self.joiner = list(plans), list(decisions), joiner
        self.votes: list[bool] = []
        self.left: str | None = None

    def start(self) -> bool:
        return self.joiner

    def wait_admission(self) -> make_plan:
        return self.plans.pop(0)

    def boundary(self, outer_step, attempt, *, contributing, draining, budget=None) -> make_plan:
        plan = self.plans.pop(0)
        assert (plan.outer_step, plan.attempt) == (outer_step, attempt)
        return plan

    def commit(self, plan, succeeded: bool) -> bool:
        self.votes.append(succeeded)
        return self.decisions.pop(0) and succeeded

    def dead_members(self, plan) -> list[str]:
        return []

    def leave(self, reason: str) -> None:
        self.left = reason

    def close(self) -> None:
        pass


class TinyInner:
    """The Inner surface DiLoCo uses, over a linear model trained by plain SGD."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(8, 4)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.updates = 0

    def train_step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def outer_params(self):
        return [p.detach() for p in self.model.parameters()]

    def after_outer_update(self) -> None:
        self.updates += 1


def make_outer(inner, mesh, *, node="a", group_factory=None, events=None, clock=None, opt=None, codec=None, **diloco):
    world = SimpleNamespace(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
    sink = [] if events is None else events
    tele = Telemetry(node, 0, json_out=_Null(), extra_sinks=[sink.append])
    # one outer loop for every way of training across hosts: its parts follow from the config (build_parts);
    # opt, codec: parts given instead of the config's, through the same seam
    return DilocoOuter(DilocoConfig(enabled=True, **diloco), MeshConfig(node_id=node), world, inner, tele,
                       config_digest="d", mesh_factory=lambda _: mesh, group_factory=group_factory,
                       outer_optimizer=opt, codec=codec, **({} if clock is None else {"clock": clock}))


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass


# ------------------------------------------------------------------------------------------ one node

def test_h1_lr1_no_momentum_equals_plain_training():
    plain, outer_inner = TinyInner(0), TinyInner(0)
    steps = 6
    mesh = FakeMesh([make_plan(1, k, 0, ["a"], source="a") for k in range(1, steps + 1)], [True] * steps)
    outer = make_outer(outer_inner, mesh, inner_steps=1, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
    progress = Progress()
    outer.start(progress)
    for step in range(1, steps + 1):
        plain.train_step(step)
        outer_inner.train_step(step)
        progress.step = step
        assert outer.after_inner_step(progress) is False
    assert progress.outer_step == steps and outer_inner.updates == steps
    # s - (s - c) rounds in fp32: equal to a few ulps, not bit for bit
    for p, q in zip(plain.model.parameters(), outer_inner.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_aborted_outer_step_rolls_back_then_retries_same_pgrad():
    inner = TinyInner(1)
    plans = [make_plan(1, 1, 0, ["a"], source="a"), make_plan(2, 1, 1, ["a"], source="a")]
    mesh = FakeMesh(plans, [False, True])
    events: list[dict] = []
    outer = make_outer(inner, mesh, events=events, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    progress = Progress()
    outer.start(progress)
    start = flat_params(inner.outer_params())
    for step in (1, 2):
        inner.train_step(step)
        progress.step = step
        trained = start - flat_params(inner.outer_params())
        outer.after_inner_step(progress)
    # the first decision was abort: the committed update is exactly one Nesterov step of the same pgrad
    expected = start - 0.7 * (trained + 0.9 * trained)
    torch.testing.assert_close(flat_params(inner.outer_params()), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(outer.opt.state_dict()["momentum"], trained, rtol=0, atol=1e-7)
    assert mesh.votes == [True, True] and progress.outer_step == 1 and inner.updates == 1
    kinds = [e["type"] for e in events]
    assert kinds.count("warning") == 1 and "aborted" in events[kinds.index("warning")]["message"]
    assert kinds.count("outer_step") == 1


def test_drain_contributes_then_leaves():
    inner = TinyInner(2)
    mesh = FakeMesh([make_plan(1, 1, 0, ["a"], source="a")], [True])
    events: list[dict] = []
    outer = make_outer(inner, mesh, events=events, inner_steps=2)
    progress = Progress()
    outer.start(progress)
    inner.train_step(1)
    progress.step = 1
    outer.request_drain()
    assert outer.after_inner_step(progress) is False  # finishes its inner round first
    inner.train_step(2)
    progress.step = 2
    assert outer.after_inner_step(progress) is True
    assert mesh.left == "drained" and progress.outer_step == 1
    assert [e["type"] for e in events] == ["outer_step", "drained"]  # train.py emits the state events
    assert [e["outer_step"] for e in events if e["type"] == "drained"] == [1]
    assert events[0]["contributors"] == ["a"] and events[0]["weights"] == [1.0]  # its last round counted


# ------------------------------------------------------------------------------------------ 3 real processes

def _group(store, rank: int, size: int, prefix: str) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(prefix, store)
    pg = dist.ProcessGroup(prefixed, rank, size)
    backend = dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=20))
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank)) * (rank + 1)


def _reduce_checks(pg, rank: int) -> dict:
    out = {}
    weights = [1.0, 2.0, 0.0]  # rank 2 is a joiner
    for name in compression.COMPRESSIONS:
        mean, stats = compression.weighted_mean(_inputs(rank), weights[rank], pg, name)
        out[name] = (mean, stats.bytes_sent, stats.total_weight)
        # prepared (DilocoOuter.start): the mean then takes every buffer it uses from the prepared ones
        ex = compression.Exchange()
        ex.prepare(NUMEL, SIZE, name)
        prepared = {key: (t.data_ptr(), t.shape) for key, t in ex._bufs.items()}
        compression.weighted_mean(_inputs(rank), weights[rank], pg, name, exchange=ex)
        out[f"prepared {name}"] = (prepared, {key: (t.data_ptr(), t.shape) for key, t in ex._bufs.items()})
    return out


class _Recording:
    """A process group that records what it sends in the hand-off's chain (tags from handoff.TAG): (to, bytes)."""

    def __init__(self, pg):
        self.pg, self.sent = pg, []

    def send(self, tensors, dst, tag):
        if tag >= handoff.TAG:
            self.sent.append((dst, sum(t.numel() * t.element_size() for t in tensors)))
        return self.pg.send(tensors, dst, tag)

    def __getattr__(self, name):
        return getattr(self.pg, name)


def _handoff_checks(store, rank: int) -> dict:
    """Nodes a, b are members (same start, different training); c joins with other weights at outer step 4."""
    node = "abc"[rank]
    recording: list = []
    inner = TinyInner(0 if node != "c" else 99)
    joiner = node == "c"
    plan = make_plan(7, 4, 0, ["a", "b", "c"], joiners=["c"], source="a")
    mesh = FakeMesh([plan], [True], joiner=joiner)
    prepared: list = []  # the wire buffers when the group is first fetched, just before the first mean
    reserved: list = []  # and the momentum's reserved memory (the joiner's: the others restored one)

    def group(p, n, r):
        if not prepared:
            prepared.append({key: (t.data_ptr(), t.shape) for key, t in outer.bufs.exchange._bufs.items()})
            reserved.append(None if outer.opt._spare is None else outer.opt._spare.data_ptr())
        recording.append(_Recording(_group(store, p.rank_of(n), p.size, "gen7/")))
        return recording[-1]
    outer = make_outer(inner, mesh, node=node, inner_steps=3, compression="int8", outer_lr=0.7, outer_momentum=0.9,
                       min_nodes=3, group_factory=group)
    progress = Progress(step=9, outer_step=3, tokens=12345) if not joiner else Progress()
    if not joiner:
        outer.opt.load_state_dict({"kind": "nesterov", "momentum": torch.full((36,), 0.01)})  # 3 outer steps done
    outer.start(progress)
    wire = outer.bufs.exchange._bufs
    if not joiner:
        inner.train_step(10 + rank)
        progress.step = 12
        outer.after_inner_step(progress)
    return {"prepared": prepared[0], "used": {key: (t.data_ptr(), t.shape) for key, t in wire.items()},
            "reserved": reserved[0], "momentum_at": outer.opt.state_dict()["momentum"].data_ptr(),
            "params": flat_params(inner.outer_params()), "momentum": outer.opt.state_dict()["momentum"],
            "progress": (progress.step, progress.outer_step, progress.tokens), "checksum": outer.last_outer_step,
            "sent": [x for r in recording for x in r.sent]}


def _first_step_checks(store, rank: int, c_seed: int, prefix: str, forming: bool = True,
                       members: str = "abc") -> dict | None:
    """A run's first outer step (plan.forming), three members and no joiner; c starts from weights of seed c_seed
    (a and b from seed 0): the hand-off moves the state only where some member's differs from the source's. Each
    member counts its own tokens, as with time rounds. forming=False: the same outer step as a later one of the
    run, as processes that never committed one (a node restarted after a store restart) see it. members="ab": a
    plan of two, whose last member (b) starts from c_seed; rank 2 sits it out (None)."""
    node = "abc"[rank]
    if node not in members:
        return None
    recording: list = []
    events: list = []
    inner = TinyInner(c_seed if node == members[-1] else 0)
    plan = make_plan(3, 1, 0, list(members), source="a", forming=forming)
    outer = make_outer(inner, FakeMesh([plan], [True]), node=node, inner_steps=1, compression="none",
                       outer_lr=0.7, outer_momentum=0.9, events=events,
                       group_factory=lambda p, n, r: recording.append(_Recording(
                           _group(store, p.rank_of(n), p.size, prefix))) or recording[-1])
    progress = Progress()
    outer.start(progress)
    inner.train_step(20 + rank)
    progress.step, progress.tokens = 1, 1000 * (rank + 1)
    outer.after_inner_step(progress)
    return {"params": flat_params(inner.outer_params()), "momentum": outer.opt.state_dict()["momentum"],
            "sent": [x for r in recording for x in r.sent],
            "warnings": [e["message"] for e in events if e["type"] == "warning"]}


def _chain_checks(pg, rank: int) -> list[torch.Tensor]:
    """handoff.chain from rank 0 down 0 -> 2 -> 1 in 4-byte pieces, 3 in flight per hop: far more pieces than the
    window, so receives are posted and sends waited as the window slides."""
    tensors = [torch.arange(1000, dtype=torch.float32) * (rank == 0), torch.tensor([7, 8, 9]) * (rank == 0)]
    handoff.chain(pg, [0, 2, 1], tensors, piece_bytes=4, window=3)
    return tensors


def _group_worker(rank: int, port: int, queue) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, SIZE, rank == 0, timeout=datetime.timedelta(seconds=30))
        result = {"reduce": _reduce_checks(_group(store, rank, SIZE, "reduce/"), rank),
                  "handoff": _handoff_checks(store, rank),
                  "same_start": _first_step_checks(store, rank, 0, "gen3/"),
                  "other_start": _first_step_checks(store, rank, 99, "gen4/"),
                  "not_forming": _first_step_checks(store, rank, 99, "gen5/", forming=False),
                  "pair_same": _first_step_checks(store, rank, 0, "pair-same/", members="ab"),
                  "pair_other": _first_step_checks(store, rank, 99, "pair-other/", members="ab"),
                  "chain": _chain_checks(_group(store, rank, SIZE, "chain/"), rank)}
        # a peer that dies mid-collective: the others get the backend's error at once, not a hang
        pg = _group(store, rank, SIZE, "death/")
        chained = _group(store, rank, SIZE, "chain-death/")  # 0 -> 1 -> 2, and 2 dies before a piece arrives
        if rank == 2:
            queue.put((rank, pickle.dumps(result)))
            queue.close()
            queue.join_thread()  # flush before dying without cleanup
            import os
            os._exit(0)
        import time
        time.sleep(0.3)
        state = [torch.arange(1000, dtype=torch.float32) * (rank == 0)]
        t0 = time.monotonic()
        delivered = handoff.chain(chained, [0, 1, 2], state, piece_bytes=64, window=3)
        result["chain_death"] = (state[0], delivered, time.monotonic() - t0)
        t0 = time.monotonic()
        try:
            compression.weighted_mean(torch.ones(100), 1.0, pg, "int8")
            result["death"] = ("no error", 0.0)
        except RuntimeError as e:
            result["death"] = (str(e).splitlines()[0], time.monotonic() - t0)
        # plain pickle: torch's queue reducers would share tensors through a server that dies with the child
        queue.put((rank, pickle.dumps(result)))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def group_results():
    return spawned_ranks(_group_worker, SIZE, timeout=60)


def _exact_mean() -> torch.Tensor:
    return (1.0 * _inputs(0) + 2.0 * _inputs(1)) / 3.0


def test_weighted_mean_ignores_weight_zero_joiner_and_is_identical_everywhere(group_results):
    exact = _exact_mean()
    for name in compression.COMPRESSIONS:
        got = [group_results[r]["reduce"][name][0] for r in range(SIZE)]
        assert all(torch.equal(got[0], g) for g in got[1:]), f"{name}: ranks disagree"
        assert group_results[0]["reduce"][name][2] == 3.0
    torch.testing.assert_close(group_results[0]["reduce"]["none"][0], exact, rtol=1e-6, atol=1e-6)


def test_a_prepared_exchange_holds_every_buffer_the_mean_uses(group_results):
    """Exchange.prepare allocates at start what a mean of that size takes, so the run's first outer step faults in
    no fresh pages (docs/performance.md, "The hand-off's first touches"): the mean allocated nothing more."""
    for rank in range(SIZE):
        for name in compression.COMPRESSIONS:
            prepared, used = group_results[rank]["reduce"][f"prepared {name}"]
            assert prepared and used == prepared, (rank, name)
        # and DilocoOuter.start prepares them for diloco.min_nodes members: its first outer step allocated none
        got = group_results[rank]["handoff"]
        assert got["prepared"] and got["used"] == got["prepared"], rank


def test_bytes_sent_match_ring_cost_and_int8_is_a_quarter(group_results):
    sent = {name: group_results[0]["reduce"][name][1] for name in compression.COMPRESSIONS}
    chunk = -(-NUMEL // SIZE)
    # 2 * (size-1) chunks each way, plus the weights (4 bytes to each peer) and int8's scale/offset
    # "none": one ring all-reduce of the tensor and the size weights appended to it
    assert sent["none"] == 2 * (SIZE - 1) * -(-(NUMEL + SIZE) // SIZE) * 4
    assert sent["bf16"] == sent["fp16"] == 2 * (SIZE - 1) * chunk * 2 + 4 * (SIZE - 1)
    assert sent["int8"] == 2 * (SIZE - 1) * (chunk + 8) + 4 * (SIZE - 1)
    assert sent["int8"] / sent["none"] < 0.26


def test_int8_error_bound(group_results):
    """Two uniform quantizations, each off by at most half a bin: the senders' chunks (sum_i range_i / 510,
    divided by the total weight) and the reduced chunk (its range, at most sum_i range_i / total, over 510).
    So |error| <= sum_i range(w_i x_i) / (255 * sum_i w_i) per element. Relative L2 error of Gaussian
    pseudo-gradients: asserted < 2%."""
    exact = _exact_mean()
    got = group_results[0]["reduce"]["int8"][0]
    ranges = sum(float((w * _inputs(r)).max() - (w * _inputs(r)).min()) for r, w in ((0, 1.0), (1, 2.0)))
    assert float((got - exact).abs().max()) <= ranges / (255 * 3.0) + 1e-6
    rel = float((got - exact).norm() / exact.norm())
    print(f"int8 relative L2 error {rel:.4f}")
    assert rel < 0.02, rel


def test_half_precision_error_bounds(group_results):
    exact = _exact_mean()
    for name, bound in (("bf16", 2 ** -7), ("fp16", 2 ** -10)):
        got = group_results[0]["reduce"][name][0]
        rel = float((got - exact).norm() / exact.norm())
        assert rel < bound, (name, rel)


def test_joiner_receives_weights_momentum_and_progress(group_results):
    h = [group_results[r]["handoff"] for r in range(SIZE)]
    assert torch.equal(h[0]["params"], h[1]["params"]) and torch.equal(h[0]["params"], h[2]["params"])
    assert torch.equal(h[0]["momentum"], h[2]["momentum"])
    # the joiner received the momentum into the memory it reserved at start; the members, which had one, reserved none
    assert h[2]["reserved"] == h[2]["momentum_at"] and h[0]["reserved"] is h[1]["reserved"] is None
    assert h[0]["progress"] == h[2]["progress"] == (12, 4, 12345)
    assert h[0]["checksum"]["checksum"] == h[1]["checksum"]["checksum"] == h[2]["checksum"]["checksum"]
    assert h[0]["checksum"]["members"] == ["a", "b", "c"]


def test_the_hand_off_is_a_chain_that_moves_the_state_once_per_link(group_results):
    """Source a sends the state to the joiner c only, c forwards it to b, b sends nothing: each uplink carries it
    once (a broadcast from the source sent it to b and to c), and the joiner comes first, so that member b's death
    could not cut it off. The state: 36 parameters and 36 momentum values in fp32 and the 3 int64 counters, in
    pieces of at most handoff.PIECE_BYTES."""
    state = 36 * 4 * 2 + 3 * 8
    sent = [group_results[r]["handoff"]["sent"] for r in range(SIZE)]
    assert {to for to, _ in sent[0]} == {2} and sum(n for _, n in sent[0]) == state
    assert {to for to, _ in sent[2]} == {1} and sum(n for _, n in sent[2]) == state
    assert sent[1] == []
    assert all(n <= handoff.PIECE_BYTES for r in sent for _, n in r)


def test_a_runs_first_step_moves_no_state_when_every_member_already_holds_the_sources(group_results):
    """Every member from one seed, each counting its own tokens (as with time rounds): nothing moves. Defect: the
    fingerprints took the inner steps and tokens too, so a time-rounds run moved its whole state at every start."""
    same = [group_results[r]["same_start"] for r in range(SIZE)]
    assert all(s["sent"] == [] for s in same), [s["sent"] for s in same]
    assert all(torch.equal(same[0]["params"], s["params"]) and torch.equal(same[0]["momentum"], s["momentum"])
               for s in same)
    assert not any(s["warnings"] for s in same)


def test_only_a_forming_plan_aligns_the_members_state(group_results):
    """Defect: whether a member aligned on the source's state was its own count of committed rounds, so a process
    restarted under a store restart (none committed) ran the fingerprint all_gather alone while its peers went on.
    It is the plan's (plan.forming): a plan that is not forming moves nothing, even where c's weights differ."""
    results = [group_results[r]["not_forming"] for r in range(SIZE)]
    assert all(r["sent"] == [] for r in results), [r["sent"] for r in results]
    assert not torch.equal(results[0]["params"], results[2]["params"])


def test_a_runs_first_step_moves_the_sources_state_to_members_that_started_elsewhere(group_results):
    """c started from other weights (as from an older checkpoint): the source's state goes down the chain and
    c adopts it; a and b already held it."""
    other = [group_results[r]["other_start"] for r in range(SIZE)]
    state = 36 * 4 * 2 + 3 * 8
    assert sum(n for _, n in other[0]["sent"]) == sum(n for _, n in other[1]["sent"]) == state
    assert all(torch.equal(other[0]["params"], o["params"]) and torch.equal(other[0]["momentum"], o["momentum"])
               for o in other)
    assert any("adopted the source's" in w for w in other[2]["warnings"]) and not other[1]["warnings"]
    assert not torch.equal(other[0]["params"], group_results[0]["same_start"]["params"])  # c's start counted


def test_a_two_member_formation_checks_the_fingerprints_too(group_results):
    """The smallest run (two nodes, an FSDP pair's) forms like any other: from one seed nothing moves; with b from
    other weights the source's state goes to b, which adopts it. A fingerprint check skipped at two members was
    caught only by an FSDP e2e run (issue 41)."""
    assert group_results[2]["pair_same"] is None and group_results[2]["pair_other"] is None  # c sat them out
    same = [group_results[r]["pair_same"] for r in range(2)]
    assert all(s["sent"] == [] for s in same), [s["sent"] for s in same]
    assert torch.equal(same[0]["params"], same[1]["params"]) and torch.equal(same[0]["momentum"], same[1]["momentum"])
    assert not any(s["warnings"] for s in same)
    other = [group_results[r]["pair_other"] for r in range(2)]
    assert sum(n for _, n in other[0]["sent"]) == 36 * 4 * 2 + 3 * 8 and other[1]["sent"] == []  # a -> b, once
    assert torch.equal(other[0]["params"], other[1]["params"])
    assert torch.equal(other[0]["momentum"], other[1]["momentum"])
    assert any("adopted the source's" in w for w in other[1]["warnings"]) and not other[0]["warnings"]
    assert not torch.equal(other[0]["params"], same[0]["params"])  # b's start counted in the mean


def test_the_chain_delivers_every_piece_through_a_sliding_window(group_results):
    for r in range(SIZE):
        got = group_results[r]["chain"]
        assert torch.equal(got[0], torch.arange(1000, dtype=torch.float32)) and got[1].tolist() == [7, 8, 9], r


class _BrokenChain:
    """A plan's group whose fingerprint all_gather answers with the given rows and whose chain breaks (a peer died
    mid-transfer)."""

    def __init__(self, rows, rank, error=RuntimeError("Connection closed by peer")):
        self.rows, self._rank = rows, rank  # rows None: the check itself fails with `error` too
        self.error = error

    def rank(self):
        return self._rank

    def allgather(self, outputs, inputs):
        if self.rows is None:
            raise self.error
        for out, row in zip(outputs[0], self.rows):
            out.copy_(torch.tensor(row))
        return SimpleNamespace(wait=lambda: None)

    def send(self, *args):
        raise self.error

    recv = send


def _raise(error):
    raise error


class _OtherRanks(LocalRanks):
    """Local rank 0 of a node of two, whose other rank reports `theirs` (its error text, or None)."""

    def __init__(self, theirs):
        super().__init__(0, 1, None)
        self.theirs = theirs

    def every(self, errors):
        return [e for e in (errors, self.theirs) if e]


def _failed_handoff(plan, rows, node="b", error=RuntimeError("Connection closed by peer"), into_mean=False,
                    seen=None, agreed_is_mean=False, give_up=False, local=None):
    """StateHandoff.send on member `node` whose chain breaks with `error`; returns (the step-outs it asked for, its
    warnings). `seen` collects the groups it reported failed and the scratch renewals. agreed_is_mean: the agreed
    weights it sends are the mean buffer (an overlapped node's while its outer step is in flight). give_up: the
    watchdog (MeshLinks.bounded) gives the chain up with `error`, its thread left running. local: the node's
    LocalRanks (default: one process)."""
    stepped, warnings, seen = [], [], {} if seen is None else seen
    mesh = SimpleNamespace(step_out=lambda p, why, cause: stepped.append(f"{why} [{cause}]"))
    links = SimpleNamespace(node_id=node, local=local or LocalRanks(0, 1, None), mesh=mesh, dead=lambda p: [],
                            group=lambda p: _BrokenChain(rows, p.rank_of(node), error),
                            bounded=lambda p, what, fn, **kw: _raise(error) if give_up and what != "state check"
                            else fn(),
                            failed=lambda p, e: seen.setdefault("failed", []).append((p.generation, type(e))))
    opt = build_outer_optimizer("nesterov", 0.7, 0.9)
    opt.load_state_dict({"kind": "nesterov", "momentum": torch.zeros(4)})
    bufs = SimpleNamespace(numel=4, mean=torch.zeros(4), device=torch.device("cpu"),
                           renew_scratch=lambda: seen.setdefault("renewed", []).append(1))
    emit = lambda kind, message: warnings.append(message)  # noqa: E731
    agreed = bufs.mean if agreed_is_mean else torch.ones(4)
    handoff.StateHandoff(bufs, opt, links, emit).send(plan, Progress(), agreed, lambda *a: None, into_mean=into_mean)
    return stepped, warnings


def test_a_member_whose_weights_differ_and_missed_the_first_hand_off_steps_out_to_join_again():
    """Defect: when the state transfer of a run's first outer step failed, a member whose weights differed from the
    source's kept its own, and the members trained on from different weights for the rest of the run. It steps
    out now, and its next boundary admits it as a joiner, which hands it the state. A member that held the
    source's already, and any member of a later join (its weights are the run's), carry on."""
    forming = make_plan(3, 1, 0, ["a", "b", "c"], source="a", forming=True)
    stepped, warnings = _failed_handoff(forming, [[1, 2], [5, 6], [1, 2]])  # b's weights differ from a's
    assert len(stepped) == 1 and "joins again to receive them [its weights differ from the run's]" in stepped[0]
    assert any("failed: Connection closed by peer" in w for w in warnings), warnings
    assert _failed_handoff(forming, [[1, 2], [1, 2], [5, 6]])[0] == []  # b holds a's state; c differs
    assert _failed_handoff(forming, None)[0] == []  # the check failed: nothing says b differs
    join = make_plan(4, 7, 0, ["a", "b", "c"], joiners=["c"], source="a")
    assert _failed_handoff(join, [[1, 2], [5, 6], [1, 2]])[0] == []
    # a node of several local ranks steps out as one (it used to fail with exit 1): when any of its ranks holds
    # a shard of its own that the source's did not replace, even if this rank's shard was the source's
    other = "the state hand-off of the run's first outer step failed (rank 1: Connection reset)"
    stepped, _ = _failed_handoff(forming, [[1, 2], [1, 2], [5, 6]], local=_OtherRanks("rank 1: Connection reset"))
    assert len(stepped) == 1 and stepped[0].startswith(other), stepped
    assert _failed_handoff(forming, [[1, 2], [1, 2], [5, 6]], local=_OtherRanks(None))[0] == []


def test_a_joiner_whose_state_did_not_arrive_steps_out_keeps_nothing_and_says_so():
    """Defect: a joiner whose hand-off broke (its source died mid-transfer) failed with a traceback and exit 1. It
    steps out now (the commit stands without it) and raises MissedState, which its outer loop answers by asking
    to join again; nothing of what arrived is adopted, and a mean buffer the abandoned chain may still write into
    is renewed."""
    from engine.outer.groups import PeerLost
    join = make_plan(4, 7, 0, ["a", "b", "c"], joiners=["c"], source="a")
    for error, into_mean, renewed in ((PeerLost("state hand-off: a stopped beating"), True, [1]),
                                      (RuntimeError("Connection closed by peer"), True, [])):
        stepped, seen, adopted = [], {}, []
        mesh = SimpleNamespace(step_out=lambda p, why, cause: stepped.append((p.outer_step, why, cause)))
        links = SimpleNamespace(node_id="c", local=LocalRanks(0, 1, None), mesh=mesh, dead=lambda p: [],
                                group=lambda p: _BrokenChain(None, p.rank_of("c"), error),
                                bounded=lambda p, what, fn, **kw: fn())
        bufs = SimpleNamespace(numel=4, mean=torch.zeros(4), device=torch.device("cpu"),
                               renew_scratch=lambda: seen.setdefault("renewed", []).append(1))
        progress = Progress(step=5, outer_step=2, tokens=50)
        with pytest.raises(handoff.MissedState, match="outer step 7: the state from a did not arrive"):
            handoff.StateHandoff(bufs, build_outer_optimizer("nesterov", 0.7, 0.9), links, lambda *a, **k: None).receive(
                join, progress, lambda params, tensors: adopted.append(params), into_mean=into_mean)
        assert stepped == [(7, f"the state from a did not arrive ({error})", "it missed the state it joined for")]
        assert adopted == [] and (progress.step, progress.outer_step, progress.tokens) == (5, 2, 50)
        assert seen.get("renewed", []) == renewed, (error, seen)


def test_a_hand_off_given_up_upstream_leaves_its_mean_buffer_to_the_abandoned_chain():
    """Defect: a hand-off given up on a death upstream left the mean buffer to the abandoned chain's thread, which
    writes the pieces still coming from a frozen node that wakes up into it: into the next outer step's mean, as an
    abandoned collective would (exchange.py renews its buffers for this). The receiving member takes fresh scratch
    now. Not otherwise: not when it received elsewhere, not on a failure that ended the chain's thread, not when
    the check before the chain failed, and never on the source, whose agreed weights may be the mean buffer
    itself (overlap, an outer step in flight). The generation's group is kept in every case: the hand-off follows
    a commit, the members that got the state keep it, and one rebuilt on this node alone would meet none of them
    at its rendezvous."""
    from engine.outer.groups import PeerLost
    join = make_plan(4, 7, 0, ["a", "b", "c"], joiners=["c"], source="a")
    lost = PeerLost("state hand-off: a stopped beating (mesh.heartbeat_timeout)")
    for error, into_mean, renewed in ((lost, True, [1]), (lost, False, []),
                                      (RuntimeError("Connection closed by peer"), True, [])):
        seen: dict = {}
        _, warnings = _failed_handoff(join, None, error=error, into_mean=into_mean, seen=seen,
                                      give_up=isinstance(error, PeerLost))
        assert seen.get("renewed", []) == renewed and "failed" not in seen, (error, into_mean, seen)
        assert any("state hand-off to ['c'] failed" in w for w in warnings), warnings
    seen = {}  # the source given up (a stop), its agreed weights in the mean buffer
    _, warnings = _failed_handoff(join, None, node="a", error=lost, into_mean=True, seen=seen, agreed_is_mean=True,
                                  give_up=True)
    assert seen == {} and any("failed: state hand-off: a stopped" in w for w in warnings), (seen, warnings)
    # the fingerprint check given up (nothing was handed the mean buffer)
    forming, seen = make_plan(3, 1, 0, ["a", "b", "c"], source="a", forming=True), {}
    _failed_handoff(forming, None, error=lost, into_mean=True, seen=seen)
    assert seen == {}, seen


def test_a_node_whose_next_in_the_chain_died_keeps_the_state_it_received(group_results):
    """Defect: a death anywhere in the chain failed every node's hand-off, a joiner's too, though the state had
    reached it. Rank 2 dies before any piece comes: rank 1 still receives every piece from 0 and says it could
    not forward them; rank 0 delivered all of its own."""
    (got1, delivered1, seconds), (got0, delivered0, _) = (group_results[r]["chain_death"] for r in (1, 0))
    assert torch.equal(got1, torch.arange(1000, dtype=torch.float32)) and not delivered1 and seconds < 10
    assert delivered0


def test_a_hand_off_rank_gives_up_on_a_death_upstream_only():
    """bounded(watch=...): the chain's ranks give up when a node before them dies (the state cannot come), not on
    a death after them (their part is done, or their forwarding ends on its own: above)."""
    import threading
    from engine.outer.groups import MeshLinks, PeerLost
    links = MeshLinks(DilocoConfig(enabled=True), MeshConfig(node_id="b", polling_interval=0.01),
                      SimpleNamespace(size=1), "b", lambda *a, **k: None, lambda: None, digest="d", info={})
    links.store = object()
    links.mesh = SimpleNamespace(dead_members=lambda p: ["d"], store=SimpleNamespace(), link_slow=lambda: False)
    plan = make_plan(2, 5, 0, ["a", "b", "c", "d"], source="a")
    done = threading.Event()
    threading.Timer(0.3, done.set).start()
    assert links.bounded(plan, "state hand-off", lambda: done.wait(10) and "arrived", until_decided=False,
                         watch=["a"]) == "arrived"
    with pytest.raises(PeerLost, match="d stopped beating"):
        links.bounded(plan, "state hand-off", lambda: threading.Event().wait(10), until_decided=False,
                      watch=["a", "d"])
    # the chain empties the list once every piece landed (received=watch.clear): a death before it no longer counts
    links.mesh_cfg = MeshConfig(node_id="b", polling_interval=0.2)
    watch, done = ["d"], threading.Event()
    threading.Timer(0.6, done.set).start()
    assert links.bounded(plan, "state hand-off", lambda: watch.clear() or (done.wait(10) and "kept"),
                         until_decided=False, watch=watch) == "kept"



def test_a_member_on_a_slow_link_steps_out_of_a_collective_just_past_its_budget_not_before():
    """bounded(): a collective running past diloco.straggler_timeout (1 s here) on a node whose link is slow is given
    up, and the node steps out; one that ends before it is not, nor is an overdue one on a healthy link. The
    budget counts from the node's arrival at the boundary (its peers were held since): arrived 0.8 s before the
    collective began, it gives up 0.2 s into it. On real time, 0.3 s or more either side of each bound."""
    import threading
    import time
    from engine.mesh import MemoryStore
    from engine.outer.groups import MeshLinks, PeerLost
    stepped: list[str] = []
    slow = {"link": True}
    links = MeshLinks(DilocoConfig(enabled=True, straggler_timeout=1.0), MeshConfig(node_id="b", polling_interval=0.02),
                      SimpleNamespace(size=1), "b", lambda *a, **k: None, lambda: None, digest="d", info={})
    links.store = object()
    links.mesh = SimpleNamespace(dead_members=lambda p: [], store=MemoryStore(), link_slow=lambda: slow["link"],
                                 step_out=lambda p, why: stepped.append(why))
    plan = make_plan(2, 5, 0, ["a", "b"], source="a")

    def ends_after(seconds: float):
        return lambda: threading.Event().wait(seconds) or "done"
    assert links.bounded(plan, "mean", ends_after(0.6)) == "done" and stepped == []  # under the budget
    began = time.monotonic()
    with pytest.raises(PeerLost, match=r"mean overdue \(1.0s, diloco.straggler_timeout\) on a slow link"):
        links.bounded(plan, "mean", ends_after(10))
    assert 1.0 <= time.monotonic() - began < 3.0 and len(stepped) == 1
    links.arrived = (plan.outer_step, plan.attempt, time.monotonic() - 0.8)
    with pytest.raises(PeerLost, match="overdue"):
        links.bounded(plan, "mean", ends_after(0.6))  # 0.8 + 0.6: over
    links.arrived, slow["link"] = None, False
    assert links.bounded(plan, "mean", ends_after(1.3)) == "done" and len(stepped) == 2  # overdue, link healthy


def test_the_straggler_budget_is_the_setting_or_the_larger_of_half_a_heartbeat_timeout_and_4x_the_slowest_mean():
    """diloco.straggler_timeout = 0 (the default): the budget follows the run's recent means, never under half a
    heartbeat timeout; either side of where the two meet."""
    from engine.outer.groups import MeshLinks
    links = MeshLinks(DilocoConfig(enabled=True), MeshConfig(node_id="b", heartbeat_timeout=6.0),
                      SimpleNamespace(size=1), "b", lambda *a, **k: None, lambda: None, digest="d", info={})
    assert links.straggler_timeout() == 3.0  # no mean yet
    links.recent_wire.extend([0.2, 0.74, 0.3])
    assert links.straggler_timeout() == 3.0  # 4 x 0.74 = 2.96: under half the timeout
    links.recent_wire.extend([0.76, 0.1])
    assert links.straggler_timeout() == pytest.approx(3.04)  # just over it: the slowest mean's, not the last
    links.cfg = DilocoConfig(enabled=True, straggler_timeout=1.5)
    assert links.straggler_timeout() == 1.5  # diloco.straggler_timeout, whatever the means took


def _tcp_store() -> dist.TCPStore:
    from procs import free_port
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def test_a_rank_without_the_heartbeat_reads_the_members_liveness_itself():
    """PeerWatch, local rank > 0's view: a member whose counter keeps changing lives; one whose counter stopped is
    dead after mesh.heartbeat_timeout; a clean exit (negative counter) and a key the leader pruned are dead at
    once. Read from a real TCPStore, on an injected clock."""
    from engine.mesh import Keys
    from engine.mesh.group import PeerWatch
    store, keys, now = _tcp_store(), Keys(), [0.0]
    for node, value in (("a", 5), ("b", 9), ("c", 3)):
        store.add(keys.hb(node), value)
    store.add(keys.hb("c"), -10)  # c left cleanly: -7
    watch = PeerWatch(store, timeout=1.0, clock=lambda: now[0])
    assert watch.dead(["a", "b", "c", "d"]) == ["c", "d"]
    while now[0] < 1.0:
        now[0] += 0.2
        store.add(keys.hb("a"), 1)
        assert watch.dead(["a", "b"]) == []  # b has had its timeout of grace not yet
    now[0] += 0.2
    store.add(keys.hb("a"), 1)
    assert watch.dead(["a", "b"]) == ["b"]  # silent for 1.2 s


def test_a_hand_off_on_a_local_rank_without_the_heartbeat_gives_up_on_a_death_upstream():
    """Defect: only local rank 0 holds the heartbeat, so the hand-off chains of a node's other local ranks waited
    for gloo's timeout (diloco.allreduce_timeout, 30 s by default) after a member before them died, while their
    node stood still. They read the members' heartbeats from the store themselves now (MeshLinks.dead)."""
    import threading
    import time
    from engine.mesh import Keys
    from engine.outer.groups import MeshLinks, PeerLost
    store, keys = _tcp_store(), Keys()
    links = MeshLinks(DilocoConfig(enabled=True), MeshConfig(node_id="b", polling_interval=0.05,
                                                            heartbeat_interval=0.1, heartbeat_timeout=1.0),
                      SimpleNamespace(size=2, rank=1), "b", lambda *a, **k: None, lambda: None, digest="d", info={})
    links.store = store  # a local rank > 0: a store client, no mesh
    plan = make_plan(2, 5, 0, ["a", "b", "c"], source="a")
    stop = threading.Event()

    def beat(node: str) -> None:
        while not stop.wait(0.1):
            store.add(keys.hb(node), 1)
    for node in ("a", "c"):
        store.add(keys.hb(node), 1)
    beats = [threading.Thread(target=beat, args=(n,), daemon=True) for n in ("a", "c")]
    try:
        for t in beats:
            t.start()
        done = threading.Event()
        threading.Timer(1.5, done.set).start()  # a slow chain while everyone beats: it ends on its own
        assert links.bounded(plan, "state hand-off", lambda: done.wait(10) and "arrived", until_decided=False,
                             watch=["a"]) == "arrived"
        stop.set()  # a and c die
        began = time.monotonic()
        with pytest.raises(PeerLost, match=r"a stopped beating \(mesh.heartbeat_timeout, as local rank 1 read it\)"):
            links.bounded(plan, "state hand-off", lambda: threading.Event().wait(20), until_decided=False,
                          watch=["a"])
        assert time.monotonic() - began < 3.0  # the heartbeat timeout and a few polls, not gloo's 20-30 s
        assert links.dead(plan) == ["a", "c"]  # what the chain's forwarding asks about the next node
    finally:
        stop.set()


class _FrozenNext:
    """Rank 1 of a chain 0 -> 1 -> 2 whose receives land at once (the pieces of `source`) and whose sends to rank 2
    never complete (a frozen peer) unless `alive`."""

    def __init__(self, source: list[torch.Tensor], alive: bool, piece_bytes: int = 16):
        self.source = handoff.pieces(source, piece_bytes)
        self.alive, self.released = alive, __import__("threading").Event()
        self.sent = 0

    def rank(self):
        return 1

    def recv(self, tensors, src, tag):
        tensors[0].copy_(self.source[tag - handoff.TAG])
        return SimpleNamespace(wait=lambda: None)

    def send(self, tensors, dst, tag):
        self.sent += 1
        return SimpleNamespace(wait=(lambda: None) if self.alive else (lambda: self.released.wait(30)))


def test_a_frozen_next_node_ends_the_forwarding_not_the_receiving():
    """A next node that freezes holds its sends until gloo's timeout (minutes): once the heartbeat says it is dead
    (downstream_lost), the chain returns with every piece received. Alive, every piece goes on."""
    import time
    source = [torch.arange(100, dtype=torch.float32), torch.tensor([4, 5, 6])]
    for alive in (True, False):
        pg, asked = _FrozenNext(source, alive), []
        got = [torch.zeros(100), torch.zeros(3, dtype=torch.int64)]
        t0 = time.monotonic()
        lost = (lambda: False) if alive else (lambda: asked.append(1) or len(asked) > 3)  # noqa: E731
        landed: list = []
        delivered = handoff.chain(pg, [0, 1, 2], got, piece_bytes=16, window=4, downstream_lost=lost, poll_s=0.01,
                                  received=lambda: landed.append(pg.sent))
        sent, seconds = pg.sent, time.monotonic() - t0
        pg.released.set()  # the forwarding thread's frozen wait ends (gloo's timeout would)
        assert torch.equal(got[0], source[0]) and torch.equal(got[1], source[1]), alive
        assert delivered == alive and seconds < 5
        assert sent == (len(handoff.pieces(source, 16)) if alive else 4)  # frozen: the window filled, then stop
        assert len(landed) == 1  # said once, when every piece had landed


def test_a_joiner_stops_watching_the_nodes_before_it_once_its_state_landed():
    """The joiner b of a chain a -> b -> c gives up on a's death only while pieces are still to come: once they all
    landed the list it is watched by is empty, and it adopts the state and the counters."""
    seen, adopted = {}, []

    def bounded(plan, what, fn, until_decided, watch):
        seen["before"] = list(watch)
        out = fn()
        seen["after"] = list(watch)
        return out
    state = [torch.ones(4), torch.full((4,), 0.5), torch.tensor([9, 3, 100])]
    links = SimpleNamespace(node_id="b", local=LocalRanks(0, 1, None), mesh=None, dead=lambda p: [],
                            group=lambda p: _FrozenNext(state, True, handoff.PIECE_BYTES), bounded=bounded)
    opt = build_outer_optimizer("nesterov", 0.7, 0.9)
    bufs = SimpleNamespace(numel=4, mean=torch.zeros(4), device=torch.device("cpu"))
    progress = Progress()
    handoff.StateHandoff(bufs, opt, links, lambda *a, **k: None).receive(
        make_plan(5, 3, 0, ["a", "b", "c"], joiners=["b"], source="a"), progress,
        lambda params, tensors: adopted.append(params.clone()), into_mean=False)
    assert seen == {"before": ["a"], "after": []}
    assert torch.equal(adopted[0], state[0]) and (progress.step, progress.outer_step, progress.tokens) == (9, 3, 100)


def test_the_chain_cuts_the_state_into_pieces_of_at_most_piece_bytes():
    t = [torch.arange(10, dtype=torch.float32), torch.arange(3, dtype=torch.int64)]
    parts = handoff.pieces(t, piece_bytes=16)
    assert [p.numel() for p in parts] == [4, 4, 2, 2, 1]
    assert torch.equal(torch.cat([p.float() for p in parts]), torch.cat([t[0], t[1].float()]))
    assert parts[1].data_ptr() == t[0].data_ptr() + 16 and parts[4].data_ptr() == t[1].data_ptr() + 16  # views


def test_dead_peer_fails_the_collective_fast(group_results):
    for rank in (0, 1):
        message, seconds = group_results[rank]["death"]
        assert "Connection closed by peer" in message or "Connection reset" in message, message
        assert seconds < 5


def test_the_mesh_digest_carries_the_workers_and_the_wire_protocol(monkeypatch):
    """An engine whose outer-step collectives differ (another wire protocol) must be refused at start-up, not
    deadlock in a mismatched collective: the soak once ran a node restarted on a newer engine among older ones,
    and its all-reduce met their all_to_all until every attempt timed out."""
    outer = make_outer(TinyInner(0), FakeMesh([], []))
    assert outer.digest == f"d/w1/sddp/p{compression.WIRE_PROTOCOL}"
    monkeypatch.setattr(compression, "WIRE_PROTOCOL", compression.WIRE_PROTOCOL + 1)
    assert make_outer(TinyInner(0), FakeMesh([], [])).digest != outer.digest


@pytest.mark.parametrize("shared", [{"fragments": 2}, {"sentinel_ratio": 4.0}])
def test_the_engine_offers_the_mesh_every_setting_its_nodes_must_share(shared):
    """Nodes that split the model into other fragments put collectives of other sizes on the wire (a hang until
    allreduce_timeout), and nodes that judge the sentinel otherwise compute other means: the mesh must refuse
    them at start-up, so the digest that build_outer gives the mesh carries those settings."""
    from engine.config import Config
    from engine.digests import run_digest
    from engine.outer.build import build_outer

    world = SimpleNamespace(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
    tele = Telemetry("a", 0, json_out=_Null())
    digests = []
    for diloco in ({}, shared):
        cfg = Config.model_validate({"data": {"fake": True}, "diloco": {"enabled": True, "inner_steps": 4, **diloco}})
        outer = build_outer(cfg, world, TinyInner(0), tele)
        digests.append(outer.digest)
        assert digests[-1] == f"{run_digest(cfg)}/w1/sddp/p{compression.WIRE_PROTOCOL}"
        # the mesh compares the digest and the settings it hashes, so that a refused node can name the difference
        mesh_digest, _, settings = outer.links.digest.partition(" ")
        assert mesh_digest == digests[-1] and json.loads(settings)["diloco.inner_steps"] == 4
        assert all(json.loads(settings).get(f"diloco.{k}") == v for k, v in diloco.items())
    assert digests[0] != digests[1]
