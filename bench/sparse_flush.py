"""What the unsent residuals are worth at a sparse run's end (issue 43, item 3; docs/sparse.md, "The run's end").

    python bench/sparse_flush.py --seeds 1337,7 --sparse-h 5,20     # the study's scale (bench/learning.py --sparse)

With diloco.compression = "sparse" each node ends the run holding its accumulator e: what it trained and never
sent. The final model (the agreed weights every node exports) leaves it out. This trains the sparse arm of
`bench/learning.py --engine sim --sparse` (the codec's own parts, the shipped settings, 4 nodes) at each H and seed,
then evaluates the final model three ways on the study's held-out batches:

    kept     the agreed weights, as the engine ends
    dense    after one more outer step of the nodes' residuals in fp32: snapshot - outer_lr x the token-weighted
             mean of e over the nodes (every unsent value, 4 bytes each: the cost of one dense outer step)
    sparse   after one more sparse outer step with nothing trained (delta 0: each node sends the top k of beta x e,
             the bytes of any sparse outer step)

Last line: `flush/kept eval-loss ratio: dense D, sparse S` (the mean over every H and seed of each ratio).
Other flags are bench/learning.py's (--data, --steps, --density, ...)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning  # noqa: E402 - bench/learning.py, beside this file


def measure(args, arm) -> dict[str, float]:
    """Train `arm` (a sparse arm of learning.sparse_arms) with learning.run_sim and evaluate the three models."""
    import torch

    made: list = []

    class Recorded(learning.SimSparse):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    plain_eval, got = learning.eval_model, {}

    def final_eval(model, evals, eval_args) -> float:  # eval_interval 0: the run's one eval, on its final model
        params = list(model.parameters())
        agreed = torch.nn.utils.parameters_to_vector(params).detach().clone()
        sim = made[-1]
        got["kept"] = plain_eval(model, evals, eval_args)
        residual = torch.stack([sim.layout.unpack(ef.e) for ef in sim.feedback]).mean(0)  # equal tokens per node
        torch.nn.utils.vector_to_parameters(agreed - arm.outer_lr * residual, params)
        got["dense"] = plain_eval(model, evals, eval_args)
        mean = sim.mean([torch.zeros_like(agreed)] * len(sim.feedback), [1.0] * len(sim.feedback))
        torch.nn.utils.vector_to_parameters(agreed - arm.outer_lr * mean, params)
        got["sparse"] = plain_eval(model, evals, eval_args)
        got["residual/weights"] = float(residual.norm() / agreed.norm())
        torch.nn.utils.vector_to_parameters(agreed, params)
        return got["kept"]

    learning.SimSparse, learning.eval_model = Recorded, final_eval
    try:
        learning.run_sim(args, arm)
    finally:
        learning.SimSparse, learning.eval_model = Recorded.__mro__[1], plain_eval
    return got


def main(argv: list[str] | None = None) -> int:
    args = learning.parse_args(["--engine", "sim", "--sparse", *(argv if argv is not None else sys.argv[1:])])
    args.eval_interval = 0
    ratios: dict[str, list[float]] = {"dense": [], "sparse": []}
    for seed in args.seeds:
        args.seed = seed
        for arm in learning.sparse_arms(args):
            if arm.sparse is None:
                continue
            if args.steps % arm.inner_steps:
                raise SystemExit(f"sparse_flush: --steps {args.steps} is not a multiple of H = {arm.inner_steps} "
                                 f"(the final model must be the agreed weights)")
            got = measure(args, arm)
            for k in ratios:
                ratios[k].append(got[k] / got["kept"])
            print(f"{arm.name} seed {seed}: eval loss kept {got['kept']:.4f}, dense flush {got['dense']:.4f}, "
                  f"sparse flush {got['sparse']:.4f}; ||mean e|| / ||weights|| {got['residual/weights']:.4f}",
                  flush=True)
    print(f"flush/kept eval-loss ratio: dense {statistics.fmean(ratios['dense']):.4f}, "
          f"sparse {statistics.fmean(ratios['sparse']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
