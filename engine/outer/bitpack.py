"""Bit packing for the sparse codec's wire (engine/outer/sparse.py): n values of `width` bits each into exactly
ceil(n * width / 8) bytes, little-endian within a byte, exact for any width (a width of 12 goes as one byte plane
and its 4 high bits packed two to a byte)."""

from __future__ import annotations

import torch


def _pack_narrow(v: torch.Tensor, width: int) -> torch.Tensor:
    """Values < 2^width (width 1, 2, 4 or 8), 8 // width to a byte -> uint8 [ceil(n * width / 8)]."""
    per = 8 // width
    n = v.numel()
    u = v.to(torch.uint8)
    if n % per:
        u = torch.cat([u, u.new_zeros(per - n % per)])
    if per == 1:
        return u
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=v.device)
    return (u.view(-1, per) << shifts).sum(1, dtype=torch.uint8)  # disjoint bit fields: the sum is their or


def _unpack_narrow(b: torch.Tensor, width: int, n: int) -> torch.Tensor:
    per = 8 // width
    if per == 1:
        return b[:n].to(torch.int64)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    mask = (1 << width) - 1
    return ((b.view(-1, 1) >> shifts) & mask).view(-1)[:n].to(torch.int64)


def pack_bits(v: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers < 2^width -> ceil(n * width / 8) bytes: width // 8 byte planes (byte j of every value,
    in turn), then the width % 8 high bits (8 // r to a byte for r in 1, 2, 4; bit by bit otherwise)."""
    v = v.reshape(-1).to(torch.int64)
    parts = [(v >> (8 * j)) & 0xFF for j in range(width // 8)]
    out = [p.to(torch.uint8) for p in parts]
    r = width % 8
    if r:
        high = v >> (8 * (width // 8))
        if r in (1, 2, 4):
            out.append(_pack_narrow(high, r))
        else:
            bits = (high.view(-1, 1) >> torch.arange(r, device=v.device)) & 1
            out.append(_pack_narrow(bits.view(-1), 1))
    return torch.cat(out) if len(out) > 1 else out[0] if out else v.new_zeros(0, dtype=torch.uint8)


def unpack_bits(b: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: the n values (int64) from its bytes."""
    v = torch.zeros(n, dtype=torch.int64, device=b.device)
    at = 0
    for j in range(width // 8):
        v |= b[at:at + n].to(torch.int64) << (8 * j)
        at += n
    r = width % 8
    if r:
        rest = b[at:]
        if r in (1, 2, 4):
            high = _unpack_narrow(rest, r, n)
        else:
            bits = _unpack_narrow(rest, 1, n * r).view(n, r)
            high = (bits << torch.arange(r, device=b.device)).sum(1)
        v |= high << (8 * (width // 8))
    return v


def packed_bytes(n: int, width: int) -> int:
    return -(-n * width // 8)
