"""The rules of diloco.compression = "sparse"'s settings (engine/outer/sparse.py, docs/sparse.md), in a module of
their own without torch: the config (engine/config.py) checks a file's values with them, and the codec's SparseSpec
checks its own with the same ones."""

from __future__ import annotations

import math
from typing import Any

SPARSE_KEYS = ("sparse_chunk", "density", "sparse_bits", "sparse_beta")
SPARSE_BITS = (2, 4, 8)
SPARSE_MIN_CHUNK, SPARSE_MAX_CHUNK = 16, 1 << 16


def sparse_problem(key: str, value: Any) -> str | None:
    """What is wrong with diloco.<key> = value, a setting of compression "sparse" (one of SPARSE_KEYS), or None.
    The text names the value, not the key: the config's line and SparseSpec's put the key before it."""
    if key in ("density", "sparse_beta") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                              or not math.isfinite(value)):
        return f"{value!r} is not a finite number"
    if key == "sparse_chunk":
        if isinstance(value, bool) or not isinstance(value, int) or not SPARSE_MIN_CHUNK <= value <= SPARSE_MAX_CHUNK \
                or value & (value - 1):
            return (f"{value!r} is not an integer power of two from {SPARSE_MIN_CHUNK} to {SPARSE_MAX_CHUNK} (the "
                    f"indices are packed at log2(chunk) bits; e.g. 4096)")
    elif key == "density":
        if not 0 < value <= 1:
            return f"{value!r} is not in (0, 1] (the fraction of each chunk sent; the paper's 0.01-0.03)"
    elif key == "sparse_bits":
        if isinstance(value, bool) or not isinstance(value, int) or value not in SPARSE_BITS:
            return f"{value!r} is not one of {', '.join(map(str, SPARSE_BITS))} (the bits of a sent value)"
    elif key == "sparse_beta":
        if not 0 <= value <= 1:
            return f"{value!r} is not in [0, 1] (the accumulator's decay; the default 0.9, the paper's 0.95)"
    else:
        raise AssertionError(f"not a sparse setting: {key}")
    return None
