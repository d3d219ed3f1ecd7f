"""Outer-step benchmark: the phases of one DiLoCo outer step in seconds, and two ratios measured side by side in
one run over the same gloo group.

    python bench/outer_step.py                                   # 15m model, 2 nodes, H 10, int8: ~1 min, 2 cores
    python bench/outer_step.py --preset 150m --compression none --inner-steps 50 --device cuda

Two processes ("nodes") form a gloo group over loopback with engine.mesh.make_group, as a DiLoCo run does, and
each drives the real engine.outer.diloco.DilocoOuter (a scripted mesh that always commits stands in for the store).
Every round, in this order on both nodes:

    inner      H AdamW steps of the model on random tokens (the round's compute)
    outer      outer.after_inner_step at the boundary: the whole outer step, as training pays for it
    bare       pg.allreduce of a float32 tensor of the same byte size as the outer step's payload (numel x bytes
               per element of the codec), on the same group: the wire alone

A tiny all-reduce lines the nodes up before `outer` and before `bare`, so neither waits for the other's compute.
Round 0 is a warm-up (it also holds the one-time state hand-off every multi-node run starts with: the nodes start on
the same weights, so it compares their fingerprints and sends nothing); the figures are medians of the rounds after.
The phases come from the outer's own timers (DilocoOuter.last_phases).

    R1 = outer overhead / round  = (outer step - wire) / (H inner steps)      goal on a GPU at 150m, H 50: <= 0.05
    R2 = outer step / bare       = outer step / bare all-reduce of the same bytes   goal on CPU: <= 1.2

Its last line: `outer overhead / round R1; outer step / bare all-reduce R2`.

--overlap (diloco.overlap = true): the outer step runs on a background thread while the next round trains; the
`outer` figure is then what the boundary itself costs the training loop (the landing of the previous round and
the pseudo-gradient), all of it counted as overhead, and the background outer step is shown beside it. The
bench's own collectives then use a twin group of the same members (two threads never share one gloo group).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

from ranks import report_to, run_ranks  # bench/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCAB = 258
NAMES = ("n0", "n1")


class AlwaysMesh:
    """The Mesh surface DilocoOuter uses, for two members that always commit. As a real run's, its plans are forming
    until one commits: the first outer step then aligns every member on the source's state (the hand-off)."""

    def __init__(self, names: tuple[str, ...]):
        self.names, self.formed = names, False

    def start(self) -> bool:
        return False

    def boundary(self, outer_step, attempt, *, contributing, draining, budget=None):
        from engine.mesh.protocol import Plan
        return Plan(generation=1, outer_step=outer_step, attempt=attempt, members=self.names, source=self.names[0],
                    contributors=self.names, forming=not self.formed)

    def commit(self, plan, succeeded: bool) -> bool:
        self.formed = self.formed or succeeded
        return succeeded

    def leave(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


class BenchInner:
    """The Inner surface DiLoCo uses, over a plain model trained by AdamW on random tokens."""

    def __init__(self, args, rank: int):
        import torch

        from engine.config import ModelConfig
        from engine.model import build_model
        self.device = torch.device(args.device)
        self.model = build_model(ModelConfig(preset=args.preset), VOCAB, args.seq_len, device=self.device, seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(100 + rank)
        self.args = args

    def train_step(self) -> None:
        import torch

        from engine.model import causal_lm_loss
        ids = torch.randint(0, VOCAB, (self.args.batch, self.args.seq_len + 1), generator=self.gen).to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = causal_lm_loss(self.model, ids[:, :-1], ids[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def outer_params(self):
        return [p.detach() for p in self.model.parameters()]

    def after_outer_update(self) -> None:
        pass


class _Null:
    def write(self, _):
        pass

    def flush(self):
        pass


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, port: int, args, queue) -> None:
    report_to(queue, rank, lambda: run(rank, port, args))


def run(rank: int, port: int, args) -> dict:
    import torch
    import torch.distributed as dist

    from engine.outer import allreduce as compression
    from engine.config import DilocoConfig, MeshConfig
    from engine.outer.diloco import DilocoOuter
    from engine.mesh import make_group
    from engine.mesh.protocol import Plan
    from engine.outer import Progress
    from engine.telemetry import Telemetry

    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, len(NAMES), rank == 0, timedelta(seconds=120))
    plan = Plan(generation=1, outer_step=1, attempt=0, members=NAMES, source=NAMES[0], contributors=NAMES)
    pg = make_group(store, plan, NAMES[rank], 0, 300.0)
    # with overlap the outer step's collectives run on a background thread: the bench's own (line-up, bare
    # all-reduce) go over a twin group of the same members, never beside them on one group
    own = pg if not args.overlap else make_group(
        store, Plan(generation=2, outer_step=1, attempt=0, members=NAMES, source=NAMES[0], contributors=NAMES),
        NAMES[rank], 0, 300.0)
    inner = BenchInner(args, rank)
    world = SimpleNamespace(rank=0, world_size=1, local_rank=0, hostname="bench", pid=os.getpid())
    cfg = DilocoConfig(enabled=True, inner_steps=args.inner_steps, compression=args.compression,
                       allreduce_timeout=300.0, **({"overlap": True} if args.overlap else {}))
    outer = DilocoOuter(cfg, MeshConfig(node_id=NAMES[rank]), world, inner, Telemetry(NAMES[rank], 0, json_out=_Null()),
                        config_digest="bench", mesh_factory=lambda _: AlwaysMesh(NAMES),
                        group_factory=lambda p, n, r: pg)
    numel = sum(p.numel() for p in inner.outer_params())
    bare = torch.zeros(numel * compression.bytes_per_element(args.compression) // 4, dtype=torch.float32)
    tick = torch.zeros(1)

    def line_up() -> None:
        own.allreduce([tick]).wait()

    progress = Progress()
    outer.start(progress)
    rows = []
    for _ in range(args.rounds + 1):
        _sync(inner.device)
        t0 = time.perf_counter()
        for _ in range(args.inner_steps):
            inner.train_step()
            progress.step += 1
        _sync(inner.device)
        compute = time.perf_counter() - t0
        if args.overlap and rows:  # the round before ran its outer step (hand-off, wire, ...) behind this one's
            rows[-1]["phases"] = dict(outer.last_phases)
        line_up()
        t0 = time.perf_counter()
        outer.after_inner_step(progress)
        _sync(inner.device)
        outer_s = time.perf_counter() - t0
        line_up()
        t0 = time.perf_counter()
        own.allreduce([bare]).wait()
        bare_s = time.perf_counter() - t0
        event = outer.last_outer_step or {}
        rows.append({"compute": compute, "outer": outer_s, "bare": bare_s,
                     "phases": dict(getattr(outer, "last_phases", {}) or {}),
                     # overlap: the wire runs behind the next round; all the boundary's time is overhead
                     "wire": 0.0 if args.overlap else event.get("wire_s", event.get("allreduce_s", 0.0)),
                     "background": event.get("outer_s", 0.0) if args.overlap else 0.0})
    if args.overlap:
        outer.flush()
        rows[-1]["phases"] = dict(outer.last_phases)
    outer.close("completed")
    return {"numel": numel, "rows": rows, "threads": torch.get_num_threads(), "device": str(inner.device)}


def report(result: dict, args) -> dict:
    rows = result["rows"]
    warm, timed = rows[0], rows[1:]
    med = {k: statistics.median(r[k] for r in timed) for k in ("compute", "outer", "bare", "wire", "background")}
    phase_names = list(dict.fromkeys(k for r in timed for k in r["phases"]))
    phases = {k: statistics.median(r["phases"].get(k, 0.0) for r in timed) for k in phase_names}
    handoff = warm["phases"].get("handoff", 0.0)
    r1 = (med["outer"] - med["wire"]) / med["compute"]
    r2 = med["outer"] / med["bare"]
    print(f"model {args.preset}: {result['numel']:,} parameters, {args.compression}, H {args.inner_steps}, "
          f"{len(NAMES)} nodes over gloo on loopback, device {result['device']}, {result['threads']} threads per "
          f"node, overlap {'on' if args.overlap else 'off'}, medians of {len(timed)} rounds")
    print(f"  {'inner steps (H)':24} {med['compute']:9.4f} s")
    print(f"  {'outer step':24} {med['outer']:9.4f} s   (wire {med['wire']:.4f} s)")
    print(f"  {'bare all-reduce':24} {med['bare']:9.4f} s")
    if args.overlap:
        print(f"  {'outer step in background':24} {med['background']:9.4f} s   (the previous round's, hidden)")
    print("  phases of the outer step:")
    for name, seconds in phases.items():
        print(f"    {name:22} {seconds:9.4f} s")
    print(f"    {'handoff (round 0)':22} {handoff:9.4f} s")
    out = {"preset": args.preset, "compression": args.compression, "H": args.inner_steps, "numel": result["numel"],
           "device": result["device"], "threads": result["threads"], "overlap": args.overlap, **med,
           "phases": phases, "handoff": handoff, "R1": r1, "R2": r2}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    per_step = med["compute"] / args.inner_steps
    print(f"  at H 50 (this run's step time, {per_step:.4f} s): outer overhead / round "
          f"{(med['outer'] - med['wire']) / (50 * per_step):.3f}")
    print(f"outer overhead / round {r1:.3f}; outer step / bare all-reduce {r2:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="15m")
    p.add_argument("--compression", default="int8", choices=("none", "bf16", "fp16", "int8"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up round")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // len(NAMES)),
                   help="torch threads per node (default: the cores shared evenly)")
    p.add_argument("--overlap", action="store_true", help="diloco.overlap = true (streaming outer step)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    results = run_ranks(worker, len(NAMES), args, what="node")
    if results is None:
        return 1
    report(results[0], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
