"""The weighted mean of one flat fp32 tensor across a process group, optionally compressed on the wire.

    mean, stats = weighted_mean(flat, weight, pg, "int8", out=buf, exchange=ex)   # sum_i(w_i x_i) / sum_i(w_i)

One algorithm for every compression, so the bytes counted are the bytes sent (INTELLECT-1's int8 all-reduce):

    1. every rank scales its tensor by its weight and cuts it into `size` equal chunks (padded);
    2. reduce-scatter by all_to_all: chunk j goes, encoded, to rank j;
    3. rank j decodes what it received and sums it in fp32 (accumulation is never compressed), divides by the
       total weight and encodes its reduced chunk once more;
    4. all_gather of the encoded reduced chunks; every rank decodes all of them, the owner its own as well.

For "none" on the host the same mean is one gloo all-reduce (sum) of the scaled tensor with every rank's weight
appended (`_allreduce_mean`): no codec, one collective, the wire cost of a ring all-reduce.

Step 4 makes the result bit-identical on every rank: each chunk is reduced once, by one owner, and all ranks
decode the very same bytes. Per rank the wire carries 2 * (size-1)/size * numel * bytes_per_element, as a ring
all-reduce would: 4 bytes for "none", 2 for bf16/fp16, 1 (+ 8 per chunk of scale/offset) for int8, plus the
sender's weight (4 bytes per peer, packed into the all_to_all rows: there are no other messages).

int8 is uniform 256-bin quantization per chunk: q = round((x - lo) / scale), scale = (hi - lo) / 255. Its
absolute error per element is at most scale / 2 for each of the two quantizations.

Where the work happens: the codec runs on the device of `flat` (on a GPU for CUDA runs), so only the encoded
bytes cross to the host, through pinned host buffers; gloo moves host bytes. Every buffer comes from an
`Exchange`, allocated on first use and reused while the group size and codec stay the same, so an outer step
allocates nothing of the model's size. The result is written into `out` (which may be `flat` itself).

The process group is used through its own methods (`pg.alltoall_base(...).wait()`), which works for the
per-generation groups built from a store and raises the backend's real error text ("Connection closed by
peer") as a RuntimeError. This module never catches it: the caller decides whether an outer step failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

COMPRESSIONS = ("none", "bf16", "fp16", "int8")
# The collectives an outer step runs, as a version: it is part of the mesh digest, so that engines of versions
# whose collectives differ are refused at start-up ("config digest differs") instead of deadlocking in a
# mismatched collective (2: "none" on the host became one all-reduce).
WIRE_PROTOCOL = 2
_META = 8  # int8: (scale, offset) per chunk, two fp32 = 8 bytes
_WEIGHT = 4  # the sender's weight, one fp32


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
        scale = (hi - lo) / 255.0
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


def _all_to_all(pg: dist.ProcessGroup, send: torch.Tensor, recv: torch.Tensor) -> None:
    pg.alltoall_base(recv, send, [], [], dist.AllToAllOptions()).wait()


@dataclass
class _Gather:
    rows: torch.Tensor  # [size, row bytes]: row i receives rank i's
    mine: torch.Tensor  # [row bytes]


def _all_gather(pg: dist.ProcessGroup, job: _Gather) -> None:
    """One collective (the end-to-end tests kill a node inside it: keep it a module-level function)."""
    pg.allgather([[job.rows[i] for i in range(job.rows.shape[0])]], [job.mine]).wait()


def _check(flat: torch.Tensor, weight: float, compression: str, out: torch.Tensor | None) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: unknown {compression!r} (known: {', '.join(COMPRESSIONS)})")
    assert flat.dtype == torch.float32 and flat.dim() == 1
    assert out is None or (out.shape == flat.shape and out.dtype == flat.dtype and out.device == flat.device)
    assert weight >= 0


def _scaled_rows(flat: torch.Tensor, weight: float, size: int, ex: Exchange, out: torch.Tensor):
    """flat * weight cut into `size` rows of per_chunk (the last padded with zeros), as two blocks of fp32 rows:
    the whole rows are read from `flat` itself at weight 1 (no copy) and live in `out` otherwise (scratch until
    the result lands there), the rest in a small padded buffer."""
    numel = flat.numel()
    per_chunk = -(-numel // size)
    whole = numel // per_chunk
    head = whole * per_chunk
    tail = ex.buf("tail", (size - whole, per_chunk), torch.float32)
    tail.zero_()
    torch.mul(flat[head:], weight, out=tail.view(-1)[:numel - head])
    if weight == 1.0:
        return flat[:head].view(whole, per_chunk), tail
    torch.mul(flat[:head], weight, out=out[:head])
    return out[:head].view(whole, per_chunk), tail


def weighted_mean(flat: torch.Tensor, weight: float, pg: dist.ProcessGroup | None, compression: str = "none", *,
                  out: torch.Tensor | None = None, exchange: Exchange | None = None
                  ) -> tuple[torch.Tensor, ReduceStats]:
    """sum_i(weight_i * flat_i) / sum_i(weight_i) over the group, on every rank, written into `out` (a new tensor
    when None; `out` may be `flat`). flat may live on any device; the wire carries host bytes.

    A rank of weight 0 (a joiner) takes part in the collectives but adds nothing. At least one rank must have a
    positive weight. pg None or of size 1: no communication and no compression (nothing is sent)."""
    _check(flat, weight, compression, out)
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
    if compression == "none" and flat.device.type == "cpu":
        return _allreduce_mean(flat, weight, pg, ex, out, start)
    numel = flat.numel()
    per_chunk = -(-numel // size)
    width = per_chunk * bytes_per_element(compression)
    meta = _META if compression == "int8" else 0
    # 1. my rows, encoded: row j = chunk j | its int8 scale/offset | my weight (one message per peer)
    whole, tail = _scaled_rows(flat, weight, size, ex, out)
    send = ex.buf("send", (size, width + meta + _WEIGHT), torch.uint8)
    # int8's scratch is out's (the rows must stay intact when they are flat's own, which a retry resends)
    encode_into(send[:whole.shape[0]], whole, compression, work=out[:whole.numel()].view(whole.shape))
    encode_into(send[whole.shape[0]:], tail, compression)
    send[:, width + meta:].copy_(torch.full((size, 1), float(weight), device=send.device).view(torch.uint8))
    wire = 0.0
    # 2. reduce-scatter by all_to_all: row i of what I receive is rank i's copy of my chunk
    send_host = ex.to_host("send", send)
    recv_host = ex.buf("recv", tuple(send.shape), torch.uint8, host=True)
    t0 = time.perf_counter()
    _all_to_all(pg, send_host, recv_host)
    wire += time.perf_counter() - t0
    weights = _f32(recv_host[:, width + meta:]).reshape(-1)
    total = float(weights.sum())
    if not total > 0:
        raise NothingToAverage("every rank of the group has weight 0")
    # 3. fp32 accumulation of my chunk, in rank order, then encoded once more
    recv = ex.to_device("recv", recv_host)
    acc = ex.buf("acc", (1, per_chunk), torch.float32)
    part = ex.buf("part", (1, per_chunk), torch.float32)
    decode_into(acc, recv[0:1], compression)
    for i in range(1, size):
        decode_into(part, recv[i:i + 1], compression)
        acc.add_(part)
    acc.div_(total)
    mine = ex.buf("mine", (1, width + meta), torch.uint8)
    encode_into(mine, acc, compression)
    # 4. all_gather of the reduced chunks (+ their scale/offset) straight into the rows of one buffer
    mine_host = ex.to_host("mine", mine)
    rows_host = ex.buf("rows", (size, width + meta), torch.uint8, host=True)
    t0 = time.perf_counter()
    _all_gather(pg, _Gather(rows_host, mine_host[0]))
    wire += time.perf_counter() - t0
    rows = ex.to_device("rows", rows_host)
    _decode_result(out, rows, per_chunk, compression, ex)
    sent = (size - 1) * (width + meta + _WEIGHT) + (size - 1) * (width + meta)
    seconds = time.perf_counter() - start
    return out, ReduceStats(sent, seconds, total, weights.tolist(), wire_s=wire, codec_s=seconds - wire)


def _allreduce_mean(flat: torch.Tensor, weight: float, pg: dist.ProcessGroup, ex: Exchange, out: torch.Tensor,
                    start: float) -> tuple[torch.Tensor, ReduceStats]:
    """compression "none" on the host: one gloo all-reduce (sum) of [weight x flat | weights], rank r's weight in
    slot r of a tail of `size` floats, so every rank's weight comes off the wire too. Gloo's ring all-reduce
    reduces each segment once and then copies it to every rank, so the result is bit-identical everywhere (as the
    two-collective path makes it for the codecs), in one collective instead of two and with no codec passes."""
    size, rank, numel = pg.size(), pg.rank(), flat.numel()
    buf = ex.buf("sum", (numel + size,), torch.float32)
    torch.mul(flat, weight, out=buf[:numel])  # flat stays intact: a retry sends it again
    buf[numel:].zero_()
    buf[numel + rank] = weight
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    t0 = time.perf_counter()
    pg.allreduce([buf], opts).wait()
    wire = time.perf_counter() - t0
    weights = buf[numel:].tolist()
    total = float(sum(weights))
    if not total > 0:
        raise NothingToAverage("every rank of the group has weight 0")
    torch.div(buf[:numel], total, out=out)
    sent = 2 * (size - 1) * -(-(numel + size) // size) * 4  # a ring all-reduce: 2 (size-1) segments out per rank
    seconds = time.perf_counter() - start
    return out, ReduceStats(sent, seconds, total, weights, wire_s=wire, codec_s=seconds - wire)


def _decode_result(out: torch.Tensor, rows: torch.Tensor, per_chunk: int, compression: str, ex: Exchange) -> None:
    """Decode the gathered rows into out: the whole rows directly, the last partial row through a small buffer."""
    numel = out.numel()
    whole = numel // per_chunk
    head = whole * per_chunk
    if whole:
        decode_into(out[:head].view(whole, per_chunk), rows[:whole], compression)
    if head < numel:
        last = ex.buf("part", (1, per_chunk), torch.float32)
        decode_into(last, rows[whole:whole + 1], compression)
        out[head:].copy_(last[0, :numel - head])
    if ex.device.type == "cuda":
        torch.cuda.current_stream(ex.device).synchronize()  # the result is complete when this returns
