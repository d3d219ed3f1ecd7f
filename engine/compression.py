"""The weighted mean of one flat fp32 tensor across a process group, optionally compressed on the wire.

    mean, stats = weighted_mean(flat, weight, pg, "int8")    # sum_i(w_i * x_i) / sum_i(w_i) on every rank

One algorithm for every compression, so the bytes counted are the bytes sent (INTELLECT-1's int8 all-reduce):

    1. every rank scales its tensor by its weight and cuts it into `size` equal chunks (padded);
    2. reduce-scatter by all_to_all: chunk j goes, encoded, to rank j;
    3. rank j decodes what it received and sums it in fp32 (accumulation is never compressed), divides by the
       total weight and encodes its reduced chunk once more;
    4. all_gather of the encoded reduced chunks; every rank decodes all of them, the owner its own as well.

Step 4 makes the result bit-identical on every rank: each chunk is reduced once, by one owner, and all ranks
decode the very same bytes. Per rank the wire carries 2 * (size-1)/size * numel * bytes_per_element, as a ring
all-reduce would: 4 bytes for "none", 2 for bf16/fp16, 1 (+ 8 per chunk of scale/offset) for int8, plus the
sender's weight (4 bytes per peer, packed into the all_to_all rows: there are no other messages).

int8 is uniform 256-bin quantization per chunk: q = round((x - lo) / scale), scale = (hi - lo) / 255. Its
absolute error per element is at most scale / 2 for each of the two quantizations.

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
_META = 2  # int8: (scale, offset) per chunk, fp32


@dataclass
class ReduceStats:
    bytes_sent: int  # payload + metadata this rank put on the wire
    seconds: float
    total_weight: float


def encode(rows: torch.Tensor, compression: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[k, c] fp32 -> (uint8 payload [k, bytes], fp32 metadata [k, 2] or None). Sent as bytes so that gloo
    only ever moves uint8 and fp32, whatever the codec."""
    assert rows.dtype == torch.float32 and rows.dim() == 2
    if compression == "none":
        return rows.contiguous().view(torch.uint8), None
    if compression in ("bf16", "fp16"):
        half = torch.bfloat16 if compression == "bf16" else torch.float16
        return rows.to(half).contiguous().view(torch.uint8), None
    if compression == "int8":
        lo = rows.amin(dim=1, keepdim=True)
        hi = rows.amax(dim=1, keepdim=True)
        scale = (hi - lo) / 255.0
        # a constant chunk: any scale decodes it exactly (q = 0)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((rows - lo) / scale).clamp_(0, 255).to(torch.uint8)
        return q, torch.cat([scale, lo], dim=1)
    raise ValueError(f"compression: unknown {compression!r} (known: {', '.join(COMPRESSIONS)})")


def decode(payload: torch.Tensor, meta: torch.Tensor | None, compression: str) -> torch.Tensor:
    """Inverse of encode: uint8 payload [k, bytes] (+ metadata) -> fp32 [k, c]."""
    if compression == "none":
        return payload.contiguous().view(torch.float32)
    if compression in ("bf16", "fp16"):
        half = torch.bfloat16 if compression == "bf16" else torch.float16
        return payload.contiguous().view(half).float()
    assert compression == "int8" and meta is not None
    return payload.float() * meta[:, :1] + meta[:, 1:]


def bytes_per_element(compression: str) -> int:
    return {"none": 4, "bf16": 2, "fp16": 2, "int8": 1}[compression]


def _pack(payload: torch.Tensor, meta: torch.Tensor | None, weights: torch.Tensor | None) -> torch.Tensor:
    """Rows of bytes: payload | fp32 metadata | fp32 weight. One message per peer and collective, so the
    int8 path pays gloo's per-message framing as often as the fp32 path does."""
    parts = [payload]
    parts += [meta.contiguous().view(torch.uint8)] if meta is not None else []
    parts += [weights.contiguous().view(torch.uint8)] if weights is not None else []
    return torch.cat(parts, dim=1) if len(parts) > 1 else payload.contiguous()


def _unpack(rows: torch.Tensor, width: int, has_meta: bool, *, with_weight: bool):
    payload = rows[:, :width]
    at = width
    meta = None
    if has_meta:
        meta = rows[:, at:at + 8].contiguous().view(torch.float32)
        at += 8
    weights = rows[:, at:at + 4].contiguous().view(torch.float32) if with_weight else None
    return payload, meta, weights


def _all_to_all(pg: dist.ProcessGroup, send: torch.Tensor) -> torch.Tensor:
    recv = torch.empty_like(send)
    pg.alltoall_base(recv, send, [], [], dist.AllToAllOptions()).wait()
    return recv


def _all_gather(pg: dist.ProcessGroup, mine: torch.Tensor) -> torch.Tensor:
    outs = [torch.empty_like(mine) for _ in range(pg.size())]
    pg.allgather([outs], [mine]).wait()
    return torch.stack(outs)


def weighted_mean(flat: torch.Tensor, weight: float, pg: dist.ProcessGroup | None,
                  compression: str = "none") -> tuple[torch.Tensor, ReduceStats]:
    """sum_i(weight_i * flat_i) / sum_i(weight_i) over the group, on every rank; a new tensor.

    A rank of weight 0 (a joiner) takes part in the collectives but adds nothing. At least one rank must have a
    positive weight. pg None or of size 1: no communication and no compression (nothing is sent)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: unknown {compression!r} (known: {', '.join(COMPRESSIONS)})")
    assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.device.type == "cpu"
    assert weight >= 0
    start = time.perf_counter()
    size = 1 if pg is None else pg.size()
    if size == 1:
        assert weight > 0, "a single rank of weight 0 has nothing to average"
        return flat.clone(), ReduceStats(0, time.perf_counter() - start, weight)
    assert pg is not None
    numel = flat.numel()
    per_chunk = -(-numel // size)
    padded = torch.zeros(size * per_chunk, dtype=torch.float32)
    torch.mul(flat, weight, out=padded[:numel])
    payload, meta = encode(padded.view(size, per_chunk), compression)
    # 2. reduce-scatter: row j of what I send is chunk j (+ its int8 scale/offset, + my weight), one message per
    # peer; row i of what I receive is rank i's copy of my chunk
    wcol = torch.full((size, 1), float(weight), dtype=torch.float32)
    got = _all_to_all(pg, _pack(payload, meta, wcol))
    width = payload.shape[1]
    sent = (size - 1) * (width + (0 if meta is None else 8) + 4)
    got_payload, got_meta, weights = _unpack(got, width, meta is not None, with_weight=True)
    total = float(weights.sum())
    assert total > 0, "every rank of the group has weight 0"
    # 3. fp32 accumulation of my chunk, in rank order
    mine = decode(got_payload, got_meta, compression).sum(dim=0, keepdim=True) / total
    payload, meta = encode(mine, compression)
    # 4. all_gather of the reduced chunks (+ their scale/offset)
    rows = _all_gather(pg, _pack(payload, meta, None)[0])
    sent += (size - 1) * (width + (0 if meta is None else 8))
    all_payload, all_meta, _ = _unpack(rows, width, meta is not None, with_weight=False)
    out = decode(all_payload, all_meta, compression).reshape(-1)[:numel].clone()
    return out, ReduceStats(sent, time.perf_counter() - start, total)
