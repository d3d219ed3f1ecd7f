"""The weighted mean of one flat fp32 tensor across a process group, optionally compressed on the wire.

    mean, stats = weighted_mean(flat, weight, pg, "int8", out=buf, exchange=ex)   # sum_i(w_i x_i) / sum_i(w_i)

One algorithm for every compression, so the bytes counted are the bytes sent (INTELLECT-1's int8 all-reduce):

    1. every rank scales its tensor by its weight and cuts it into `size` equal chunks, each of equal pieces
       (padded; a piece is one message of about PIECE_BYTES); what it sends is scaled by weight / 2^k in [1, 2)
       instead (`_unit`), and the owner multiplies by the exact 2^k back: weights are tokens (millions), and
       fp16 overflows past 65504;
    2. reduce-scatter: piece c of chunk j goes, encoded, to rank j; the codec encodes a batch of pieces while the
       batches before it are on the wire;
    3. rank j sums the pieces of its chunk as they arrive, in fp32 (accumulation is never compressed; its own part
       exactly, the others' decoded in rank order), divides by the total weight and encodes each reduced piece
       once more;
    4. all-gather: every rank sends its reduced pieces to every other; every rank decodes all of them as they
       arrive, the owner its own as well.

The messages are gloo send/recv of the pieces, every receive posted before the first send. Two collectives
(all_to_all, then all_gather) moved the same bytes at 50-60 % of a shaped link's rate: one large message each way
between two hosts leaves the link half idle over gloo's TCP pairs, and pieces keep both directions busy
(docs/performance.md, "Pieces").

For "none" the same mean is one gloo all-reduce (sum) of the scaled tensor with every rank's weight appended
(`_allreduce_mean`): no codec, one collective, the wire cost of a ring all-reduce (gloo's ring already runs at the
link's rate). A GPU node takes this path too, through pinned host memory: every rank of a run must run the same
collectives, and a run may mix CPU and GPU nodes. Every number rounds alike on both, so a mean is the same bytes
whatever the devices: the products by a weight (or by weight / 2^k, a codec's pieces; the owner's x 2^k back is
exact) are one correctly rounded multiplication on either; int8's scale is a multiplication; and the divisions by
the total divide by a tensor on the device. CUDA divides a tensor by a Python number as a multiplication by its
reciprocal, which rounds otherwise; the CPU divides (tests/test_outer_buffers.py, tests/test_gpu.py).

Step 4 makes the result bit-identical on every rank: each piece is reduced once, by one owner, and all ranks
decode the very same bytes. Per rank the wire carries 2 * (size-1)/size * numel * bytes_per_element, as a ring
all-reduce would: 4 bytes for "none", 2 for bf16/fp16, 1 (+ 8 per piece of scale/offset) for int8, plus the
sender's weight (4 bytes on each of its reduce-scatter pieces: there are no other messages).

int8 is uniform 256-bin quantization per piece: q = round((x - lo) / scale), scale = (hi - lo) / 255. Its
absolute error per element is at most scale / 2 for each of the two quantizations (the owner's own part is not
quantized on its way in).

Where the work happens: the codec runs on the device of `flat` (on a GPU for CUDA runs), so only the encoded
bytes cross to the host, through pinned host buffers; gloo moves host bytes. Every buffer comes from an
`Exchange`, allocated on first use and reused while the group size and codec stay the same, so an outer step
allocates nothing of the model's size. The result is written into `out` (which may be `flat` itself).

The process group is used through its own methods (`pg.send(...)`, `pg.recv(...).wait()`), which works for the
per-generation groups built from a store and raises the backend's real error text ("Connection closed by
peer") as a RuntimeError. This module never catches it: the caller decides whether an outer step failed.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

COMPRESSIONS = ("none", "bf16", "fp16", "int8")
# The collectives an outer step runs, as a version: it is part of the mesh digest, so that engines of versions
# whose collectives differ are refused at start-up ("config digest differs") instead of deadlocking in a
# mismatched collective (2: "none" on the host became one all-reduce; 3: the codecs' pieces over send/recv; 4: the
# hand-off's fingerprint check follows plan.forming, two fingerprints per member; 5: "none" on a GPU as on the
# host, one all-reduce, and the pieces scaled by weight / 2^k; 6: the sentinel's rows carry each member's tokens
# and the verdict judges norms per token: engines of 5 would leave out other members; 7: the digest carries the
# inner strategy, /sS, and an engine without it is refused as of another wire protocol, which says why; 8:
# compression "sparse", its messages all-gathered (engine/outer/gather.py): an engine of 7 knows no such setting).
WIRE_PROTOCOL = 8
_META = 8  # int8: (scale, offset) per chunk, two fp32 = 8 bytes
_WEIGHT = 4  # the sender's weight, one fp32
# One message on the wire. A transfer of one large message each way between two hosts moves at about half the
# link's rate over gloo's TCP pairs; pieces of 64 KiB keep both directions of a shaped link busy (bench/wan.py)
PIECE_BYTES = 64 * 1024
MAX_PIECES = 512  # per chunk: bounds the messages (and the Python per message) of a large model's outer step
BATCH_PIECES = 16  # pieces the host codec encodes or decodes in one go (1 MiB of int8), while the others travel


class NothingToAverage(Exception):
    """Every rank of the mean had weight 0 (no rank contributed). Not a RuntimeError: the caller must not take it for
    a broken collective and retry it (engine/outer/diloco.py: every member's round diverged)."""


@dataclass
class ReduceStats:
    bytes_sent: int  # payload + metadata this rank put on the wire
    seconds: float  # wire_s + codec_s
    total_weight: float
    weights: list[float]  # every rank's weight as it came over the wire, in group-rank order
    wire_s: float = 0.0  # inside the collectives (waits for the peers included)
    codec_s: float = 0.0  # encode, decode, the fp32 sums and the copies between device and host


class Exchange:
    """The scratch buffers of weighted_mean on one device, kept between calls. On a CUDA device the buffers the
    wire reads and writes are pinned host memory, so the copies to and from the device are plain DMA."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, *, host: bool = False) -> torch.Tensor:
        """A buffer of this shape, reused when the last one under `name` had the same shape and dtype."""
        key = f"{name}@host" if host and not self.on_host else name
        t = self._bufs.get(key)
        if t is None or t.shape != torch.Size(shape) or t.dtype != dtype:
            if key.endswith("@host"):
                t = torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
            else:
                t = torch.empty(shape, dtype=dtype, device=self.device)
            self._bufs[key] = t
        return t

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._bufs.values())

    def prepare(self, numel: int, size: int, compression: str) -> None:
        """Allocate and touch, now, every buffer a weighted mean of `numel` values over `size` ranks takes from here
        on the host, so that the first one does not fault in fresh pages at a boundary, where every member waits
        for the slowest (a first touch of a 15m model's 80 MB of wire buffers took 0.05 s of the run's first
        outer step; docs/performance.md). Beside a GPU that is the pinned host memory the wire reads and writes
        (pinning is slower still); the device's scratch comes from the caching allocator at first use."""
        if size < 2 or compression == "sparse":  # sparse: engine/outer/gather.py's prepare, sized by its codec
            return
        specs: list[tuple[str, tuple[int, ...], torch.dtype, bool]]  # name, shape, dtype, on the wire
        if compression == "none":
            specs = [("sum", (numel + size,), torch.float32, True)]
        else:  # the last field: the wire's bytes, pinned host memory beside a GPU
            g = _pieces(numel, size, compression, self.device)
            coded = g.width + g.meta
            specs = [("scaled", (g.batch, g.pc), torch.float32, False), ("part", (g.batch, g.pc), torch.float32, False),
                     ("acc", (g.pieces, g.pc), torch.float32, False), ("mine", (g.pieces, coded), torch.uint8, True),
                     ("send", (g.size, g.pieces, coded + _WEIGHT), torch.uint8, True),
                     ("recv", (g.size, g.pieces, coded + _WEIGHT), torch.uint8, True),
                     ("rows", (g.size, g.pieces, coded), torch.uint8, True)]
        for name, shape, dtype, wire in specs:
            if self.on_host or wire:
                self.buf(name, shape, dtype, host=wire).zero_()

    def to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.on_host:
            return t
        host = self.buf(name, tuple(t.shape), t.dtype, host=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # gloo reads the host bytes next
        return host

    def to_device(self, name: str, host: torch.Tensor) -> torch.Tensor:
        if self.on_host:
            return host
        t = self.buf(name, tuple(host.shape), host.dtype)
        t.copy_(host, non_blocking=True)  # ordered before the decode kernels on the same stream
        return t


def encode_into(dst: torch.Tensor, rows: torch.Tensor, compression: str, work: torch.Tensor | None = None) -> None:
    """Encode fp32 rows [k, c] into the byte rows dst [k, width (+ 8 int8 metadata)]. int8 needs fp32 scratch of
    the rows' shape: `work` (which may be `rows` itself), by default `rows`, which it then clobbers."""
    assert rows.dtype == torch.float32 and rows.dim() == 2 and dst.dtype == torch.uint8
    k, c = rows.shape
    if compression == "none":
        dst[:, :4 * c].copy_(rows.view(torch.uint8))
    elif compression in ("bf16", "fp16"):
        dst[:, :2 * c].view(_half(compression)).copy_(rows)
    elif compression == "int8":
        # two plain reductions: on CPU torch.aminmax over dim 1 of a few long rows runs ~4x slower
        lo, hi = rows.amin(dim=1, keepdim=True), rows.amax(dim=1, keepdim=True)
        # times the reciprocal, not / 255: CUDA divides a tensor by a Python number as a multiplication by its
        # reciprocal and the CPU divides, so a CPU node and a GPU node would put other bytes on the wire
        scale = (hi - lo) * (1.0 / 255.0)
        # a constant chunk: any scale decodes it exactly (q = 0)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        # q = round((x - lo) / scale), in the scratch rows, then narrowed into dst
        work = rows if work is None else work
        dst[:, :c].copy_(torch.sub(rows, lo, out=work).div_(scale).round_().clamp_(0, 255))
        dst[:, c:c + _META].copy_(torch.cat([scale, lo], dim=1).view(torch.uint8))
    else:
        raise ValueError(f"compression: unknown {compression!r} (known: {', '.join(COMPRESSIONS)})")


def _f32(columns: torch.Tensor) -> torch.Tensor:
    """Byte columns [k, 4n] as fp32 [k, n], through an aligned copy: a slice of one row (k = 1, an odd int8 chunk)
    is already contiguous, so .contiguous() would keep its byte offset, which a float view refuses."""
    out = torch.empty(columns.shape[0], columns.shape[1] // 4, dtype=torch.float32, device=columns.device)
    out.view(torch.uint8).copy_(columns)
    return out


def decode_into(dst: torch.Tensor, src: torch.Tensor, compression: str, *, meta_at: int | None = None) -> None:
    """Inverse of encode_into: byte rows src [k, >= width] -> fp32 dst [k, c]. int8 reads its scale/offset at
    byte column meta_at of src (default: right after the c payload bytes)."""
    k, c = dst.shape
    if compression == "none":
        dst.copy_(src[:, :4 * c].view(torch.float32))
    elif compression in ("bf16", "fp16"):
        dst.copy_(src[:, :2 * c].view(_half(compression)))
    else:
        assert compression == "int8"
        at = c if meta_at is None else meta_at
        meta = _f32(src[:, at:at + _META])
        # q * scale + offset; the exact uint8 -> fp32 copy first: the mixed-dtype mul is ~2x slower on CPU
        dst.copy_(src[:, :c]).mul_(meta[:, :1]).add_(meta[:, 1:])


def encode(rows: torch.Tensor, compression: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[k, c] fp32 -> (uint8 payload [k, bytes], fp32 metadata [k, 2] or None); allocates (tests, tools)."""
    k, c = rows.shape
    width = c * bytes_per_element(compression)
    out = torch.empty(k, width + (_META if compression == "int8" else 0), dtype=torch.uint8, device=rows.device)
    encode_into(out, rows.clone(), compression)
    if compression != "int8":
        return out, None
    return out[:, :width].contiguous(), _f32(out[:, width:])


def decode(payload: torch.Tensor, meta: torch.Tensor | None, compression: str) -> torch.Tensor:
    """Inverse of encode: uint8 payload [k, bytes] (+ metadata) -> fp32 [k, c]; allocates."""
    k, width = payload.shape
    src = payload if meta is None else torch.cat([payload, meta.contiguous().view(torch.uint8)], dim=1)
    dst = torch.empty(k, width // bytes_per_element(compression), dtype=torch.float32, device=payload.device)
    decode_into(dst, src, compression)
    return dst


def bytes_per_element(compression: str) -> int:
    return {"none": 4, "bf16": 2, "fp16": 2, "int8": 1}[compression]


def _half(compression: str) -> torch.dtype:
    return torch.bfloat16 if compression == "bf16" else torch.float16


@dataclass
class _Pieces:
    """How the mean is cut up: `size` chunks (chunk j is reduced by rank j), each of `pieces` pieces of `pc`
    elements (the last ones padded with zeros). A piece is one message on the wire and has its own int8
    scale/offset; the codec works on batches of `batch` pieces."""
    numel: int
    size: int
    pieces: int
    pc: int
    width: int  # a piece's payload bytes
    meta: int  # a piece's codec metadata bytes (int8: scale, offset)
    batch: int

    def span(self, chunk: int, c0: int, c1: int) -> tuple[int, int]:
        """The elements of pieces c0..c1-1 of a chunk, clipped to the tensor (empty past its end)."""
        a = (chunk * self.pieces + c0) * self.pc
        return min(a, self.numel), min(a + (c1 - c0) * self.pc, self.numel)

    def batches(self):
        return ((c, min(c + self.batch, self.pieces)) for c in range(0, self.pieces, self.batch))


def bytes_sent(numel: int, size: int, compression: str, device: torch.device | str = "cpu") -> int:
    """What one rank puts on the wire for a mean of `numel` values over `size` ranks (ReduceStats.bytes_sent)."""
    if size == 1:
        return 0
    if compression == "none":  # one ring all-reduce of values + weights, on every device
        return 2 * (size - 1) * -(-(numel + size) // size) * 4
    g = _pieces(numel, size, compression, torch.device(device))
    return (size - 1) * g.pieces * (2 * (g.width + g.meta) + _WEIGHT)


def _unit(weight: float) -> float:
    """The power of two 2^k with weight / 2^k in [1, 2) (1 for weight 0): a rank's pieces travel scaled by
    weight / 2^k, near the pseudo-gradient's own size, and the owner's product by 2^k is exact. Weights are the
    tokens of a round, and the pseudo-gradient times millions put fp16 past its 65504 (inf on the wire)."""
    return math.ldexp(1.0, math.frexp(weight)[1] - 1) if weight > 0 else 1.0


def _pieces(numel: int, size: int, compression: str, device: torch.device) -> _Pieces:
    bpe = bytes_per_element(compression)
    chunk = -(-numel // size)
    pieces = max(1, min(MAX_PIECES, -(-chunk * bpe // PIECE_BYTES)))
    pc = -(-chunk // pieces)
    # on the host the codec runs batch by batch while earlier pieces are on the wire; a device codec is fast
    # enough to encode everything at once (one copy to the pinned host buffer)
    batch = BATCH_PIECES if device.type == "cpu" else pieces
    return _Pieces(numel, size, pieces, pc, pc * bpe, _META if compression == "int8" else 0, batch)


@dataclass
class _Job:
    """One weighted mean in flight: its buffers, its messages and its codec time."""
    pg: dist.ProcessGroup
    flat: torch.Tensor
    weight: float
    out: torch.Tensor
    compression: str
    ex: Exchange
    geo: _Pieces
    peers: list[int]
    codec_s: float = 0.0
    total: float = 0.0
    weights: list[float] = field(default_factory=list)

    def scaled(self, chunk: int, c0: int, c1: int, factor: float) -> torch.Tensor:
        """This rank's pieces c0..c1-1 of a chunk times factor, fp32 rows [c1-c0, pc] in scratch."""
        g = self.geo
        rows = self.ex.buf("scaled", (g.batch, g.pc), torch.float32)[:c1 - c0]
        a, b = g.span(chunk, c0, c1)
        torch.mul(self.flat[a:b], factor, out=rows.view(-1)[:b - a])
        rows.view(-1)[b - a:].zero_()
        return rows

    def host(self, name: str, dev: torch.Tensor, index: tuple) -> torch.Tensor:
        """The host bytes the wire sends for dev[index] (dev itself on a CPU)."""
        if self.ex.on_host:
            return dev[index]
        host = self.ex.buf(name, tuple(dev.shape), dev.dtype, host=True)
        host[index].copy_(dev[index], non_blocking=True)
        torch.cuda.current_stream(self.ex.device).synchronize()  # gloo reads the host bytes next
        return host[index]

    def device(self, name: str, host: torch.Tensor, index: tuple) -> torch.Tensor:
        """host[index] where the codec runs (host itself on a CPU)."""
        if self.ex.on_host:
            return host[index]
        dev = self.ex.buf(name, tuple(host.shape), host.dtype)
        dev[index].copy_(host[index], non_blocking=True)  # ordered before the decode kernels on the same stream
        return dev[index]


def _reduce_scatter(job: _Job) -> None:
    """Rank r sends pieces of chunk j to rank j, encoded batch by batch while the earlier ones are on the wire, and
    sums the pieces of its own chunk as they arrive (fp32, its own exactly, the others' decoded in rank order),
    divides by the total weight and encodes them once more into the "mine" rows for the all-gather."""
    pg, g, ex, rank = job.pg, job.geo, job.ex, job.pg.rank()
    row = g.width + g.meta + _WEIGHT
    send = ex.buf("send", (g.size, g.pieces, row), torch.uint8)
    recv = ex.buf("recv", (g.size, g.pieces, row), torch.uint8, host=True)
    # every receive is posted before the first byte leaves: a piece lands in place whenever it arrives
    arrivals = {j: [pg.recv([recv[j, c]], j, c) for c in range(g.pieces)] for j in job.peers}
    t0 = time.perf_counter()
    send[:, :, g.width + g.meta:].copy_(torch.full((1, 1, 1), float(job.weight), device=send.device)
                                        .view(torch.uint8).expand(g.size, g.pieces, _WEIGHT))
    job.codec_s += time.perf_counter() - t0
    sends = []
    sent_factor = job.weight / _unit(job.weight)  # exact: a power of two divides it
    for c0, c1 in g.batches():
        for j in job.peers:
            t0 = time.perf_counter()
            rows = job.scaled(j, c0, c1, sent_factor)
            encode_into(send[j, c0:c1], rows, job.compression, work=rows)
            wire = job.host("send", send, (j, slice(c0, c1)))
            job.codec_s += time.perf_counter() - t0
            sends += [pg.send([wire[c - c0]], j, c) for c in range(c0, c1)]
    for j in job.peers:  # every sender's weight rides on each of its pieces: the first one tells
        _landed(arrivals[j], 0)
    job.weights = [job.weight if i == rank else float(_f32(recv[i, 0, g.width + g.meta:][None]).item())
                   for i in range(g.size)]
    job.total = float(sum(job.weights))
    if job.total > 0:
        acc = ex.buf("acc", (g.pieces, g.pc), torch.float32)
        part = ex.buf("part", (g.batch, g.pc), torch.float32)
        mine = ex.buf("mine", (g.pieces, g.width + g.meta), torch.uint8)
        total = torch.tensor(job.total, dtype=torch.float32, device=acc.device)  # a true division on CUDA too
        for c0, c1 in g.batches():
            for j in job.peers:
                for c in range(c0, c1):
                    _landed(arrivals[j], c)
            t0 = time.perf_counter()
            acc[c0:c1].copy_(job.scaled(rank, c0, c1, job.weight))
            for j in sorted(job.peers):
                decode_into(part[:c1 - c0], job.device("recv", recv, (j, slice(c0, c1))), job.compression,
                            meta_at=g.width)
                # times 2^k, exact: the sum is the one of the weighted tensors, bit for bit
                acc[c0:c1].add_(part[:c1 - c0], alpha=_unit(job.weights[j]))
            acc[c0:c1].div_(total)
            encode_into(mine[c0:c1], acc[c0:c1], job.compression)
            job.codec_s += time.perf_counter() - t0
    for ws in list(arrivals.values()) + [sends]:  # all of it, also when there is no mean
        for c in range(len(ws)):
            _landed(ws, c)
    if not job.total > 0:  # every rank reads the same weights, so every rank stops here, its messages all done
        raise NothingToAverage("every rank of the group has weight 0")


def _all_gather(pg: dist.ProcessGroup, job: _Job) -> None:
    """Every rank sends its reduced pieces to every other and decodes the pieces of every chunk as they arrive, its
    own too: all ranks decode the very same bytes. (One step of its own: the end-to-end tests kill or freeze a node
    here, after the reduce-scatter and before the all-gather; keep it a module-level function.)"""
    g, ex, rank = job.geo, job.ex, pg.rank()
    rows = ex.buf("rows", (g.size, g.pieces, g.width + g.meta), torch.uint8, host=True)
    tag = g.pieces  # the all-gather's tags follow the reduce-scatter's
    arrivals = {j: [pg.recv([rows[j, c]], j, tag + c) for c in range(g.pieces)] for j in job.peers}
    mine = ex.buf("mine", (g.pieces, g.width + g.meta), torch.uint8)
    t0 = time.perf_counter()
    wire = job.host("mine", mine, (slice(None),))
    job.codec_s += time.perf_counter() - t0
    sends = [pg.send([wire[c]], j, tag + c) for c in range(g.pieces) for j in job.peers]
    for chunk in [rank] + job.peers:
        for c0, c1 in g.batches():
            if chunk != rank:
                for c in range(c0, c1):
                    _landed(arrivals[chunk], c)
            t0 = time.perf_counter()
            src = mine[c0:c1] if chunk == rank else job.device("rows", rows, (chunk, slice(c0, c1)))
            _decode_span(job, chunk, c0, c1, src)
            job.codec_s += time.perf_counter() - t0
    for c in range(len(sends)):
        _landed(sends, c)


def _landed(works: list, i: int) -> None:
    """Wait for message i of a list once (a gloo send/recv waited twice waits for a second message that never
    comes); None marks it done."""
    if works[i] is not None:
        works[i].wait()
        works[i] = None


def _decode_span(job: _Job, chunk: int, c0: int, c1: int, src: torch.Tensor) -> None:
    """Decode pieces c0..c1-1 of a chunk into out, the whole pieces in place and a last partial one through part."""
    g = job.geo
    a, b = g.span(chunk, c0, c1)
    whole = (b - a) // g.pc
    if whole:
        decode_into(job.out[a:a + whole * g.pc].view(whole, g.pc), src[:whole], job.compression, meta_at=g.width)
    if a + whole * g.pc < b:
        last = job.ex.buf("part", (g.batch, g.pc), torch.float32)[:1]
        decode_into(last, src[whole:whole + 1], job.compression, meta_at=g.width)
        job.out[a + whole * g.pc:b].copy_(last[0, :b - a - whole * g.pc])


def _check(flat: torch.Tensor, weight: float, compression: str, out: torch.Tensor | None) -> None:
    assert compression != "sparse", "sparse messages are gathered, not reduced: engine/outer/gather.py"
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: unknown {compression!r} (known: {', '.join(COMPRESSIONS)})")
    assert flat.dtype == torch.float32 and flat.dim() == 1
    assert out is None or (out.shape == flat.shape and out.dtype == flat.dtype and out.device == flat.device)
    assert weight >= 0


def weighted_mean(flat: torch.Tensor, weight: float, pg: dist.ProcessGroup | None, compression: str = "none", *,
                  out: torch.Tensor | None = None, exchange: Exchange | None = None
                  ) -> tuple[torch.Tensor, ReduceStats]:
    """sum_i(weight_i * flat_i) / sum_i(weight_i) over the group, on every rank, written into `out` (a new tensor
    when None; `out` may be `flat`). flat may live on any device; the wire carries host bytes.

    A rank of weight 0 (a joiner) takes part in the collectives but adds nothing. At least one rank must have a
    positive weight. pg None or of size 1: no communication and no compression (nothing is sent)."""
    _check(flat, weight, compression, out)
    # the others see this weight as the fp32 it travels as: so must this rank, or past 2^24 tokens the ranks'
    # weights and totals (and the chunks' divisors) differ in the last bits
    weight = struct.unpack("f", struct.pack("f", weight))[0]
    start = time.perf_counter()
    out = torch.empty_like(flat) if out is None else out
    size = 1 if pg is None else pg.size()
    if size == 1:
        if not weight > 0:
            raise NothingToAverage("a single rank of weight 0 has nothing to average")
        if out.data_ptr() != flat.data_ptr():
            out.copy_(flat)
        return out, ReduceStats(0, time.perf_counter() - start, weight, [weight],
                                codec_s=time.perf_counter() - start)
    assert pg is not None
    ex = exchange if exchange is not None else Exchange(flat.device)
    if compression == "none":  # on every rank alike: a CPU node and a GPU node of one run meet in one collective
        return _allreduce_mean(flat, weight, pg, ex, out, start)
    rank = pg.rank()
    job = _Job(pg, flat, weight, out, compression, ex, _pieces(flat.numel(), size, compression, flat.device),
               [(rank + i) % size for i in range(1, size)])
    _reduce_scatter(job)
    _all_gather(pg, job)
    if ex.device.type == "cuda":
        torch.cuda.current_stream(ex.device).synchronize()  # the result is complete when this returns
    sent = bytes_sent(flat.numel(), size, compression, flat.device)
    seconds = time.perf_counter() - start
    return out, ReduceStats(sent, seconds, job.total, job.weights, wire_s=seconds - job.codec_s,
                            codec_s=job.codec_s)


def _allreduce_mean(flat: torch.Tensor, weight: float, pg: dist.ProcessGroup, ex: Exchange, out: torch.Tensor,
                    start: float) -> tuple[torch.Tensor, ReduceStats]:
    """compression "none": one gloo all-reduce (sum) of [weight x flat | weights], rank r's weight in
    slot r of a tail of `size` floats, so every rank's weight comes off the wire too. Gloo's ring all-reduce
    reduces each segment once and then copies it to every rank, so the result is bit-identical everywhere (as the
    two-collective path makes it for the codecs), in one collective instead of two and with no codec passes."""
    size, rank, numel = pg.size(), pg.rank(), flat.numel()
    buf = ex.buf("sum", (numel + size,), torch.float32, host=True)  # pinned host memory beside a GPU
    if ex.on_host:
        torch.mul(flat, weight, out=buf[:numel])  # flat stays intact: a retry sends it again
    elif out.data_ptr() == flat.data_ptr():  # `out` is `flat`, which must stay intact: the product on the host
        buf[:numel].copy_(flat).mul_(weight)
    else:  # on the device, `out` as scratch: one fp32 product rounds alike on every device
        buf[:numel].copy_(torch.mul(flat, weight, out=out))
    buf[numel:].zero_()
    buf[numel + rank] = weight
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)  # the option takes a ReduceOp, not its RedOpType
    t0 = time.perf_counter()
    pg.allreduce([buf], opts).wait()
    wire = time.perf_counter() - t0
    weights = buf[numel:].tolist()
    total = float(sum(weights))
    if not total > 0:
        raise NothingToAverage("every rank of the group has weight 0")
    # a true division everywhere: CUDA divides by a Python number as a multiplication by its reciprocal, which
    # rounds otherwise (encode_into), but by a tensor on the device as the host divides
    if ex.on_host:
        torch.div(buf[:numel], total, out=out)
    else:
        # queued on the current stream, the caller's (groups.run_sliced): its next kernels read it in order
        out.copy_(buf[:numel]).div_(torch.tensor(total, dtype=torch.float32, device=out.device))
    sent = bytes_sent(numel, size, "none")  # a ring all-reduce: 2 (size-1) segments out per rank
    seconds = time.perf_counter() - start
    return out, ReduceStats(sent, seconds, total, weights, wire_s=wire, codec_s=seconds - wire)
