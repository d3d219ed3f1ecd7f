"""The codec, a part of the outer loop: what goes on the wire for a slice of the pseudo-gradient, and how it comes back.

    Dense("none" | "bf16" | "fp16" | "int8")   reduced: allreduce.weighted_mean's reduce-scatter and all-gather of
                                                pieces (allreduce.py); no state
    a gathered codec (GatheredCodec)            every member's message goes to every member (one all-gather,
                                                exchange.gathered_mean) and every rank decodes all of them into the
                                                weighted mean, in rank order (bit-identical on every rank)

A codec may hold state (error feedback: what it did not send stays for the next outer step). The outer step tells
it, in its story (diloco.py):

    codec.stage(pgrad, outer_step, attempt)   before each attempt's exchange: what this node sends (None: it sends
                                              nothing of its own, a joiner or a node not counted)
    codec.commit()                            the attempt committed and counted this node's pseudo-gradient
    codec.abort()                             it did not (aborted, left out by the sentinel, not counted, failed)

so a codec's state moves with the outer step and never with an attempt that did not count. A new codec is a class
with these methods, picked in build_codec (or given to the outer loop, as tests/test_outer_codec.py does).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from engine.outer.allreduce import COMPRESSIONS, Exchange


class Codec(Protocol):
    name: str  # diloco.compression
    gathers: bool  # True: messages all-gathered and decoded on every rank; False: reduced (weighted_mean)

    def prepare(self, exchange: Exchange, numel: int, size: int) -> None:
        """Allocate and touch the wire buffers of a mean of numel values over `size` members, before the first."""

    def stage(self, pgrad: torch.Tensor | None, outer_step: int, attempt: int) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class GatheredCodec(Codec, Protocol):
    def encode(self, send: torch.Tensor, weight: float) -> torch.Tensor:
        """This member's message for this attempt: a flat tensor of the same size and dtype on every member (send:
        the staged pseudo-gradient, or zeros of weight 0)."""

    def mean_into(self, messages: list[torch.Tensor], weights: list[float], out: torch.Tensor) -> None:
        """The weighted mean of every member's message (group-rank order) into out, the same bits on every rank."""


class Dense:
    """The reduced codecs of allreduce.py: no state, nothing staged."""

    gathers = False

    def __init__(self, name: str):
        if name not in COMPRESSIONS:
            raise ValueError(f"diloco.compression: unknown {name!r} (known: {', '.join(COMPRESSIONS)})")
        self.name = name

    def prepare(self, exchange: Exchange, numel: int, size: int) -> None:
        exchange.prepare(numel, size, self.name)

    def stage(self, pgrad: torch.Tensor | None, outer_step: int, attempt: int) -> None:
        pass

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


def build_codec(compression: str) -> Codec:
    """diloco.compression -> the part."""
    return Dense(compression)
