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
- A finite block always dequantizes to finite values, fp32's maximum included: where ``absmax / qmax`` rounds
  up so far that ``qmax * s`` would overflow to infinity (absmax within an ulp or so of 3.4028235e38), the
  scale is stepped down one ulp, so ``|q * s| <= absmax``; the bound holds as above.
- Non-finite input: a block holding a NaN or an infinity gets a NaN scale and dequantizes to all NaN. A
  quantized format has no infinity, and a NaN must never come back as a finite number: poisoning the block
  keeps a training loop's non-finite check firing, as the fp32 sum would. Values beyond fp32's range in a
  float64 input become infinities when cast, and so NaN blocks too.

Wire formats (``bits``): 64 = float64 and 32 = fp32 (unquantized), 16 = bf16 (a cast), 8 and 4 = the blockwise
formats above, packed with their scales into one uint8 buffer per row (``encode`` / ``decode``), so one
``all_to_all_single`` or ``all_gather_single`` moves data and scales together. Each format has one fixed dtype on
the wire (``wire_dtype``): ``encode(x, 32)`` casts a float64 ``x`` to fp32. A collective configured
"unquantized" must not do that silently, so it asks ``unquantized_bits(x.dtype)``: the format that sends the
input's own dtype uncast (float64 as 64, fp32 as 32, bf16 as 16). Decoding and summing run in fp32, float64 for
format 64 (``sum_dtype``), so a float64 reduction stays float64 end to end.

Everything is vectorized over blocks (torch ops, no Python loop per block) and runs on the input's device. On
CPU the blocks go through in slabs of ``SLAB`` elements so that the fp32 temporaries stay in cache; on an
accelerator in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from dutycycle.engine.errors import ConfigError

DEFAULT_BLOCK = 256
QMAX = {8: 127, 4: 7}
WIRE_BITS = (64, 32, 16, 8, 4)
# the unquantized formats and their dtype on the wire (a plain cast; 8 and 4 pack codes with fp32 scales)
_FLOAT_FORMATS = {64: torch.float64, 32: torch.float32, 16: torch.bfloat16}
SLAB = 1 << 18  # elements a CPU pass works on at once (1 MiB of fp32: cache-sized temporaries)
# the smallest positive fp32 (subnormal): the floor of a non-zero block's scale, so that absmax/qmax
# underflowing to 0 cannot turn a non-zero block into zeros
_TINY = torch.finfo(torch.float32).smallest_normal * 2.0**-23
_FMAX = torch.finfo(torch.float32).max


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

    allowed = WIRE_BITS if wire else tuple(QMAX)
    if bits not in allowed:
        raise ConfigError(f"quantization bits={bits!r} is not supported; use one of {allowed}")
    if bits in QMAX and (not isinstance(block, int) or block < 2 or block % 2):
        raise ConfigError(f"quantization block={block!r} must be an even integer >= 2 (default {DEFAULT_BLOCK})")


def unquantized_bits(dtype: torch.dtype) -> int:
    """The unquantized wire format that sends ``dtype`` as it is: 64 for float64, 16 for bf16, 32 for fp32. A
    float16 input goes as fp32 (exact; there is no fp16 format)."""
    if dtype == torch.float64:
        return 64
    return 16 if dtype == torch.bfloat16 else 32


def wire_dtype(bits: int) -> str:
    """What format ``bits`` puts on the wire, as collectives record it (``Traffic.dtypes``): ``"float64"``,
    ``"float32"``, ``"bfloat16"``, ``"int8+fp32 scales"`` or ``"int4+fp32 scales"``."""
    if bits in _FLOAT_FORMATS:
        return dtype_name(_FLOAT_FORMATS[bits])
    return f"int{bits}+fp32 scales"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float64`` -> ``"float64"``: how a plain tensor's wire dtype is recorded."""
    return str(dtype).removeprefix("torch.")


def sum_dtype(bits: int) -> torch.dtype:
    """The dtype ``decode`` and ``decode_sum`` return for format ``bits``: float64 for 64 (a float64 reduction
    loses nothing to the decode), fp32 for every other format (bf16 and the quantized ones sum exactly enough
    in fp32: their own error is orders larger)."""
    return torch.float64 if bits == 64 else torch.float32


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def packed_nbytes(numel: int, bits: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes one row of ``numel`` elements takes on the wire in format ``bits`` (codes plus fp32 scales)."""
    if bits in _FLOAT_FORMATS:
        return _FLOAT_FORMATS[bits].itemsize * numel
    return _data_nbytes(numel, bits) + 4 * num_blocks(numel, block)


# ------------------------------------------------------------------------------------------------ quantize


def _slabs(rows: int, nblocks: int, block: int, device: torch.device) -> list[tuple[int, int]]:
    """Ranges of blocks processed together: all at once on an accelerator; on CPU about ``SLAB`` elements, so
    the fp32 temporaries stay in cache (7-10x faster here than one pass over a 64 MB buffer)."""
    step = nblocks if device.type != "cpu" else max(1, SLAB // (rows * block))
    return [(i, min(i + step, nblocks)) for i in range(0, nblocks, step)]


def _round_blocks(blocks: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (fp32 holding integers in [-qmax, qmax]) and scales of ``blocks`` (shape ``(rows, k, block)``)."""
    blocks = blocks.to(torch.float32)
    absmax = blocks.abs().amax(dim=-1)  # NaN propagates (torch's max does), an infinity stays infinite
    scales = torch.where(absmax > 0, (absmax / qmax).clamp_min(_TINY), absmax)  # 0 and NaN stay as they are
    scales = torch.where(torch.isfinite(scales), scales, math.nan)  # an infinity poisons its block too
    # near fp32's maximum, fl(absmax/qmax) may round up so that qmax * s overflows to inf on dequantize: step
    # such a scale down one ulp (then qmax * s <= absmax exactly). Scales only, 1/block of the data; NaN stays
    scales = torch.where(scales * qmax > _FMAX, scales.nextafter(torch.zeros((), device=scales.device)), scales)
    divisor = torch.where(scales > 0, scales, 1.0)  # all-zero and NaN blocks divide by 1
    codes = (blocks / divisor.unsqueeze(-1)).round_().clamp_(-qmax, qmax)
    return codes.nan_to_num_(0.0), scales  # never cast a NaN to an integer: the NaN scale carries it


def _write_codes(data: torch.Tensor, codes: torch.Tensor, start: int, bits: int) -> None:
    """Store fp32 ``codes`` (``(rows, m)``, m even for int4) as elements ``start..start+m`` of uint8 rows."""
    if bits == 8:
        data.view(torch.int8)[:, start : start + codes.shape[1]].copy_(codes)
    else:  # low nibble first, offset by 8: (lo + 8) + 16 (hi + 8) fits a byte exactly, even in fp32
        pairs = codes[:, 0::2].add(8).add_(codes[:, 1::2].add(8), alpha=16)
        data[:, start // 2 : start // 2 + pairs.shape[1]].copy_(pairs)


def _quantize_into(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> None:
    """Quantize ``x`` (``(rows, n)``) into uint8 ``data`` (``(rows, data bytes)``) and fp32 ``scales``."""
    R, n = x.shape
    qmax, full = QMAX[bits], n // block
    main = x[:, : full * block].view(R, full, block)
    for i, j in _slabs(R, full, block, x.device):
        codes, scales[:, i:j] = _round_blocks(main[:, i:j], qmax)
        _write_codes(data, codes.view(R, -1), i * block, bits)
    tail = n - full * block
    if tail:  # the short last block, padded with zeros (which change neither its absmax nor its codes)
        padded = torch.zeros(R, 1, block, dtype=torch.float32, device=x.device)
        padded[:, 0, :tail] = x[:, full * block :]
        codes, scales[:, full : full + 1] = _round_blocks(padded, qmax)
        _write_codes(data, codes.view(R, -1)[:, : tail + (tail % 2 if bits == 4 else 0)], full * block, bits)


def _data_nbytes(numel: int, bits: int) -> int:
    """Bytes of int8 or int4 codes for ``numel`` elements (two int4 codes a byte)."""
    return numel if bits == 8 else -(-numel // 2)


def quantize(x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK) -> Quantized:
    """Quantize floating-point ``x`` blockwise along its last dimension (see the module docstring)."""

    check_format(bits, block)
    if not x.is_floating_point():
        raise ConfigError(f"quantize needs a floating-point tensor, got dtype {x.dtype}; cast it first")
    x = x.reshape(1) if x.dim() == 0 else x
    rows, n = tuple(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(-1, n)
    data = torch.empty(x2.shape[0], _data_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(x2.shape[0], num_blocks(n, block), dtype=torch.float32, device=x.device)
    _quantize_into(x2, data, scales, bits, block)
    return Quantized(data.reshape(rows + (-1,)), scales.reshape(rows + (-1,)), n, bits, block)


def _dequantize_rows(data: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block: int,
                     out: torch.Tensor, groups: int) -> None:
    """Dequantize uint8 rows ``data`` (``(R, bytes)``) with ``scales`` (``(R, blocks)``) and write the fp32
    values into ``out`` (``(R, n)``), or, with ``groups`` > 1, their sum over ``groups`` consecutive row sets
    into ``out`` (``(R / groups, n)``)."""
    R = data.shape[0]
    for i, j in _slabs(R, num_blocks(n, block), block, data.device):
        a, b = i * block, min(j * block, n)
        if bits == 8:
            values = data.view(torch.int8)[:, a:b].to(torch.float32)
        else:  # a is even (block is even): the slab starts on a byte
            packed = data[:, a // 2 : (b + 1) // 2]
            codes = torch.stack((packed & 15, packed >> 4), dim=-1).view(R, -1)[:, : b - a]
            values = codes.to(torch.float32).sub_(8)
        values.mul_(scales[:, i:j].repeat_interleave(block, dim=1)[:, : b - a])
        if groups == 1:
            out[:, a:b] = values
        else:
            torch.sum(values.view(groups, -1, b - a), dim=0, out=out[:, a:b])


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for, shape ``rows + (numel,)``, computed in fp32 and returned as ``dtype``."""
    rows, n = tuple(q.data.shape[:-1]), q.numel
    data = q.data.reshape(-1, q.data.shape[-1])
    out = torch.empty(data.shape[0], n, dtype=torch.float32, device=data.device)
    _dequantize_rows(data, q.scales.reshape(data.shape[0], -1), n, q.bits, q.block, out, groups=1)
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
    """``x`` in wire format ``bits`` as uint8 rows (last dimension ``packed_nbytes(x.shape[-1], ...)``).
    int8/int4 rows are written in place as ``pack(quantize(x))`` lays them out, without the extra copy."""
    check_format(bits, block, wire=True)
    if bits in _FLOAT_FORMATS:  # a cast (none when x already has the format's dtype: then x's own bytes)
        return x.to(_FLOAT_FORMATS[bits]).contiguous().view(torch.uint8)
    x = x.reshape(1) if x.dim() == 0 else x
    rows, n = tuple(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(-1, n)
    nb = num_blocks(n, block)
    buf = torch.empty(x2.shape[0], packed_nbytes(n, bits, block), dtype=torch.uint8, device=x.device)
    scales = torch.empty(x2.shape[0], nb, dtype=torch.float32, device=x.device)
    _quantize_into(x2, buf[:, 4 * nb :], scales, bits, block)
    buf[:, : 4 * nb] = scales.view(torch.uint8)
    return buf.reshape(rows + (-1,))


def decode(buf: torch.Tensor, numel: int, bits: int, block: int = DEFAULT_BLOCK,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of uint8 rows written by ``encode`` (shape ``buf.shape[:-1] + (numel,)``) as ``sum_dtype(bits)``
    (fp32; float64 for format 64), or written into ``out`` (that shape, any floating dtype) and returned."""
    if bits in _FLOAT_FORMATS:
        values = buf.contiguous().view(_FLOAT_FORMATS[bits])
        return values.to(sum_dtype(bits)) if out is None else out.copy_(values)
    if out is None or out.dtype != torch.float32 or not out.is_contiguous():
        values = dequantize(unpack(buf, numel, bits, block))
        return values if out is None else out.copy_(values)
    q = unpack(buf.reshape(-1, buf.shape[-1]), numel, bits, block)
    _dequantize_rows(q.data, q.scales, numel, bits, block, out.view(-1, numel), groups=1)
    return out


def decode_sum(buf: torch.Tensor, numel: int, bits: int, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``decode(buf, ...).sum(0)`` in ``sum_dtype(bits)`` (fp32; float64 for format 64), in slabs, without
    materializing every decoded row: the summation after an all-to-all (``buf``: ``(senders, ..., packed row)``;
    result ``buf.shape[1:-1] + (numel,)``)."""
    G, rest = buf.shape[0], tuple(buf.shape[1:-1])
    rows = buf.reshape(-1, buf.shape[-1])
    acc = sum_dtype(bits)
    out = torch.empty(math.prod(rest), numel, dtype=acc, device=buf.device)
    if bits in _FLOAT_FORMATS:  # the unquantized formats sum in the same slabs: a baseline as careful as the rest
        values = rows.contiguous().view(_FLOAT_FORMATS[bits]).view(G, -1, numel)
        for i, j in _slabs(G * out.shape[0], num_blocks(numel, block), block, buf.device):
            a, b = i * block, min(j * block, numel)
            torch.sum(values[:, :, a:b].to(acc), dim=0, out=out[:, a:b])
    else:
        q = unpack(rows, numel, bits, block)
        _dequantize_rows(q.data, q.scales, numel, bits, block, out, groups=G)
    return out.reshape(rest + (numel,))
