"""The weighted mean of the members' sparse messages (diloco.compression = "sparse"): an all-gather over pieces.

    message, sent = ef.encode()                                            # engine/outer/sparse.py
    stats = gather_mean(codec, message, weight, pg, out=mean, own=sent, exchange=ex)
    # mean = sum_i(w_i * decode(m_i)) / sum_i(w_i) over the members of weight > 0, the same bytes on every rank

A sum of sparse messages is not sparse (their supports differ), so there is nothing for a reduce-scatter to reduce:
every member's message goes to every other, and every rank decodes them all. On the same pieces machinery as the
dense codecs (allreduce.py):

    1. every rank lays out [its weight, fp32 | its message] (4 + M bytes; M = codec.bytes is the same on every
       member, the layout and the settings fix it) and cuts it into pieces of about PIECE_BYTES (at most
       MAX_PIECES), the last one shorter: nothing is padded, so the bytes counted are the bytes sent,
       (size - 1) x (4 + M) per rank;
    2. every receive is posted before the first send; then each piece goes to every peer in turn, starting with the
       next rank, so every link carries bytes both ways from the start (docs/performance.md, "Pieces");
    3. the first pieces, which hold the weights, are waited for first: W, the total weight of the contributors
       (an exact sum of the weights as they came over the wire, rounded once), is then known on every rank;
    4. the messages are waited for in rank order, and each is decoded, scaled by its sender's w_i / W and added in
       fp32 as soon as it is in (sparse.RankOrderedSum), this rank's own from its `Sent` (the same values, unpacked
       from nothing), while the later ones travel: the mean is added in rank order whatever order the bytes land
       in, and needs no pass over the whole buffer to divide it afterwards.

A member of weight 0 (a joiner, a node whose pseudo-gradient is not finite or which the sentinel left out) sends a
message of the same length (zeros, when it has none: `message=None`), so that every rank posts the same receives;
its message is never decoded. If every weight is 0 there is no mean: allreduce.NothingToAverage, raised on every
rank once all its messages are done.

Bit-identical on every rank: every rank adds the same products (a decoded value is one fp32 product, times the
sender's share w_i / W of the weights as they travelled, one product) in the same order into the same fp32 buffer.
The arrival order never enters. The collective runs through the group's own methods
(pg.send / pg.recv) and raises the backend's error as it comes (a RuntimeError): the caller decides whether the
outer step failed (engine/outer/exchange.py), and the group's timeout (diloco.allreduce_timeout) bounds each wait.

Where the work happens: the decode on the device of `out` (a GPU for CUDA runs); the wire's bytes in pinned host
buffers of the `Exchange`, allocated on first use and kept while the group's size and the codec stay the same.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.outer import allreduce
from engine.outer.allreduce import Exchange, NothingToAverage, ReduceStats, _landed
from engine.outer.sparse import RankOrderedSum, Sent, SparseCodec

_WEIGHT = 4  # the sender's weight, one fp32, ahead of its message


@dataclass(frozen=True)
class GatherPieces:
    """How one rank's [weight | message] of `length` bytes is cut: `pieces` pieces of `pc` bytes, the last one
    shorter (length - (pieces - 1) x pc > 0)."""
    length: int
    pieces: int
    pc: int

    def span(self, c: int) -> slice:
        return slice(c * self.pc, min(self.length, (c + 1) * self.pc))


def gather_pieces(codec: SparseCodec) -> GatherPieces:
    length = _WEIGHT + codec.bytes
    # read now: tests cut small ones; never so small that the first piece does not hold the whole weight
    pieces = max(1, min(allreduce.MAX_PIECES, -(-length // allreduce.PIECE_BYTES), length // _WEIGHT))
    pc = -(-length // pieces)
    pieces = -(-length // pc)  # a rounding up of pc may leave the last piece empty: fewer pieces then
    return GatherPieces(length, pieces, pc)


def bytes_sent(codec: SparseCodec, size: int) -> int:
    """What one rank puts on the wire for a gathered mean over `size` ranks (ReduceStats.bytes_sent): its weight and
    message to every other rank."""
    return 0 if size < 2 else (size - 1) * (_WEIGHT + codec.bytes)


def prepare(ex: Exchange, codec: SparseCodec, size: int) -> None:
    """Allocate and touch the wire's buffers now (as Exchange.prepare does for the dense codecs), so the first outer
    step faults in no fresh pages at a boundary."""
    if size >= 2:
        for name, shape in _buffers(codec, size):
            ex.buf(name, shape, torch.uint8, host=True).zero_()


def _buffers(codec: SparseCodec, size: int) -> list[tuple[str, tuple[int, ...]]]:
    n = _WEIGHT + codec.bytes
    return [("gather_send", (n,)), ("gather_recv", (size, n))]


def gather_mean(codec: SparseCodec, message: torch.Tensor | None, weight: float, pg: dist.ProcessGroup | None, *,
                out: torch.Tensor, own: Sent | None = None, exchange: Exchange | None = None) -> ReduceStats:
    """out = sum_i(w_i * decode(m_i)) / sum_i(w_i) over the group's members of weight > 0, bit-identical on every
    rank. `message`: this rank's encoded message (uint8, codec.bytes; None: zeros, for a member of weight 0);
    `own`: what its encode returned as Sent, decoded instead of its own bytes (the same values). pg None or of size
    1: nothing is sent. Raises allreduce.NothingToAverage when every weight is 0."""
    assert out.dtype == torch.float32 and out.numel() == codec.layout.padded, "out: a fp32 buffer of the layout"
    assert weight >= 0 and (message is not None or weight == 0), "a member of weight > 0 sends its message"
    assert message is None or (message.dtype == torch.uint8 and message.numel() == codec.bytes), \
        f"a message of {codec.bytes} bytes (uint8)"
    # the others read this weight as the fp32 it travels as: so must this rank, or totals differ in the last bits
    weight = struct.unpack("f", struct.pack("f", weight))[0]
    start = time.perf_counter()
    size = 1 if pg is None else pg.size()
    mine = own if own is not None else message
    if size == 1:
        acc = RankOrderedSum(codec, [weight], out)
        acc.arrive(0, mine if weight > 0 else None)
        total = _finish(acc)
        seconds = time.perf_counter() - start
        return ReduceStats(0, seconds, total, [weight], codec_s=seconds)
    assert pg is not None
    ex = exchange if exchange is not None else Exchange(out.device)
    rank, g = pg.rank(), gather_pieces(codec)
    peers = [(rank + i) % size for i in range(1, size)]
    recv = ex.buf("gather_recv", (size, g.length), torch.uint8, host=True)
    send = ex.buf("gather_send", (g.length,), torch.uint8, host=True)
    # every receive is posted before the first byte leaves: a piece lands in place whenever it arrives
    arrivals = {j: [pg.recv([recv[j, g.span(c)]], j, c) for c in range(g.pieces)] for j in peers}
    t0 = time.perf_counter()
    send[:_WEIGHT].copy_(_weight_bytes(weight))
    if message is None:
        send[_WEIGHT:].zero_()
    else:
        send[_WEIGHT:].copy_(message)  # device -> pinned host on a GPU (synchronous: gloo reads it next)
    codec_s = time.perf_counter() - t0
    sends = [pg.send([send[g.span(c)]], j, c) for c in range(g.pieces) for j in peers]
    weights = [weight] * size
    for j in peers:  # every weight rides in its message's first piece, the first to leave: the total is known early
        _landed(arrivals[j], 0)
        weights[j] = float(recv[j, :_WEIGHT].clone().view(torch.float32).item())  # an aligned copy of 4 bytes
    t0 = time.perf_counter()
    acc = RankOrderedSum(codec, weights, out)
    codec_s += time.perf_counter() - t0
    for j in range(size):  # rank order: the order the sum is added in, so waiting in it costs no decode time
        if j != rank:
            for c in range(1, g.pieces):
                _landed(arrivals[j], c)
        t0 = time.perf_counter()
        msg: torch.Tensor | Sent | None = mine
        if j != rank:
            msg = recv[j, _WEIGHT:]
            if weights[j] > 0 and msg.device != out.device:
                msg = ex.to_device("gather_msg", msg)
        acc.arrive(j, msg if weights[j] > 0 else None)
        codec_s += time.perf_counter() - t0
    for c in range(len(sends)):  # all of it, also when there is no mean
        _landed(sends, c)
    t0 = time.perf_counter()
    total = _finish(acc)
    if out.device.type == "cuda":
        torch.cuda.current_stream(out.device).synchronize()  # the result is complete when this returns
    codec_s += time.perf_counter() - t0
    seconds = time.perf_counter() - start
    return ReduceStats(bytes_sent(codec, size), seconds, total, weights, wire_s=seconds - codec_s, codec_s=codec_s)


def _weight_bytes(weight: float) -> torch.Tensor:
    return torch.frombuffer(bytearray(struct.pack("<f", weight)), dtype=torch.uint8)


def _finish(acc: RankOrderedSum) -> float:
    if not acc.total > 0:  # every rank read the same weights: every rank stops here, its messages all done
        raise NothingToAverage("every rank of the group has weight 0")
    return acc.finish()
