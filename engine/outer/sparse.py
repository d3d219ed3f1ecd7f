"""Sparse outer updates with error feedback (SparseLoCo, arXiv 2508.15706): the codec, its state and the gathered mean.

    spec = SparseSpec(chunk=4096, density=0.0156, bits=2, beta=0.9)
    layout = ChunkLayout([p.shape for p in params], spec)        # parameters, or this rank's FSDP/ZeRO shards
    codec = SparseCodec(spec, layout, device)
    ef = ErrorFeedback(codec)
    if not ef.stage(pgrad_views):        # e' = beta * e + delta, once per outer step (False: not finite, e reset)
        ...                              # sit this step out and take the run's weights
    message, sent = ef.encode()          # every attempt of the step encodes from e' (the same bytes each time)
    ... all-gather the messages of the members (rank order), with their weights ...
    total = gathered_mean(codec, messages, weights, out=mean)    # the weighted mean, bit-identical on every rank
    ef.commit(sent)                      # the committed step counted this node: e = e' - sent
    ef.abort()                           # or it did not (left out, step dropped): e = e', nothing subtracted
    ef.reset()                           # a hand-off or a non-finite accumulator: e = 0

torch only (no torch.distributed): the collective that moves the messages is engine/outer/gather.py's gather_mean.

The method. Each node keeps an accumulator e of its pseudo-gradients, e' = beta * e + delta, and sends only the
k = max(1, round(density * chunk)) entries of largest magnitude in each chunk of e', quantized; what it did not send
(after quantization: e' minus the dequantized values it sent) stays in e for the next outer step. The outer step is
the weighted mean of the members' sparse updates (times the outer learning rate); the accumulator takes the place
of the outer momentum.

The layout (ChunkLayout). One flat fp32 buffer over a list of tensors, each tensor starting at a multiple of the
chunk size and its last chunk padded with zeros, so a chunk never crosses a tensor (nor a shard: a shard is a
tensor of the list). The buffer viewed as [chunks, chunk] is what the codec works on, in one set of torch ops for
the whole model (no Python loop over chunks or tensors); `views(buf)` gives each tensor's part shaped like it.
Padding is never selected: a chunk holding n < chunk values of its tensor sends min(k, n) of them (all of them when
n < k), and a pad's slot is never one of them.

The wire format. One message per node per outer step, three sections in this order, each a whole number of bytes:

    scales    fp32 per chunk (4 bytes x chunks): s = the largest magnitude among the chunk's kept values
    indices   the kept positions within their chunks, log2(chunk) bits each, chunk after chunk (bit planes below)
    values    the kept values' codes, `bits` bits each, in the same order, packed little-endian within a byte

    bytes = 4 * chunks + ceil(K * log2(chunk) / 8) + ceil(K * bits / 8),   K = sum over chunks of min(k, n)

An index of w = log2(chunk) bits is sent as w // 8 byte planes (its low bytes, one byte per index each) followed by
its w % 8 high bits packed (8 // r per byte for r in 1, 2, 4; bit by bit otherwise): n * (w // 8) + ceil(n * r / 8)
= ceil(n * w / 8) bytes, exactly. B = bytes / (4 x values covered): at chunk 4096, 2 bits, 14 bits a kept value,
B ~= density * 14 / 32 + 1 / 4096: 0.0071 at 1.56 % (k 64), 0.0090 at 2 %, 0.0134 at 3 % (docs/sparse.md).

The quantizer (bits 2, 4, 8): symmetric sign-magnitude with one scale per chunk. A code is a sign bit and a
magnitude m in [0, L), L = 2^(bits-1); it decodes to sign * (m + 1) * s / L, so the levels are s/L, 2s/L, ..., s
(for 2 bits: +-s/2 and +-s) and the chunk's largest value is sent exactly. m = clamp(round(|v| * L / s) - 1, 0, L-1):
the nearest level. The kept values are the chunk's largest, in [t, s] for the k-th largest magnitude t (often
0.5-0.7 s), which a grid with no zero level covers best; a kept value of exactly 0 (a chunk with fewer than k nonzero
values) is sent as +s/L, and error feedback takes it back next step. Why not the reference implementation's
(tplr-ai's SparseLoCo optimizer: a per-tensor mean and standard deviation, 2^bits bins over 6 sigma and a lookup
table of the bins' means): the issue's wire format is one scale per chunk, the bins' means take a scatter over
the bins (its order undefined on a GPU) and 2^bits floats per group, and error feedback absorbs the quantizer's
bias either way. The scale is fp32, not fp16: a chunk's largest pseudo-gradient value can fall below fp16's normal
range (6e-5), and 4 bytes a chunk are 1/4096 of B at chunk 4096.

Bit-identical on every rank. Every rank decodes the same bytes with the same ops: a value is one fp32 product of
(m + 1) by s / L (the division by a power of two is exact), times the sender's share w_i / W of the total weight W
of the contributors (computed in float64, the same on every host, then one fp32 product), added into an fp32
accumulator one message at a time in rank order (within one message the positions are distinct, so its scatter
adds each once, on a GPU as well). Every weight is known before the first message is added (each rides in its
message's first piece), so the mean needs no division over the whole buffer afterwards. The arrival order of the
messages never enters (`RankOrderedSum` holds early arrivals until the ranks before them are in).

Top-k without torch.topk over whole chunks (it costs ~13 ns a value on this CPU, 0.2 s a 15m model's outer step):
each chunk is cut into G strided groups (value i of the chunk in group i mod G); the k groups of largest maximum
magnitude hold the chunk's top k (a value outside them is smaller than k group maxima, so than k values), so a
topk over the G group maxima, a gather of those groups and a topk over their k * chunk / G values find it exactly
(ties may pick another of equal magnitude). G ~ sqrt(k * chunk): 512 at chunk 4096, k 64. Every one of the chunk's
top k is at least t, the k-th largest group maximum (k groups hold a value >= t), and only ~68 of the 512 candidates
are (at the defaults): the others are raised to just below t before the second topk, which partitions the many equal
values ~1.4x faster and can pick none of them. A chunk whose k is half of it or more goes straight to torch.topk.

The interface issue #42's outer loop is built to hold (a codec with state, messages gathered, no outer momentum):

    class StatefulCodec(Protocol):                  # what the outer step's story sees of this module
        gathers: bool                               # True: every member's message goes to every member (an
                                                    # all-gather) and every rank decodes all of them; False: the
                                                    # messages are reduced (the dense codecs' reduce-scatter)
        def stage(self, delta) -> bool              # once per outer step, before the first attempt
        def encode(self) -> tuple[Tensor, Sent]     # per attempt: the same message from the same e'
        def mean_into(self, messages, weights, out) -> float    # the weighted mean of the gathered messages
        def commit(self, sent) -> None              # the committed step counted this node
        def abort(self) -> None                     # it did not (left out, straggler, step dropped)
        def reset(self) -> None                     # the node takes the run's weights (hand-off, non-finite)
        def state_dict(self) / load_state_dict(s)   # checkpointed with the node

The outer optimizer for sparse is "none" by default (p = snapshot - outer_lr * mean: the accumulator is the
momentum); Nesterov over the sparse mean stays selectable. `ErrorFeedback` is that codec (`gathers = True`).
Memory: e, one fp32 copy of the node's parameters (or of its shard) plus the padding of each tensor's last chunk.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.sparse_rules import SPARSE_BITS as BITS, SPARSE_MAX_CHUNK as MAX_CHUNK, SPARSE_MIN_CHUNK as MIN_CHUNK, \
    sparse_problem
from engine.outer.bitpack import pack_bits, packed_bytes, unpack_bits

_SCALE = 4  # bytes of a chunk's scale (fp32)
_BLOCK_BYTES = 2 << 20  # the encode's blocks of chunks on a CPU (SparseCodec._topk)


@dataclass(frozen=True)
class SparseSpec:
    """The settings every node must share (they shape the wire): chunk, density, bits; and beta, the decay of the
    accumulator (a node's own state, but the run's rule). Defaults: the paper's 64 of every 4096 values at 2 bits,
    beta 0.9 (the learning study's tuning, docs/learning.md; tplr-ai's SparseLoCo sweeps use 0.95). The rules are the config's (engine/sparse_rules.py, sparse_problem): a bad
    value is one line naming its key and the value."""

    chunk: int = 4096
    density: float = 0.0156
    bits: int = 2
    beta: float = 0.9

    def __post_init__(self) -> None:
        for key, value in (("sparse_chunk", self.chunk), ("density", self.density), ("sparse_bits", self.bits),
                           ("sparse_beta", self.beta)):
            problem = sparse_problem(key, value)
            if problem:
                raise ValueError(f"diloco.{key}: {problem}")

    @classmethod
    def of(cls, diloco: Any) -> "SparseSpec":
        """The spec of a DilocoConfig (diloco.sparse_chunk, density, sparse_bits, sparse_beta)."""
        return cls(chunk=diloco.sparse_chunk, density=diloco.density, bits=diloco.sparse_bits,
                   beta=diloco.sparse_beta)

    @property
    def k(self) -> int:
        """Values sent per full chunk."""
        return max(1, round(self.density * self.chunk))

    @property
    def index_bits(self) -> int:
        return self.chunk.bit_length() - 1

    @property
    def levels(self) -> int:
        """Magnitude levels per sign: a code is a sign bit and log2(levels) bits of magnitude."""
        return 1 << (self.bits - 1)


class ChunkLayout:
    """A list of tensors (parameters or shards) laid out in one flat buffer of whole chunks: tensor i occupies
    [offsets[i], offsets[i] + numels[i]) and its last chunk is padded (zeros) to the next multiple of the chunk."""

    def __init__(self, shapes: Sequence[torch.Size | Sequence[int] | int], spec: SparseSpec):
        self.spec = spec
        self.shapes = [torch.Size([s]) if isinstance(s, int) else torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        c = spec.chunk
        self.offsets, fill, at = [], [], 0
        for n in self.numels:
            self.offsets.append(at)
            whole, rest = divmod(n, c)
            fill += [c] * whole + ([rest] if rest else [])
            at += -(-n // c) * c
        self.padded = at
        self.chunks = at // c
        self.numel = sum(self.numels)
        # values of its tensor in each chunk, and values it sends: all of a chunk shorter than k, else k
        self.fill = fill
        self.keep = [min(spec.k, n) for n in fill]
        self.entries = sum(self.keep)  # K: kept values per message
        self.partial = [j for j, n in enumerate(fill) if n < c]  # chunks that end a tensor short of the chunk

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of a flat buffer of this layout, shaped like the tensor."""
        assert buf.numel() == self.padded, "not a buffer of this layout"
        return [buf[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def pack(self, tensors: Sequence[torch.Tensor] | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A fp32 buffer of this layout holding `tensors` (a list shaped as the layout, or one flat tensor of
        their values in order), pads zero."""
        if out is None:
            dev = tensors.device if isinstance(tensors, torch.Tensor) else tensors[0].device
            out = torch.zeros(self.padded, dtype=torch.float32, device=dev)
        for v, t in zip(self.views(out), self.split(tensors)):
            v.copy_(t.view(v.shape))
        return out

    def unpack(self, buf: torch.Tensor) -> torch.Tensor:
        """The values of a buffer of this layout as one flat tensor, pads dropped (a copy)."""
        return torch.cat([v.reshape(-1) for v in self.views(buf)]) if self.shapes else buf[:0].clone()

    def split(self, tensors: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's values, flat: from a list shaped as the layout, or from one flat tensor of them in order."""
        if isinstance(tensors, torch.Tensor):
            assert tensors.numel() == self.numel, "a flat tensor of another size than the layout's"
            flat = tensors.reshape(-1)
            return [flat[o:o + n] for o, n in zip(_starts(self.numels), self.numels)]
        assert [t.numel() for t in tensors] == self.numels, "tensors of other sizes than the layout's"
        return [t.reshape(-1) for t in tensors]


def _starts(numels: Sequence[int]) -> list[int]:
    out, at = [], 0
    for n in numels:
        out.append(at)
        at += n
    return out


def message_bytes(spec: SparseSpec, layout: ChunkLayout) -> int:
    """The bytes of one node's message: 4 * chunks + ceil(K * log2(chunk) / 8) + ceil(K * bits / 8)."""
    k = layout.entries
    return _SCALE * layout.chunks + -(-k * spec.index_bits // 8) + -(-k * spec.bits // 8)


def bytes_ratio(spec: SparseSpec, layout: ChunkLayout) -> float:
    """B: the message's bytes over 4 x the values it covers (fp32 would be 1.0)."""
    return message_bytes(spec, layout) / (4 * layout.numel)


@dataclass
class Sent:
    """What a node's message says, dequantized: the values at their positions in the layout's buffer (sparse,
    distinct positions). The residual is e' minus these (after quantization, not before)."""

    pos: torch.Tensor  # int64 [K]
    val: torch.Tensor  # fp32 [K]
    # when every chunk sends k values: their positions within their chunks, [chunks, k] (the values are val viewed
    # [chunks, k]): a scatter row by row, which adds faster on a CPU than one index_add over the buffer
    at: torch.Tensor | None = None

    def add_to(self, out: torch.Tensor, val: torch.Tensor) -> None:
        """out[pos] += val, each position once (distinct positions: the same bytes on any device)."""
        if self.at is None:
            out.index_add_(0, self.pos, val)
        else:
            out.view(self.at.shape[0], -1).scatter_add_(1, self.at, val.view(self.at.shape))

    def dense(self, padded: int) -> torch.Tensor:
        out = torch.zeros(padded, dtype=torch.float32, device=self.val.device)
        out[self.pos] = self.val
        return out


class SparseCodec:
    """Encode a buffer of the layout into one message; decode a message into an fp32 buffer of the layout."""

    gathers = True  # its messages are all-gathered and every rank decodes all of them (a sparse sum is not sparse)

    def __init__(self, spec: SparseSpec, layout: ChunkLayout, device: torch.device | str = "cpu"):
        assert layout.spec == spec, "a layout made for other settings"
        self.spec, self.layout, self.device = spec, layout, torch.device(device)
        dev = self.device
        keep = torch.tensor(layout.keep, dtype=torch.int64)
        chunk_of = torch.repeat_interleave(torch.arange(layout.chunks), keep)
        self._chunk_of = chunk_of.to(dev)  # chunk of each kept value, in message order
        self._base = (chunk_of * spec.chunk).to(dev)  # its chunk's first position in the buffer
        self._fill = torch.tensor(layout.fill, dtype=torch.int64, device=dev)
        self._partial = torch.tensor(layout.partial, dtype=torch.int64, device=dev)
        # short chunks (fewer than k values) send all their values and not k: a mask over the [chunks, k] top-k
        self._short = any(k < spec.k for k in layout.keep)
        k, c = spec.k, spec.chunk
        groups = 1 << max(0, round(math.log2(math.sqrt(k * c))))
        self._groups = g = groups if 2 * k <= c and k <= groups < c else 0  # 0: torch.topk over whole chunks
        # candidate i of a chunk is row i // k of group top[i % k]: at (i // k) * g + top[i % k]. The encode divides
        # nothing (an int64 division costs a pass): for k a power of two a shift and a mask, else two tables
        self._cand_shift = k.bit_length() - 1 if g and k & (k - 1) == 0 else -1
        if g and self._cand_shift < 0:
            i = torch.arange((c // g) * k)
            self._cand_row, self._cand_top = ((i // k) * g).to(dev), (i % k).to(dev)
        # where each chunk's values start in a message (chunk after chunk): the decode's blocks (_zero_add)
        self._entry_start = [0, *itertools.accumulate(layout.keep)]
        # a code's value in units of s / L: sign * (m + 1), exact small integers (a sign flips no rounding)
        code = torch.arange(1 << spec.bits)
        mag = ((code & (spec.levels - 1)) + 1).to(torch.float32)
        self._code_value = torch.where((code >> (spec.bits - 1)).bool(), -mag, mag).to(dev)
        self._scratch: dict[str, torch.Tensor] = {}  # the top-k's group maxima and candidates, kept between steps
        self.bytes = message_bytes(spec, layout)

    # ---- encode ----

    @torch.no_grad()
    def encode(self, buf: torch.Tensor) -> tuple[torch.Tensor, Sent]:
        """The message (uint8, exactly `self.bytes` long) for a buffer of the layout, and what it sends."""
        spec, lay = self.spec, self.layout
        assert buf.numel() == lay.padded and buf.dtype == torch.float32, "not a fp32 buffer of this layout"
        rows = buf.view(lay.chunks, spec.chunk)
        idx, vals = self._topk(rows)  # [chunks, k]: positions within each chunk, and their values
        at = None if self._short else idx
        if self._short:
            keep = idx < self._fill.view(-1, 1)  # a short chunk's picks beyond its values are pads: dropped
            idx, vals = idx[keep], vals[keep]
            scale = torch.zeros(lay.chunks, dtype=torch.float32, device=buf.device)
            scale.scatter_reduce_(0, self._chunk_of, vals.abs(), reduce="amax")  # max: order-free
        else:  # [chunks, k]: a chunk's scale broadcasts over its row, no gather per value
            scale = vals.abs().amax(1)
        codes = self._quantize(vals, scale)
        msg = torch.empty(self.bytes, dtype=torch.uint8, device=buf.device)
        idx, codes = idx.reshape(-1), codes.reshape(-1)
        self._write(msg, scale, idx, codes)
        return msg, Sent(self._base + idx, self._dequantize(codes, scale), at)

    def _scratch_buf(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A fp32 scratch buffer of the top-k, allocated once and then reused (a block shorter than the others
        takes the front of it)."""
        t = self._scratch.get(name)
        if t is None or t.shape[1:] != torch.Size(shape[1:]) or t.shape[0] < shape[0]:
            t = self._scratch[name] = torch.empty(shape, dtype=torch.float32, device=self.device)
        return t[:shape[0]]

    def _topk(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k magnitudes of each chunk: their positions within the chunk and their values, [chunks, k]."""
        k, c, g = self.spec.k, self.spec.chunk, self._groups
        n = rows.shape[0]
        if g:
            idx = torch.empty(n, k, dtype=torch.int64, device=rows.device)
            vals = torch.empty(n, k, dtype=torch.float32, device=rows.device)
            # on a CPU block by block of about 2 MiB, so that a block's second and third reads (the group minima,
            # the candidates, the values) come from the cache, not from memory: 15 % of the encode at 15m. A GPU
            # takes the whole buffer at once (each op a kernel launch)
            block = n if rows.device.type != "cpu" else max(1, _BLOCK_BYTES // (4 * c))
            for b0 in range(0, n, block):
                self._topk_block(rows[b0:b0 + block], idx[b0:b0 + block], vals[b0:b0 + block])
        else:
            idx = torch.topk(rows.abs(), k, dim=1, sorted=False).indices
            vals = rows.gather(1, idx)
        if len(self._partial):  # a tensor's last chunk: its pads rank below every value (-1 < |x|)
            part = rows.index_select(0, self._partial)
            pads = torch.arange(c, device=rows.device).view(1, -1) >= self._fill[self._partial].view(-1, 1)
            top = torch.topk(part.abs().masked_fill_(pads, -1.0), k, dim=1, sorted=False).indices
            idx[self._partial], vals[self._partial] = top, part.gather(1, top)
        return idx, vals

    def _topk_block(self, rows: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """_topk's strided groups over a block of chunks, into idx and vals (rows of the block)."""
        k, c, g = self.spec.k, self.spec.chunk, self._groups
        n = rows.shape[0]
        y = rows.view(n, c // g, g)  # value i of a chunk in group i mod g
        gmax, cand = self._scratch_buf("gmax", (n, g)), self._scratch_buf("cand", (n, c // g, k))
        # the group minima in the candidates' buffer (used after them) when it holds them
        gmin = cand.view(-1)[:n * g].view(n, g) if (c // g) * k >= g else self._scratch_buf("gmin", (n, g))
        torch.maximum(torch.amax(y, 1, out=gmax), torch.amin(y, 1, out=gmin).neg_(), out=gmax)
        # magnitudes compared as their int32 bit patterns: the same order for floats >= 0, and torch.topk over int32
        # runs ~1.5x faster than over fp32 on this CPU
        groups = torch.topk(gmax.view(torch.int32), k, dim=1, sorted=False)  # these groups hold the top k
        top = groups.indices
        torch.gather(y, 2, top.unsqueeze(1).expand(-1, c // g, -1), out=cand)
        mag = cand.view(n, -1).abs_().view(torch.int32)
        # the chunk's top k are all >= t, the k-th largest group maximum (k groups have a value >= t): a candidate
        # below t is raised to t's predecessor, below every one of them, so the candidates' top k stay theirs; the
        # raised ones are equal (~450 of 512), which torch.topk partitions ~1.4x faster
        torch.clamp_min(mag, groups.values.amin(1, keepdim=True).sub_(1), out=mag)
        i = torch.topk(mag, k, dim=1, sorted=False).indices
        if self._cand_shift >= 0:  # (i >> log2 k) * g + top[i & (k - 1)]
            row = torch.bitwise_right_shift(i, self._cand_shift).bitwise_left_shift_(g.bit_length() - 1)
            torch.add(row, top.gather(1, i.bitwise_and_(k - 1)), out=idx)
        else:
            torch.add(self._cand_row[i], top.gather(1, self._cand_top[i]), out=idx)
        torch.gather(rows, 1, idx, out=vals)

    def _per_value(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """A per-chunk tensor against the values: broadcast over their [chunks, k] when every chunk sends k, else
        gathered per value (in message order)."""
        return per_chunk[self._chunk_of] if self._short else per_chunk.view(-1, 1)

    def _quantize(self, vals: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        levels = self.spec.levels
        # |v| * (L / s), rounded: the nearest of the levels 1..L (times s / L); a zero chunk (s = 0) sends m = 0
        inv = torch.where(scale > 0, levels / torch.where(scale > 0, scale, torch.ones_like(scale)),
                          torch.zeros_like(scale))
        m = (vals.abs() * self._per_value(inv)).round_().sub_(1).clamp_(0, levels - 1).to(torch.int64)
        return m | ((vals < 0).to(torch.int64) << (self.spec.bits - 1))

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """sign * (m + 1) * (s / L): one fp32 product (s / L is exact: L is a power of two), codes [K] -> [K]."""
        step = scale * (1.0 / self.spec.levels)  # times 2^-j: exact, on every device
        value = self._code_value[codes]
        return (value if self._short else value.view(-1, self.spec.k)).mul_(self._per_value(step)).view(-1)

    def _sections(self) -> tuple[int, int, int]:
        k, spec = self.layout.entries, self.spec
        a = _SCALE * self.layout.chunks
        b = a + packed_bytes(k, spec.index_bits)
        return a, b, b + packed_bytes(k, spec.bits)

    def _write(self, msg: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, codes: torch.Tensor) -> None:
        a, b, end = self._sections()
        assert end == msg.numel()
        msg[:a].copy_(scale.view(torch.uint8))
        pack_bits(idx, self.spec.index_bits, out=msg[a:b])
        pack_bits(codes, self.spec.bits, out=msg[b:end])

    # ---- decode ----

    def read(self, msg: torch.Tensor) -> Sent:
        """A message's values at their positions (what its sender's encode returned as Sent, bit for bit)."""
        if msg.dtype != torch.uint8 or msg.numel() != self.bytes:
            raise ValueError(f"sparse message of {msg.numel()} bytes ({msg.dtype}); this layout's are "
                             f"{self.bytes} bytes (uint8): the sender has other parameters or settings")
        a, b, end = self._sections()
        k = self.layout.entries
        scale = torch.empty(self.layout.chunks, dtype=torch.float32, device=msg.device)
        scale.view(torch.uint8).copy_(msg[:a])  # an aligned copy: a slice of a received buffer may be unaligned
        idx = unpack_bits(msg[a:b], self.spec.index_bits, k)
        codes = unpack_bits(msg[b:end], self.spec.bits, k)
        at = None if self._short else idx.view(self.layout.chunks, self.spec.k)
        return Sent(self._base + idx, self._dequantize(codes, scale), at)

    @torch.no_grad()
    def decode_add(self, msg: torch.Tensor | Sent, out: torch.Tensor, scale_by: float | torch.Tensor = 1.0,
                   zero: bool = False) -> torch.Tensor:
        """out += scale_by * decode(msg), in fp32, each position once (a message's positions are distinct); zero:
        out is zeroed first, in the same pass (_zero_add). A node's own message may come as the Sent its encode
        returned: the same values, bit for bit, unread. Returns the positions it added to."""
        sent = msg if isinstance(msg, Sent) else self.read(msg.to(out.device))
        w = torch.as_tensor(scale_by, dtype=torch.float32, device=out.device)
        if zero:
            self._zero_add(sent, out, sent.val * w)
        else:
            sent.add_to(out, sent.val * w)
        return sent.pos

    def _zero_add(self, sent: Sent, out: torch.Tensor, val: torch.Tensor) -> None:
        """out = 0, then out[pos] += val: the same bytes as out.zero_() and sent.add_to(out, val). On a CPU block
        by block of chunks, so that the values are added to a block still in the cache from its zeroing, not to a
        buffer of the whole model's size that has left it (2 ms of the 15m model's 5). A GPU zeroes all at once."""
        lay, c = self.layout, self.spec.chunk
        assert out.numel() == lay.padded, "not a buffer of this layout"
        if out.device.type != "cpu":
            out.zero_()
            sent.add_to(out, val)
            return
        block = max(1, _BLOCK_BYTES // (4 * c))
        rows = out.view(lay.chunks, c)
        for b0 in range(0, lay.chunks, block):
            b1 = min(b0 + block, lay.chunks)
            e0, e1 = self._entry_start[b0], self._entry_start[b1]  # the block's values in the message
            rows[b0:b1].zero_()
            if sent.at is None:
                out.index_add_(0, sent.pos[e0:e1], val[e0:e1])
            else:
                rows[b0:b1].scatter_add_(1, sent.at[b0:b1], val[e0:e1].view(b1 - b0, -1))

    def decode(self, msg: torch.Tensor) -> torch.Tensor:
        """The dense contribution of one message, a fp32 buffer of the layout (allocates; tests, tools)."""
        out = torch.zeros(self.layout.padded, dtype=torch.float32, device=self.device)
        self.decode_add(msg, out)
        return out


class NothingGathered(Exception):
    """No message was counted (every weight 0): there is no mean. As allreduce.NothingToAverage, not a RuntimeError:
    the caller must not take it for a broken collective and retry it."""


class RankOrderedSum:
    """The weighted mean of the members' messages, added in rank order whatever order they arrive in: a message is
    decoded as soon as every rank before it is in (added or not counted), so decoding overlaps the transfer and the
    mean is the same bytes on every rank. Every weight is known before the first message is added (gather.py: each
    rides in its message's first piece), so each message's values are scaled by w_i / W as they are added (W: the
    total weight of the contributors) and no pass over the whole buffer divides afterwards."""

    def __init__(self, codec: SparseCodec, weights: Sequence[float], out: torch.Tensor):
        self.codec, self.out = codec, out
        self.weights = [float(w) for w in weights]
        # an exact sum, then one rounding: the same total on every rank whatever the order
        self.total = math.fsum(w for w in self.weights if w > 0)
        self._waiting: dict[int, torch.Tensor | Sent | None] = {}
        self._next = 0
        # out is zeroed by the first message counted, in the pass that adds it (decode_add(zero=True)); with none
        # to count (every weight 0) here
        self._zeroed = not self.total > 0
        if self._zeroed:
            out.zero_()

    def arrive(self, rank: int, msg: torch.Tensor | Sent | None) -> None:
        """Rank's message (None: it sent none; it must then have weight 0). This node's own may be its Sent."""
        assert 0 <= rank < len(self.weights) and rank not in self._waiting and rank >= self._next, f"rank {rank}"
        self._waiting[rank] = msg
        while self._next in self._waiting:
            m, w = self._waiting.pop(self._next), self.weights[self._next]
            if w > 0:
                assert m is not None, f"rank {self._next} has weight {w} and no message"
                # w / W in float64 (the same on every host), then one fp32 product per value: the same bytes on a
                # CPU and a GPU (a mean of one member is its message exactly: w / w = 1)
                self.codec.decode_add(m, self.out, w / self.total, zero=not self._zeroed)
                self._zeroed = True
            self._next += 1

    def finish(self) -> float:
        """Every message is in: the mean is complete. Returns the total weight of the contributors."""
        assert self._next == len(self.weights), f"messages of ranks {self._next}.. never arrived"
        if not self.total > 0:
            raise NothingGathered("every member's weight was 0")
        return self.total


def gathered_mean(codec: SparseCodec, messages: Sequence[torch.Tensor | Sent | None], weights: Sequence[float],
                  out: torch.Tensor) -> float:
    """out = sum_i((w_i / W) * decode(m_i)), W = sum_i(w_i), over the members in rank order (weight 0 or less: not
    counted); the same bytes on every rank. Returns W."""
    assert len(messages) == len(weights), "one weight per message"
    acc = RankOrderedSum(codec, weights, out)
    for rank, msg in enumerate(messages):
        acc.arrive(rank, msg)
    return acc.finish()


class ErrorFeedback:
    """A node's accumulator e, in the codec's layout (fp32, on the codec's device): the codec with state.

    Per outer step: stage(delta) once (e' = beta * e + delta, kept in e's own memory: no second copy); encode() on
    every attempt (the same message each time); then exactly one of commit(sent) (the committed step counted this
    node: e = e' - sent), abort() (it did not: e = e', nothing subtracted) or reset() (e = 0).

    A node left out keeps e' whole: what it would have sent is still in e and, decayed by beta, in its next
    message, where it competes again for the chunk's k places (one the sentinel left out drops the round it judged
    first: codec.py, Sparse.reject)."""

    gathers = True

    def __init__(self, codec: SparseCodec):
        self.codec, self.spec, self.layout = codec, codec.spec, codec.layout
        self.e = torch.zeros(self.layout.padded, dtype=torch.float32, device=codec.device)
        self._flat = [self.e[o:o + n] for o, n in zip(self.layout.offsets, self.layout.numels)]
        self.staged = False

    @torch.no_grad()
    def stage(self, delta: Sequence[torch.Tensor] | torch.Tensor) -> bool:
        """e' = beta * e + delta (a list of tensors shaped as the layout, or one flat tensor of their values), in
        one pass per tensor. False: e' is not finite; e is then reset to 0 and nothing is staged (the node sits the
        step out and takes the run's weights)."""
        assert not self.staged, "stage() twice in one outer step: e' is computed once per step"
        for e, d in zip(self._flat, self.layout.split(delta)):
            torch.add(d, e, alpha=self.spec.beta, out=e)
        if not math.isfinite(self.norm()):
            self.reset()
            return False
        self.staged = True
        return True

    def encode(self) -> tuple[torch.Tensor, Sent]:
        assert self.staged, "encode() before stage()"
        return self.codec.encode(self.e)

    def mean_into(self, messages: Sequence[torch.Tensor | Sent | None], weights: Sequence[float],
                  out: torch.Tensor) -> float:
        return gathered_mean(self.codec, messages, weights, out)

    @torch.no_grad()
    def commit(self, sent: Sent) -> None:
        """The committed step counted this node: e = e' - sent (the dequantized values: after quantization)."""
        assert self.staged, "commit() without a staged step"
        sent.add_to(self.e, sent.val.neg())  # e + (-v) is e - v, bit for bit
        self.staged = False

    def abort(self) -> None:
        """The step ended without counting this node (left out, straggler, the step dropped): e = e' whole."""
        self.staged = False

    def reset(self) -> None:
        """e = 0: the node takes the run's weights (a joiner, back after a death or a divergence), or e' was not
        finite. Its old residual belongs to weights the run no longer has."""
        self.e.zero_()
        self.staged = False

    def norm(self) -> float:
        """||e|| (pads are zero)."""
        return float(torch.linalg.vector_norm(self.e))

    def norm_ratio(self, params: Sequence[torch.Tensor]) -> float:
        """||e|| / ||params||, for the node's telemetry: a ratio that keeps growing says the density is too low."""
        p = math.sqrt(math.fsum(float(torch.linalg.vector_norm(t.detach().float())) ** 2 for t in params))
        return self.norm() / p if p > 0 else math.inf

    def state_dict(self) -> dict[str, Any]:
        """The accumulator's values (pads dropped, so a resumed run may change the chunk) and the tensors' sizes.
        Saved between outer steps (nothing staged)."""
        assert not self.staged, "a checkpoint inside an outer step: e holds e'"
        return {"numels": list(self.layout.numels), "e": self.layout.unpack(self.e)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        numels = list(state["numels"])
        if numels != self.layout.numels:
            raise ValueError(f"the checkpoint's sparse accumulator covers {len(numels)} tensors of "
                             f"{sum(numels)} values; this node's parameters are {len(self.layout.numels)} tensors "
                             f"of {self.layout.numel}: another model or another sharding")
        self.layout.pack(state["e"].to(self.e.device, torch.float32), out=self.e)
        self.staged = False
