"""Low-bit optimizer state formats: block-wise 8-bit codes and the stochastic-rounding bit source.

8-bit states (`quantize_blockwise` / `dequantize_blockwise`) are cut into blocks of QUANT_BLOCK elements
from element 0; each block stores one fp32 absmax (the largest magnitude in the block) and one uint8 code
per element for r = |x| / absmax in [0, 1]. The code is a small binary floating-point format rather than
bitsandbytes' decimal dynamic tree, so that the nearest code is round-to-nearest-even on the fp32 bits
(a few integer vector ops) instead of a search in a 256-entry table:

- signed (exp_avg): sign bit + 7-bit magnitude, 4 exponent bits and 3 mantissa bits (E4M3, largest
  exponent = 2^0): normal values 2^(e-15) * (1 + m/8) for e in 1..15, subnormals 2^-14 * m/8;
- unsigned (exp_avg_sq, Adagrad's sum): 8-bit magnitude, E5M3 with largest exponent 2^0: normals
  2^(e-31) * (1 + m/8), subnormals 2^-30 * m/8.

1.0 (the absmax element) is exact. Codes above 1.0 (the top exponent with m > 0) are never produced.
Error of one quantization, relative to the block's absmax A: |x - deq(q(x))| <= |x| / 16 for
|x| >= A * 2^(1-emax) and <= A * 2^(-emax-3) below (emax = 15 signed, 31 unsigned); see
docs/cpu_optimizers.md.

Also here: the counter-based hash that feeds stochastic rounding of bf16 states, and `round_bf16_stochastic`,
the torch statement of that rounding (the C++ kernels produce the same bits).
"""

from __future__ import annotations

from typing import Tuple

import torch

QUANT_BLOCK = 2048

_EMAX = {True: 15, False: 31}  # signed (E4M3 magnitude), unsigned (E5M3)
_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def num_blocks(n: int) -> int:
    """Number of QUANT_BLOCK blocks (and absmax values) for an n-element state."""
    return (n + QUANT_BLOCK - 1) // QUANT_BLOCK


def _encode_magnitude(r: torch.Tensor, emax: int) -> torch.Tensor:
    """Nearest code (ties to even) for fp32 r in [0, 1]: RNE of the fp32 bits to 3 mantissa bits."""
    u = r.view(torch.int32)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - ((127 - emax) << 3)
    # Below the smallest normal the code is the subnormal multiple m of 2^(-emax-2), rounded half to even
    # (8 there is the smallest normal's code, which is consistent).
    sub = torch.round(r * float(2.0 ** (emax + 2))).to(torch.int32)
    return torch.where(r >= float(2.0 ** (1 - emax)), normal, sub)


def _decode_magnitude(c: torch.Tensor, emax: int) -> torch.Tensor:
    """fp32 value in [0, 1] of magnitude codes c (int32)."""
    normal = ((c << 20) + ((127 - emax) << 23)).view(torch.float32)
    sub = (c & 7).to(torch.float32) * float(2.0 ** (-emax - 2))
    return torch.where((c >> 3) == 0, sub, normal)


def _check_blockwise(q: torch.Tensor, absmax: torch.Tensor) -> None:
    for name, t, dtype in (("q", q, torch.uint8), ("absmax", absmax, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense CPU {dtype} tensor, got {t.dtype} on {t.device}")
    nb = num_blocks(q.numel())
    if absmax.numel() != nb:
        raise ValueError(
            f"absmax has {absmax.numel()} elements but q has {q.numel()}: expected ceil({q.numel()} / "
            f"{QUANT_BLOCK}) = {nb}"
        )


def quantize_blockwise(x: torch.Tensor, signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantizes an fp32 CPU tensor to (uint8 codes of x's shape, fp32 absmax of ceil(n / QUANT_BLOCK)).

    A block holding inf or NaN gets absmax NaN and all codes 0 (it dequantizes to NaN); an all-zero block
    gets absmax 0. Bit-identical to what the 8-bit optimizer kernels store.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.layout != torch.strided:
        raise ValueError(f"x must be a dense CPU float32 tensor, got {x.dtype} on {x.device}")
    emax = _EMAX[bool(signed)]
    n = x.numel()
    nb = num_blocks(n)
    flat = x.detach().reshape(-1)
    padded = torch.zeros(nb * QUANT_BLOCK, dtype=torch.float32)
    padded[:n] = flat
    blocks = padded.view(nb, QUANT_BLOCK)
    mag = blocks.abs()
    absmax = mag.amax(dim=1) if nb else torch.zeros(0, dtype=torch.float32)
    bad = ~torch.isfinite(absmax)
    inv = 1.0 / absmax
    # Multiply by the reciprocal; a block whose reciprocal overflows (absmax below 2^-128) divides.
    use_div = ~torch.isfinite(inv) & (absmax > 0) & ~bad
    r = torch.where(use_div[:, None], mag / absmax[:, None], mag * inv[:, None])
    r = torch.where(((absmax == 0) | bad)[:, None], torch.zeros((), dtype=torch.float32), r)
    codes = _encode_magnitude(r, emax)
    if signed:
        neg = (blocks < 0) & (codes != 0)
        codes = codes | (neg.to(torch.int32) << 7)
    absmax = torch.where(bad, torch.full((), float("nan")), absmax)
    q = codes.reshape(-1)[:n].to(torch.uint8).reshape(x.shape)
    return q, absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of uint8 codes `q` with per-block `absmax` (numel ceil(q.numel() / QUANT_BLOCK))."""
    _check_blockwise(q, absmax)
    emax = _EMAX[bool(signed)]
    n = q.numel()
    codes = q.reshape(-1).to(torch.int32)
    mag = codes & 0x7F if signed else codes
    value = _decode_magnitude(mag, emax)
    if signed:
        value = torch.where((codes & 0x80) != 0, -value, value)
    scale = absmax.reshape(-1).repeat_interleave(QUANT_BLOCK)[:n]
    return (value * scale).reshape(q.shape)


# ---- stochastic rounding -------------------------------------------------------------------------


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sr_keys(seed: int, step: int) -> Tuple[int, int]:
    """The two 32-bit keys of one call: splitmix64(splitmix64(seed) ^ step), low and high half."""
    k = _splitmix64(_splitmix64(seed & _M64) ^ (step & _M64))
    return k & _M32, k >> 32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow: split c into 16-bit halves.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_bits(n: int, seed: int, step: int) -> torch.Tensor:
    """32 random bits (int64 tensor) for elements 0..n-1 of one call:
    lowbias32(lo32(i) ^ k0 ^ f(hi32(i))), f(0) = 0, f(h) = lowbias32(h ^ k1) otherwise."""
    k0, k1 = sr_keys(seed, step)
    i = torch.arange(n, dtype=torch.int64)
    lo, hi = i & _M32, i >> 32
    x = lo ^ k0
    if n > (1 << 32):
        hk = _lowbias32((hi ^ k1) & _M32)
        x = x ^ torch.where(hi == 0, torch.zeros((), dtype=torch.int64), hk)
    return _lowbias32(x)


def round_bf16_stochastic(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """bf16 of fp32 x rounded up in magnitude with probability equal to the dropped fraction:
    bits = (bits(x) + r16) >> 16 with r16 in [0, 2^16). NaN becomes 0xFFFF like the nearest-even path."""
    u = x.reshape(-1).view(torch.int32).to(torch.int64) & _M32
    out = ((u + r16) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x.reshape(-1)), torch.full((), 0xFFFF, dtype=torch.int64), out)
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16).view(torch.bfloat16).reshape(x.shape)


def check_seed(seed: object) -> int:
    """Validates a stochastic-rounding seed: an int in [0, 2^64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _M64:
        raise ValueError(f"seed must be an int in [0, 2^64), got {seed!r}")
    return seed
