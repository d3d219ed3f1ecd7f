"""The codec, a part of the outer loop: what goes on the wire for a slice of the pseudo-gradient, and how it comes back.

    Dense("none" | "bf16" | "fp16" | "int8")   reduced: allreduce.weighted_mean's reduce-scatter and all-gather of
                                                pieces (allreduce.py); no state
    a gathered codec (GatheredCodec)            every member's message goes to every member and every rank decodes
                                                all of them into the weighted mean, in rank order (bit-identical on
                                                every rank): its own mean(), the collective included
    Sparse ("sparse")                           SparseLoCo (docs/sparse.md): the top-k of each chunk of an error-
                                                feedback accumulator, all-gathered on pieces (gather.py); its state
                                                is the accumulator, one per fragment of the cover

A codec may hold state (error feedback: what it did not send stays for the next outer step). The outer step tells
it, in its story (diloco.py):

    codec.stage(pgrad, outer_step, attempt)   before each attempt's exchange: what this node sends (None: it sends
                                              nothing of its own, a joiner or a node not counted)
    codec.commit()                            the attempt committed and counted this node's pseudo-gradient
    codec.abort()                             it did not (aborted, not counted, failed)
    codec.reject(pgrad)                       the sentinel left it out: the round it judged leaves the state too (a
                                              codec without state: as abort)
    codec.reset()                             the node takes the run's weights (a hand-off, a diverged round): the
                                              state it held belongs to weights the run no longer has
    codec.unsent(pgrad, outer_step)           the outer step ended without a commit (a stop, a failure) and its
                                              pseudo-gradient stays in the weights, sent with the next: what was
                                              staged of it is taken back (it must not be counted twice)

so a codec's state moves with the outer step and never with an attempt that did not count. Its state_dict() is
checkpointed with the outer state (under "codec", only when it is not empty). A new codec is a class
with these methods, picked in build_codec (or given to the outer loop, as tests/test_outer_codec.py does).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from engine.outer import gather
from engine.outer.allreduce import COMPRESSIONS, Exchange, ReduceStats
from engine.outer.sparse import ChunkLayout, ErrorFeedback, Sent, SparseCodec, SparseSpec


class Codec(Protocol):
    name: str  # diloco.compression
    gathers: bool  # True: messages all-gathered and decoded on every rank; False: reduced (weighted_mean)

    def prepare(self, exchange: Exchange, numel: int, size: int) -> None:
        """Allocate and touch the wire buffers of a mean of numel values over `size` members, before the first."""

    def stage(self, pgrad: torch.Tensor | None, outer_step: int, attempt: int) -> bool:
        """False: the state is not finite (reset): this node sends nothing of its own and takes the run's weights."""

    def commit(self) -> None: ...

    def abort(self) -> None: ...

    def reject(self, pgrad: torch.Tensor) -> None: ...

    def reset(self) -> None: ...

    def unsent(self, pgrad: torch.Tensor | None, outer_step: int) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """The codec's state for the node's checkpoint ({}: none, and nothing is written)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class GatheredCodec(Codec, Protocol):
    def mean(self, send: torch.Tensor, weight: float, pg: dist.ProcessGroup | None, *, out: torch.Tensor,
             wire: Exchange) -> ReduceStats:
        """The weighted mean of every member's message into out, the same bits on every rank: this member's
        message (of what was staged; weight 0: none of its own) to every member of pg and every member's decoded
        in rank order. Raises allreduce.NothingToAverage when every weight is 0."""


class Dense:
    """The reduced codecs of allreduce.py: no state, nothing staged."""

    gathers = False

    def __init__(self, name: str):
        if name not in COMPRESSIONS:
            raise ValueError(f"diloco.compression: unknown {name!r} (known: {', '.join(COMPRESSIONS)})")
        self.name = name

    def prepare(self, exchange: Exchange, numel: int, size: int) -> None:
        exchange.prepare(numel, size, self.name)

    def stage(self, pgrad: torch.Tensor | None, outer_step: int, attempt: int) -> bool:
        return True

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def reject(self, pgrad: torch.Tensor) -> None:
        pass

    def reset(self) -> None:
        pass

    def unsent(self, pgrad: torch.Tensor | None, outer_step: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Sparse:
    """diloco.compression = "sparse": one error-feedback accumulator per slice the cover exchanges (the whole model,
    or each fragment), its chunks laid over the parameters' pieces in that slice (a chunk never crosses one).

    Per outer step (docs/sparse.md, "The accumulator is the node's state"): e' = beta * e + pgrad is staged once,
    at the step's first attempt that counts this node; every attempt of that step encodes from e' (the same
    message); commit() takes what was sent out of it (e = e' - sent); abort() only marks the attempt: a retry
    encodes the same e' again, and a step that committed without this node leaves e = e' whole (the accumulator is
    released when the slice's next step is staged, or at a checkpoint). A node left out so sends its e', decayed by
    beta, at its next step, where it competes again for the chunks' k places.

    Overlap (docs/sparse.md, "Overlap"): eager's stand-in is own_share(), this node's own decoded message times its
    share of the coming mean, staged and encoded at the boundary (the step's attempts send that same message); a
    step that ends without a commit while its pseudo-gradient stays in the weights (a stop in flight, a failure) is
    taken back out of e by unsent(), since the next pseudo-gradient holds it again."""

    name = "sparse"
    gathers = True

    def __init__(self, spec: SparseSpec, numels: Sequence[int], spans: Sequence[tuple[int, int]],
                 fragment_of: Callable[[int], int], device: torch.device | str = "cpu"):
        self.spec, self.spans, self.fragment_of = spec, list(spans), fragment_of
        self.efs = [ErrorFeedback(SparseCodec(spec, ChunkLayout(slice_numels(numels, lo, hi), spec), device))
                    for lo, hi in self.spans]
        self._staged_at: list[int | None] = [None] * len(self.spans)  # the outer step each accumulator staged
        self._means: list[torch.Tensor | None] = [None] * len(self.spans)  # padded fp32 means, made on first use
        self._frag = 0  # the slice of the step under way
        self._sent: Sent | None = None  # what this attempt sent (None: nothing of its own)
        self._refused_at: list[int | None] = [None] * len(self.spans)  # the step whose e' was not finite (reset)
        # the message of the staged e' encoded at an overlapped boundary (own_share): (slice, step, message, sent)
        self._encoded: tuple[int, int, torch.Tensor, Sent] | None = None
        self._prepared: set[int] = set()

    def prepare(self, exchange: Exchange, numel: int, size: int) -> None:
        # called per slice in the cover's order (cover.exchanges()): the first slice of that size not yet prepared
        f = next(i for i, (lo, hi) in enumerate(self.spans) if hi - lo == numel and i not in self._prepared)
        self._prepared.add(f)
        gather.prepare(exchange, self.efs[f].codec, size)
        self._mean_buf(f)

    def _mean_buf(self, f: int) -> torch.Tensor:
        buf = self._means[f]
        if buf is None:
            codec = self.efs[f].codec
            buf = self._means[f] = torch.zeros(codec.layout.padded, dtype=torch.float32, device=codec.device)
        return buf

    def stage(self, pgrad: torch.Tensor | None, outer_step: int, attempt: int) -> bool:
        f = self._frag = self.fragment_of(outer_step)
        ef, self._sent = self.efs[f], None
        if ef.staged and self._staged_at[f] != outer_step:
            ef.abort()  # the slice's last step committed without this node: e = e' whole, nothing subtracted
        if pgrad is None or ef.staged:  # nothing of its own; or a retry: e' of this step's first attempt
            return True
        if self._refused_at[f] == outer_step:  # found not finite at its boundary (own_share): still refused
            return False
        if not ef.stage(pgrad):  # e' is not finite: e was reset; this node sends nothing (weight 0)
            self._refused_at[f] = outer_step
            return False
        self._staged_at[f] = outer_step
        return True

    @torch.no_grad()
    def own_share(self, pgrad: torch.Tensor, outer_step: int, share: float, out: torch.Tensor) -> torch.Tensor | None:
        """Eager overlap's stand-in for this node's part of the coming mean: its own message decoded, times `share`
        (its weight over the contributors' total), into out (the slice's size), as the gathered mean will add it:
        the same fp32 products. Stages e' = beta * e + pgrad for the step now, at the boundary, and keeps the
        message for the step's attempts (the same bytes). None: e' is not finite (reset; the step sends nothing)."""
        if not self.stage(pgrad, outer_step, 0):
            return None
        f, ef = self._frag, self.efs[self._frag]
        message, sent = ef.encode()
        self._encoded = (f, outer_step, message, sent)
        padded = self._mean_buf(f)  # free at a boundary: no exchange runs
        padded.zero_()
        ef.codec.decode_add(sent, padded, share)
        for v, o in zip(ef.codec.layout.views(padded), ef.codec.layout.split(out)):
            o.copy_(v.reshape(-1))
        return out

    @torch.no_grad()
    def unsent(self, pgrad: torch.Tensor | None, outer_step: int) -> None:
        """Outer step `outer_step` ended without a commit (stopped, failed) and its pseudo-gradient stays in the weights:
        the next step's holds it again, so e' is taken back to beta * e: e = (e' - pgrad) / beta (beta 0: e = 0,
        which no later step reads). Exact up to the rounding of e' (an ulp of it, which the next stage's beta
        multiplies back). Nothing staged for the step (a joiner's, a retry's before its stage): nothing to do."""
        f = self.fragment_of(outer_step)
        ef = self.efs[f]
        self._encoded = None
        if pgrad is None or not ef.staged or self._staged_at[f] != outer_step:
            return  # committed, or staged nothing of this step (e' of a step left out stays: it was not sent)
        beta = ef.spec.beta
        for e, d in zip(ef.layout.views(ef.e), ef.layout.split(pgrad)):
            e = e.view(-1)  # this tensor's values in e (its pads stay 0)
            e.sub_(d)
            if beta > 0:
                e.div_(beta)
            else:
                e.zero_()
        ef.abort()  # nothing staged: e holds e again
        self._staged_at[f] = None

    def mean(self, send: torch.Tensor, weight: float, pg: dist.ProcessGroup | None, *, out: torch.Tensor,
             wire: Exchange) -> ReduceStats:
        start = time.perf_counter()
        ef = self.efs[self._frag]
        message: torch.Tensor | None = None
        sent: Sent | None = None
        if weight > 0 and ef.staged:
            kept = self._encoded
            if kept is not None and kept[:2] == (self._frag, self._staged_at[self._frag]):
                message, sent = kept[2], kept[3]  # encoded at the boundary (own_share): the same bytes
            else:
                message, sent = ef.encode()
        encoded = time.perf_counter() - start
        padded = self._mean_buf(self._frag)
        stats = gather.gather_mean(ef.codec, message, weight if message is not None else 0.0, pg, out=padded,
                                   own=sent, exchange=wire)
        self._sent = sent
        t0 = time.perf_counter()
        layout = ef.codec.layout
        for v, o in zip(layout.views(padded), layout.split(out)):  # the pads dropped
            o.copy_(v.reshape(-1))
        stats.codec_s += encoded + time.perf_counter() - t0
        stats.seconds = stats.wire_s + stats.codec_s
        return stats

    def commit(self) -> None:
        ef = self.efs[self._frag]
        if self._sent is not None and ef.staged:
            ef.commit(self._sent)  # e = e' - sent (the dequantized values)
        self._sent, self._encoded = None, None

    def abort(self) -> None:
        self._sent = None  # e' stays staged: a retry sends it again (stage releases it at the next step)

    def reject(self, pgrad: torch.Tensor) -> None:
        """The sentinel left this node out of the committed step: the round it judged must not reach the run a
        step later either. e = e' - pgrad (beta * e: the residual of the rounds that passed), nothing sent. Kept
        whole, e' would carry the rejected round into the next message, decayed by beta only, past a sentinel that
        judges that round's clean pseudo-gradient (a x100 round sent 45x a clean message one step later:
        tests/test_sparse_elastic.py)."""
        f, self._sent = self._frag, None
        ef = self.efs[f]
        if ef.staged and self._staged_at[f] is not None:
            for v, d in zip(ef.layout.views(ef.e), ef.layout.split(pgrad)):
                v.sub_(d.view_as(v))
            ef.abort()  # released: e is the node's accumulator again
            self._staged_at[f] = None

    def reset(self) -> None:
        for ef in self.efs:
            ef.reset()
        self._staged_at = [None] * len(self.spans)
        self._refused_at = [None] * len(self.spans)
        self._sent, self._encoded = None, None

    def norms(self, agreed: torch.Tensor) -> tuple[float, float]:
        """(||e||^2 over every slice, ||agreed||^2 over the same values): this rank's share of the event's
        residual_norm and weights_norm."""
        return sum(ef.norm() ** 2 for ef in self.efs), float(torch.linalg.vector_norm(agreed)) ** 2

    def state_dict(self) -> dict[str, Any]:
        for ef in self.efs:
            if ef.staged:
                ef.abort()  # a step that ended without this node: e' is its accumulator
        self._staged_at = [None] * len(self.spans)
        return {"compression": self.name, "spans": [list(s) for s in self.spans],
                "accumulators": [ef.state_dict() for ef in self.efs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        spans = [tuple(s) for s in state.get("spans", [])]
        if state.get("compression") != self.name or spans != self.spans:
            raise ValueError(f"outer state: the checkpoint's codec state is of compression "
                             f"{state.get('compression')!r} over slices {spans}; this node's is {self.name!r} over "
                             f"{self.spans} (another model, worker count or diloco.fragments)")
        for ef, sd in zip(self.efs, state["accumulators"]):
            ef.load_state_dict(sd)
        self._staged_at = [None] * len(self.spans)


def slice_numels(numels: Sequence[int], lo: int, hi: int) -> list[int]:
    """The sizes of the parameters' pieces within [lo, hi) of their flat concatenation."""
    out, at = [], 0
    for n in numels:
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out.append(b - a)
        at += n
    return out


def build_codec(cfg: Any, numels: Sequence[int] = (), spans: Sequence[tuple[int, int]] = (),
                fragment_of: Callable[[int], int] = lambda step: 0, device: torch.device | str = "cpu") -> Codec:
    """diloco.* -> the part. Sparse needs the parameters' sizes (numels), the slices the cover exchanges (spans)
    and which slice an outer step covers (fragment_of)."""
    if cfg.compression == "sparse":
        return Sparse(SparseSpec.of(cfg), numels, spans, fragment_of, device)
    return Dense(cfg.compression)
