"""The outer step's memory: flat fp32 buffers on the parameters' own device, allocated once per process.

    bufs = OuterBuffers(inner.outer_params())    # on the device the parameters live on (a GPU for CUDA runs)
    bufs.capture(params)                         # snapshot = params
    pgrad = bufs.pseudo_gradient(params)         # pgrad = snapshot - params, into its buffer
    ... weighted_mean(pgrad, ..., out=bufs.mean, exchange=bufs.exchange); outer optimizer on snapshot, in place
    bufs.write_back(params)                      # params = snapshot (each in its own dtype)

What is kept between rounds, per parameter (fp32, 4 bytes each), on the parameters' device:

    snapshot   the parameters as of the last committed outer step: the one full copy DiLoCo needs (the
               pseudo-gradient is taken against it). It lives beside the parameters so the pseudo-gradient,
               the update and the write-back are device-local foreach/flat ops: no host round trip of the model.
    pgrad      this round's pseudo-gradient; it survives an aborted attempt, which resends it
    mean       the members' weighted mean; also the codec's scratch and, after the commit, the optimizer's
    (momentum) the outer optimizer's buffer, held by MomentumSGD (nesterov and sgd with momentum > 0)

plus the wire buffers of compression.Exchange (the codecs: about 2-3 x bytes per element, on CUDA as many again in
pinned host memory; "none": 4 bytes per element on the host, pinned beside a GPU), on the host prepared at start for
diloco.min_nodes members (Exchange.prepare). Nothing of the model's size is allocated per outer step. The flat
buffers, the prepared wire buffers and the momentum's reserved memory (OuterOptimizer.reserve) are touched before
the first one; wire buffers for another number of members, or on a GPU, are not. Every parameter tensor maps to a
view of each flat buffer, so the copies in and out are one torch._foreach_copy_ over the parameter list (cast to
each parameter's dtype on the way back).

The fingerprint (`fingerprint(flat)`) is the cross-node checksum: the wrapping 64-bit integer sum of the fp32
bit patterns (every element counts; integer addition is exact and order-free, so it is the same on any device,
thread count or reduction order) and an exact hash of a fixed strided sample of elements (positions count).
It reads the buffer once, where it lives; only 16 bytes and the sample cross to the host.
"""

from __future__ import annotations

import hashlib
import math
import weakref

import torch

from engine.outer.allreduce import Exchange

SAMPLE = 4096  # elements of the strided sample the fingerprint hashes exactly


class OuterBuffers:
    def __init__(self, params: list[torch.Tensor]):
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"diloco: the outer parameters live on several devices ({sorted(map(str, devices))}); "
                             f"the outer step needs them on one")
        self.device = devices.pop()
        self.shapes = [p.shape for p in params]
        self.numel = sum(p.numel() for p in params)
        self.snapshot = self._flat()
        self.pgrad = self._flat()
        self.mean = self._flat()
        self.exchange = Exchange(self.device)
        self._snap_views = self._views(self.snapshot)
        self._pgrad_views = self._views(self.pgrad)

    def _flat(self) -> torch.Tensor:
        # zeros, not empty: the pages are touched here, not by the run's first outer step (24 ms per 57 MB on this
        # VM, where every member of that step waits for the slowest; docs/performance.md)
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of a flat buffer per parameter, shaped like it."""
        return self._views(flat)

    @torch.no_grad()
    def write(self, params: list[torch.Tensor], flat: torch.Tensor) -> None:
        """params = flat (a buffer of this layout), each parameter in its own dtype."""
        self._check(params)
        torch._foreach_copy_(params, self._views(flat))

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(flat[at:at + n].view(shape))
            at += n
        return out

    def _check(self, params: list[torch.Tensor]) -> None:
        assert [p.shape for p in params] == self.shapes, "the outer parameters changed shape since the snapshot"

    @torch.no_grad()
    def capture(self, params: list[torch.Tensor]) -> None:
        """snapshot = params."""
        self._check(params)
        torch._foreach_copy_(self._snap_views, params)

    @torch.no_grad()
    def pseudo_gradient(self, params: list[torch.Tensor]) -> torch.Tensor:
        """pgrad = snapshot - params, into the pgrad buffer (returned): one subtraction per parameter, in one pass
        (a copy into the buffer and a subtraction over it were two: 0.021 s of a 15m model's outer step against
        0.011 s), each parameter promoted to fp32 on the way in."""
        self._check(params)
        for snap, p, out in zip(self._snap_views, params, self._pgrad_views):
            torch.sub(snap, p, out=out)
        return self.pgrad

    @torch.no_grad()
    def write_back(self, params: list[torch.Tensor]) -> None:
        """params = snapshot, each parameter in its own dtype."""
        self._check(params)
        torch._foreach_copy_(params, self._snap_views)

    def renew_scratch(self) -> None:
        """New mean and wire buffers, after a collective was abandoned: gloo cannot cancel it, and its thread may
        still write into the old ones when a frozen peer wakes up. Rare (a peer lost mid-collective)."""
        self.mean = self._flat()
        self.exchange = Exchange(self.device)

    def bytes_kept(self) -> int:
        """Bytes of the flat buffers and the wire buffers allocated so far (momentum excluded)."""
        return 3 * 4 * self.numel + self.exchange.nbytes()


@torch.no_grad()
def norm(flat: torch.Tensor) -> float:
    """The L2 norm of flat in its own dtype, one pass. It is remembered for this tensor object as it is now: the
    finiteness check and the sentinel's row both read the pseudo-gradient's norm, and the second gets the first's
    (a pass of 6 ms for a 15m model on one core). A write to the tensor, or to any view of its storage, moves
    torch's version counter and forgets it; a tensor that is gone is never mistaken for a new one."""
    global _last_norm
    if _last_norm is not None and _last_norm[0]() is flat and _last_norm[1] == flat._version:
        return _last_norm[2]
    value = float(torch.linalg.vector_norm(flat))
    _last_norm = (weakref.ref(flat), flat._version, value)
    return value


_last_norm: tuple[weakref.ref, int, float] | None = None


def finite(flat: torch.Tensor) -> bool:
    """No NaN or inf in flat: its norm is finite. One pass without a mask (isfinite().all() made a bool tensor of
    the model's size: 81 ms of every outer step for 14M parameters on one core, against 3 ms). Values so large that
    their squares overflow fp32 (above ~1e19) read as not finite too: a round that far gone has diverged as well."""
    return math.isfinite(norm(flat))


@torch.no_grad()
def fingerprint(flat: torch.Tensor) -> str:
    """A 12-hex-digit fingerprint of a flat fp32 tensor: equal tensors give equal fingerprints on any device."""
    bits = flat.view(torch.int32)
    n = bits.numel()
    even = n - n % 2
    # pairs of fp32 bit patterns as int64: wraps modulo 2^64, exact, independent of the reduction order
    total = int(bits[:even].view(torch.int64).sum()) if even else 0
    odd = int(bits[even:].sum()) if even < n else 0
    sample = bits[::max(1, n // SAMPLE)].cpu()
    h = hashlib.blake2b(digest_size=6)
    h.update(f"{n}:{total}:{odd}:".encode())
    h.update(sample.numpy().tobytes())
    return h.hexdigest()
