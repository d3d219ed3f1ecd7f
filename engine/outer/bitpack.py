"""Bit packing for the sparse codec's wire (engine/outer/sparse.py): n values of `width` bits each into exactly
ceil(n * width / 8) bytes, little-endian within a byte, exact for any width (a width of 12 goes as one byte plane
and its 4 high bits packed two to a byte)."""

from __future__ import annotations

import torch


def _pack_narrow(v: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """Values < 2^width (width 1, 2, 4 or 8), 8 // width to a byte -> out, uint8 [ceil(n * width / 8)]."""
    per = 8 // width
    n = v.numel()
    if per == 1:
        out.copy_(v)
        return
    u = v.to(torch.uint8, copy=True)  # its own: shifted in place below
    if n % per:
        u = torch.cat([u, u.new_zeros(per - n % per)])
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=v.device)
    torch.sum(u.view(-1, per).bitwise_left_shift_(shifts), 1, dtype=torch.uint8, out=out)  # disjoint bit fields:
    # the sum is their or


def _unpack_narrow(b: torch.Tensor, width: int, n: int) -> torch.Tensor:
    per = 8 // width
    if per == 1:
        return b[:n].to(torch.int64)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    mask = (1 << width) - 1
    return ((b.view(-1, 1) >> shifts) & mask).view(-1)[:n].to(torch.int64)


def pack_bits(v: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Non-negative integers < 2^width -> ceil(n * width / 8) bytes: width // 8 byte planes (byte j of every value,
    in turn), then the width % 8 high bits (8 // r to a byte for r in 1, 2, 4; bit by bit otherwise). Written into
    `out` (uint8, exactly that long) when given, e.g. a message's section, with no copy between."""
    v = v.reshape(-1)
    n = v.numel()
    if out is None:
        out = torch.empty(packed_bytes(n, width), dtype=torch.uint8, device=v.device)
    assert out.dtype == torch.uint8 and out.numel() == packed_bytes(n, width), "out: the packed length, uint8"
    for j in range(width // 8):
        out[j * n:(j + 1) * n].copy_((v >> (8 * j) if j else v) & 0xFF)
    r = width % 8
    if r:
        high = v >> (8 * (width // 8)) if width >= 8 else v
        rest = out[(width // 8) * n:]
        if r in (1, 2, 4):
            _pack_narrow(high, r, rest)
        else:
            bits = (high.view(-1, 1) >> torch.arange(r, device=v.device)) & 1
            _pack_narrow(bits.view(-1), 1, rest)
    return out


def unpack_bits(b: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: the n values (int64) from its bytes."""
    planes = width // 8
    v = b[:n].to(torch.int64) if planes else torch.zeros(n, dtype=torch.int64, device=b.device)
    for j in range(1, planes):
        v.bitwise_or_(b[j * n:(j + 1) * n].to(torch.int64).bitwise_left_shift_(8 * j))
    r = width % 8
    if r:
        rest = b[planes * n:]
        if r in (1, 2, 4):
            high = _unpack_narrow(rest, r, n)
        else:
            bits = _unpack_narrow(rest, 1, n * r).view(n, r)
            high = (bits << torch.arange(r, device=b.device)).sum(1)
        v.bitwise_or_(high.bitwise_left_shift_(8 * planes))
    return v


def packed_bytes(n: int, width: int) -> int:
    return -(-n * width // 8)
