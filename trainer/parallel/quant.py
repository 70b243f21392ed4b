"""Blockwise symmetric quantization (int8, int4) and the wire formats of dutycycle's collectives.

A tensor's last dimension is cut into blocks of ``block`` consecutive elements (the last block may be short);
each block keeps one fp32 scale ``s = absmax / qmax`` and integer codes ``q = round(x / s)`` in ``[-qmax, qmax]``,
rounded to nearest (ties to even). Leading dimensions are independent rows: a block never straddles two rows,
so the W chunks of a reduce-scatter input, quantized as a ``(W, n)`` tensor, can go to W different peers.

=======  ====  ==========================================  ==========================================
format   qmax  error per element (round to nearest)          bytes for ``numel`` elements (one row)
=======  ====  ==========================================  ==========================================
int8     127   ``|x - x'| <= s/2 = absmax/254`` per block    ``numel + 4 * ceil(numel / block)``
int4     7     ``|x - x'| <= s/2 = absmax/14`` per block     ``ceil(numel / 2) + 4 * ceil(numel / block)``
=======  ====  ==========================================  ==========================================

``absmax`` is the block's largest magnitude. In fp32 arithmetic the bound holds up to a relative excess of about
``4 * qmax * 2**-24`` (rounding of the scale, the division and the product; 3e-5 for int8). int4 uses the
symmetric levels -7..7 (15 of the 16 codes) so that zero is exact and the error bound is the same on both sides.
Two int4 codes share a byte, stored offset by 8 (code ``q + 8`` in 1..15, low nibble first).

The block size trades scale overhead (4 bytes per block) against error: one block spans values of one
magnitude only if it is small. A flat FSDP buffer puts LayerNorm weights near 1 next to linear weights near
0.1, and with 256-element blocks the relative error stayed under 1% (``DEFAULT_BLOCK``); int8 then costs
0.254 and int4 0.129 of the fp32 bytes.

Edge cases, decided here:

- An all-zero block has scale 0 and dequantizes to exact zeros (no division by zero).
- Tiny and huge values work as long as the scale is a normal fp32 number (``absmax`` from about 1.5e-36 up to
  fp32's maximum, 3.4e38): 1e-30 and 1e30 keep the bound. Below that the scale is subnormal and the bound
  loosens by the subnormal spacing (1.4e-45); a non-zero block is never flushed to zero.
- Non-finite input: a block holding a NaN or an infinity gets a NaN scale and dequantizes to all NaN. A
  quantized format has no infinity, and a NaN must never come back as a finite number: poisoning the block
  keeps a training loop's non-finite check firing, as the fp32 sum would. Values beyond fp32's range in a
  float64 input become infinities when cast, and so NaN blocks too.

Wire formats (``bits``): 32 = fp32 (unquantized, the baseline), 16 = bf16 (a cast), 8 and 4 = the blockwise
formats above, packed with their scales into one uint8 buffer per row (``encode`` / ``decode``), so one
``all_to_all_single`` or ``all_gather_into_tensor`` moves data and scales together.

Everything is vectorized torch (no Python loop over blocks) and runs on whatever device the input is on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_BLOCK = 256
QMAX = {8: 127, 4: 7}
WIRE_BITS = (32, 16, 8, 4)
# the smallest positive fp32 (subnormal): the floor of a non-zero block's scale, so that absmax/qmax
# underflowing to 0 cannot turn a non-zero block into zeros
_TINY = torch.finfo(torch.float32).smallest_normal * 2.0**-23


@dataclass
class Quantized:
    """A blockwise-quantized tensor: blocks run along the last dimension, leading dimensions are rows.

    ``data``: uint8 codes, shape ``rows + (numel,)`` for int8 (the int8 bytes) or ``rows + (ceil(numel/2),)``
    for int4 (two codes a byte). ``scales``: float32, shape ``rows + (ceil(numel/block),)``.
    ``numel``: elements per row. ``bits``: 8 or 4. ``block``: elements per block.
    """

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales, all rows."""
        return self.data.numel() + 4 * self.scales.numel()


def check_format(bits: int, block: int, *, wire: bool = False) -> None:
    """Refuse an unknown format or block size with the values and the fix."""
    from dutycycle.engine.errors import ConfigError

    allowed = WIRE_BITS if wire else tuple(QMAX)
    if bits not in allowed:
        raise ConfigError(f"quantization bits={bits!r} is not supported; use one of {allowed}")
    if bits in QMAX and (not isinstance(block, int) or block < 2 or block % 2):
        raise ConfigError(f"quantization block={block!r} must be an even integer >= 2 (default {DEFAULT_BLOCK})")


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_nbytes(numel: int, bits: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes one row of ``numel`` elements takes on the wire in format ``bits`` (codes plus fp32 scales)."""
    if bits == 32:
        return 4 * numel
    if bits == 16:
        return 2 * numel
    data = numel if bits == 8 else -(-numel // 2)
    return data + 4 * num_blocks(numel, block)


def error_bound(absmax: torch.Tensor | float, bits: int) -> torch.Tensor | float:
    """The per-element error bound of a block with largest magnitude ``absmax``: absmax / (2 * qmax)."""
    return absmax / (2 * QMAX[bits])


# ------------------------------------------------------------------------------------------------ quantize


def quantize(x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK) -> Quantized:
    """Quantize floating-point ``x`` blockwise along its last dimension (see the module docstring)."""
    from dutycycle.engine.errors import ConfigError

    check_format(bits, block)
    if not x.is_floating_point():
        raise ConfigError(f"quantize needs a floating-point tensor, got dtype {x.dtype}; cast it first")
    if x.dim() == 0:
        x = x.reshape(1)
    qmax = QMAX[bits]
    rows, n = tuple(x.shape[:-1]), x.shape[-1]
    nb = num_blocks(n, block)
    xf = x.reshape(-1, n).to(torch.float32)
    if nb * block != n:  # pad the short last block with zeros, which change neither absmax nor codes
        xf = torch.nn.functional.pad(xf, (0, nb * block - n))
    blocks = xf.view(-1, nb, block)

    absmax = blocks.abs().amax(dim=-1)  # NaN propagates (torch's max does), an infinity stays infinite
    finite = torch.isfinite(absmax)
    scales = torch.where(absmax > 0, (absmax / qmax).clamp_min(_TINY), absmax)
    scales = scales.masked_fill(~finite, math.nan)
    divisor = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))
    q = blocks / divisor.unsqueeze(-1)
    q.round_().clamp_(-qmax, qmax)
    q.masked_fill_(~finite.unsqueeze(-1), 0)  # never cast a NaN to an integer; the NaN scale carries it
    q = q.view(-1, nb * block)

    if bits == 8:
        data = q[:, :n].to(torch.int8).view(torch.uint8)
    else:
        nbytes = -(-n // 2)
        codes = (q[:, : 2 * nbytes] + 8).to(torch.uint8)  # 2*nbytes <= nb*block: block is even
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Quantized(data.reshape(rows + (-1,)), scales.reshape(rows + (nb,)), n, bits, block)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for, shape ``rows + (numel,)``, computed in fp32 and returned as ``dtype``."""
    rows, n, block = tuple(q.data.shape[:-1]), q.numel, q.block
    data = q.data.reshape(-1, q.data.shape[-1])
    if q.bits == 8:
        out = data.view(torch.int8).to(torch.float32, memory_format=torch.contiguous_format)
    else:
        codes = torch.stack((data & 15, data >> 4), dim=-1).reshape(data.shape[0], -1)[:, :n]
        out = codes.to(torch.float32, memory_format=torch.contiguous_format).sub_(8)
    scales = q.scales.reshape(out.shape[0], -1)
    full = n // block
    if full:
        out[:, : full * block].view(-1, full, block).mul_(scales[:, :full].unsqueeze(-1))
    if full * block != n:
        out[:, full * block :].mul_(scales[:, full:])
    out = out.reshape(rows + (n,))
    return out if dtype == torch.float32 else out.to(dtype)


# ------------------------------------------------------------------------------------------------- packing


def pack(q: Quantized) -> torch.Tensor:
    """One uint8 buffer per row: the row's fp32 scales (native byte order), then its codes."""
    return torch.cat((q.scales.contiguous().view(torch.uint8), q.data), dim=-1)


def unpack(buf: torch.Tensor, numel: int, bits: int, block: int = DEFAULT_BLOCK) -> Quantized:
    """Inverse of ``pack`` for rows of ``numel`` elements (``buf``'s last dimension is the packed row)."""
    nb = num_blocks(numel, block)
    if buf.shape[-1] != packed_nbytes(numel, bits, block):
        raise ValueError(f"packed row of {buf.shape[-1]} bytes does not hold {numel} int{bits} elements "
                         f"in blocks of {block} ({packed_nbytes(numel, bits, block)} bytes)")
    # a copy: a slot inside a gathered buffer need not start on a 4-byte boundary (scales are 1.6% of it)
    scales = buf[..., : 4 * nb].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return Quantized(buf[..., 4 * nb :], scales, numel, bits, block)


def encode(x: torch.Tensor, bits: int, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``x`` in wire format ``bits`` as uint8 rows (last dimension ``packed_nbytes(x.shape[-1], ...)``)."""
    check_format(bits, block, wire=True)
    if bits == 32:
        return x.to(torch.float32).contiguous().view(torch.uint8)
    if bits == 16:
        return x.to(torch.bfloat16).contiguous().view(torch.uint8)
    return pack(quantize(x, bits, block))


def decode(buf: torch.Tensor, numel: int, bits: int, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """fp32 values of uint8 rows written by ``encode`` (shape ``buf.shape[:-1] + (numel,)``)."""
    if bits == 32:
        return buf.contiguous().view(torch.float32)
    if bits == 16:
        return buf.contiguous().view(torch.bfloat16).to(torch.float32)
    return dequantize(unpack(buf, numel, bits, block))
