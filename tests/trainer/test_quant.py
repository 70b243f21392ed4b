"""Blockwise int8/int4 quantization: per-block error bounds (checked in float64), byte cost, packing, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from dutycycle.engine.errors import ConfigError
from dutycycle.trainer.parallel.quant import (
    QMAX,
    Quantized,
    decode,
    decode_sum,
    dequantize,
    encode,
    num_blocks,
    pack,
    packed_nbytes,
    quantize,
    sum_dtype,
    unpack,
    unquantized_bits,
    wire_dtype,
)

SIZES = (1, 255, 256, 257, 1000, 4099)  # most do not divide the block size
U = 2.0**-24  # fp32 unit roundoff


def slack(bits: int) -> float:
    """The bound absmax/(2 qmax) holds in real arithmetic. In fp32 the scale s = fl(A/qmax), the quotient
    fl(x/s) and the product fl(q*s) each round once (relative U): |x - q s| <= s/2 + |x/s| U s and the product
    adds |q s| U, with |x/s|, |q| <= qmax(1+U); s itself exceeds A/qmax by at most U. Together the bound grows by
    a factor of at most (1 + U)(1 + 4 qmax U): 3e-5 for int8, 2e-6 for int4."""
    return (1 + U) * (1 + 4 * QMAX[bits] * U)


def error_bound(absmax, bits: int):
    """The documented per-element error bound of a block with largest magnitude ``absmax``: absmax / (2 qmax),
    with qmax = 2^(bits-1) - 1 (absmax/254 for int8, absmax/14 for int4)."""
    return absmax / (2 * (2 ** (bits - 1) - 1))


def block_view(t: torch.Tensor, block: int) -> torch.Tensor:
    """float64 ``(rows, blocks, block)`` view of ``t`` (any shape, blocks along the last dim), zero padded."""
    t = t.to(torch.float64)
    n = t.shape[-1]
    t = torch.nn.functional.pad(t.reshape(-1, n), (0, num_blocks(n, block) * block - n))
    return t.view(t.shape[0], -1, block)


def worst_ratio(x: torch.Tensor, bits: int, block: int) -> float:
    """Largest per-block error over that block's bound absmax/(2 qmax); 0/0 (an all-zero block) counts as 0."""
    y = dequantize(quantize(x, bits, block))
    assert y.shape == x.shape and y.dtype == torch.float32
    xb, yb = block_view(x, block), block_view(y, block)
    err = (xb - yb).abs().amax(-1)
    bound = error_bound(xb.abs().amax(-1), bits)
    assert bool(((bound == 0) <= (err == 0)).all()), "an all-zero block must come back exactly"
    return float(torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.zeros_like(err)).max())


def inputs(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    normal = torch.randn(n, generator=gen, dtype=torch.float64)
    cauchy = torch.distributions.Cauchy(0.0, 1.0).sample((n,)).to(torch.float64)  # heavy tails: |x| up to ~1e5
    return {
        "random": (0.02 * normal).float(),
        "heavy_tailed": cauchy.float(),
        "all_zero": torch.zeros(n),
        "constant": torch.full((n,), -3.7),
        "tiny": (1e-30 * normal).float(),
        "huge": (1e30 * normal).float(),
        # magnitudes changing by 10^6 within the buffer, as a flat buffer of many parameters does
        "mixed_scales": (normal * 10 ** torch.linspace(-4, 2, n, dtype=torch.float64)).float(),
    }


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [256, 64])
def test_error_within_bound_per_block(bits, block):
    torch.manual_seed(0)  # the Cauchy sampler draws from the global generator
    gen = torch.Generator().manual_seed(1)
    for n in SIZES:
        for name, x in inputs(n, gen).items():
            r = worst_ratio(x, bits, block)
            assert r <= slack(bits), f"int{bits} block {block} n={n} {name}: error {r:.6f} x bound"
    # the bound is tight: random data comes close to it (a looser rounding, e.g. truncation, would show 2x)
    assert worst_ratio(torch.randn(1 << 14, generator=gen), bits, block) > 0.9


def test_documented_bounds():
    assert QMAX == {8: 127, 4: 7}  # the bounds above: absmax/254 and absmax/14
    assert error_bound(254.0, 8) == 1.0 and error_bound(14.0, 4) == 1.0


def test_rows_are_quantized_independently():
    """Blocks never straddle rows: a (rows, n) tensor quantizes exactly as each row alone."""
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)) * torch.tensor([[1e-3], [1.0], [1e3]])
    for bits in (8, 4):
        q = quantize(x, bits)
        assert q.data.shape[0] == 3 and q.scales.shape == (3, num_blocks(1000, 256))
        for i in range(3):
            qi = quantize(x[i], bits)
            assert torch.equal(q.data[i], qi.data) and torch.equal(q.scales[i], qi.scales)
        assert worst_ratio(x, bits, 256) <= slack(bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_byte_cost_and_pack_round_trip(bits):
    gen = torch.Generator().manual_seed(3)
    for n in SIZES:
        x = torch.randn(2, n, generator=gen)
        q = quantize(x, bits)
        expected = (n if bits == 8 else math.ceil(n / 2)) + 4 * math.ceil(n / 256)  # the docstring's formula
        assert packed_nbytes(n, bits) == expected and q.nbytes == 2 * expected
        buf = pack(q)
        assert buf.dtype == torch.uint8 and buf.shape == (2, expected)
        back = unpack(buf, n, bits)
        assert torch.equal(back.data, q.data) and torch.equal(back.scales, q.scales)
        assert torch.equal(dequantize(back), dequantize(q))
        assert torch.equal(decode(encode(x, bits), n, bits), dequantize(q))
        # a slot inside a gathered buffer may start at any byte offset
        shifted = torch.cat((torch.zeros(1, dtype=torch.uint8), buf[1]))[1:]
        assert torch.equal(dequantize(unpack(shifted, n, bits)), dequantize(q)[1])
    with pytest.raises(ValueError, match="does not hold"):
        unpack(torch.zeros(10, dtype=torch.uint8), 1000, bits)


def test_decode_sum_and_decode_into():
    """The summation after an all-to-all (``decode_sum``) and decoding into a caller's tensor agree exactly with
    decoding every row and summing, in every wire format."""
    x = torch.randn(3, 2, 1000, generator=torch.Generator().manual_seed(8))
    for bits in (32, 16, 8, 4):
        buf = encode(x, bits)
        assert torch.equal(decode_sum(buf, 1000, bits), decode(buf, 1000, bits).sum(0))
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.empty(3, 2, 1000, dtype=dtype)
            assert decode(buf, 1000, bits, out=out) is out
            assert torch.equal(out, decode(buf, 1000, bits).to(dtype))


def test_wire_formats_fp32_and_bf16():
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    assert torch.equal(decode(encode(x, 32), 300, 32), x)
    assert encode(x, 16).shape == (5, 600) and torch.equal(decode(encode(x, 16), 300, 16), x.bfloat16().float())
    assert packed_nbytes(300, 32) == 1200 and packed_nbytes(300, 16) == 600


def test_float64_wire_format_keeps_float64():
    """Format 64 sends float64 bytes and decodes and sums them in float64 (an fp32 step anywhere would change
    these 53-bit values); "unquantized" resolves to the input's own dtype, and each format names its wire dtype."""
    x = torch.randn(3, 2, 300, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert not torch.equal(x.float().double(), x)  # the values need all of float64
    buf = encode(x, 64)
    assert buf.shape == (3, 2, 2400) and packed_nbytes(300, 64) == 2400
    assert decode(buf, 300, 64).dtype == torch.float64 and torch.equal(decode(buf, 300, 64), x)
    assert decode_sum(buf, 300, 64).dtype == torch.float64 and torch.equal(decode_sum(buf, 300, 64), x.sum(0))
    assert torch.equal(decode(buf, 300, 64, out=torch.empty_like(x)), x)
    assert encode(x, 32).shape == (3, 2, 1200)  # format 32 is fp32: a cast, which is why collectives resolve
    assert [unquantized_bits(d) for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)] == \
        [64, 32, 16, 32]
    assert [wire_dtype(b) for b in (64, 32, 16, 8, 4)] == \
        ["float64", "float32", "bfloat16", "int8+fp32 scales", "int4+fp32 scales"]
    assert sum_dtype(64) == torch.float64 and all(sum_dtype(b) == torch.float32 for b in (32, 16, 8, 4))


def test_non_finite_values_poison_their_block_only():
    """A NaN or an infinity makes its whole block NaN: never a finite number, never a crash."""
    x = torch.randn(4 * 256 + 10, generator=torch.Generator().manual_seed(5))
    x[3], x[256 + 7], x[512 + 255] = math.nan, math.inf, -math.inf
    for bits in (8, 4):
        y = dequantize(quantize(x, bits))
        assert bool(y[:768].isnan().all()), "blocks holding NaN/inf must dequantize to NaN"
        assert bool(y[768:].isfinite().all())
        assert worst_ratio(x[768:], bits, 256) <= slack(bits)
    # float64 values beyond fp32's range overflow in the cast: NaN blocks too, not fp32's max
    big = torch.tensor([1e300, 1.0], dtype=torch.float64)
    assert bool(dequantize(quantize(big)).isnan().all())


@pytest.mark.parametrize("bits", [8, 4])
def test_fp32_maximum_dequantizes_finite(bits):
    """A block whose absmax is fp32's maximum (3.4028235e38) comes back finite and within the bound: the scale
    absmax/127 rounds up, and 127 * s used to overflow to inf. 1-row, multi-row and through decode_sum."""
    fmax = torch.finfo(torch.float32).max
    gen = torch.Generator().manual_seed(9)
    row = torch.randn(300, generator=gen)
    row[5], row[260] = fmax, -fmax  # one maximum in each of two blocks of 256
    rows = torch.stack((row, -row, torch.randn(300, generator=gen)))
    rows[2, 299] = torch.nextafter(torch.tensor(fmax), torch.tensor(0.0))  # the short last block
    for x in (row, rows):
        y = dequantize(quantize(x, bits))
        assert bool(y.isfinite().all()), f"int{bits}: a finite block dequantized to inf"
        assert worst_ratio(x, bits, 256) <= slack(bits)
        buf = encode(x, bits)
        assert torch.equal(decode(buf, 300, bits), y)
        summed = decode_sum(buf.reshape((1,) + buf.shape), 300, bits)  # one sender: the sum is the row itself
        assert bool(summed.isfinite().all()) and torch.equal(summed, y)
    # a NaN or an infinity next to the maximum still poisons its block
    bad = row.clone()
    bad[6] = math.inf
    y = dequantize(quantize(bad, bits))
    assert bool(y[:256].isnan().all()) and bool(y[256:].isfinite().all())


def test_low_precision_inputs_and_subnormal_blocks():
    x = torch.randn(700, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        xd = x.to(dtype)
        y = dequantize(quantize(xd, 8), dtype=dtype)
        assert y.dtype == dtype
        assert worst_ratio(xd, 8, 256) <= slack(8)
    # absmax/127 underflows to zero here; the block must not be flushed to zero
    sub = torch.full((8,), 1e-44)
    assert bool((dequantize(quantize(sub)) > 0).all())


def test_layernorm_next_to_linear_weights_stays_under_one_percent():
    """DESIGN: a flat FSDP buffer mixes LayerNorm weights near 1 with linear weights near 0.1; 256-element
    blocks keep int8's relative error of the buffer under 1%. A small parameter that shares a block with a large
    one keeps only the absolute bound: here a LayerNorm bias (~0.01) beside its weight (~1) loses ~18%."""
    gen = torch.Generator().manual_seed(7)
    parts = []
    for _ in range(4):  # (LayerNorm weight, LayerNorm bias, linear weight) per block of a small ViT, dim 192
        parts += [1 + 0.05 * torch.randn(192, generator=gen), 0.01 * torch.randn(192, generator=gen),
                  0.1 * torch.randn(192 * 192, generator=gen)]
    flat = torch.cat(parts)
    y = dequantize(quantize(flat, 8, 256))
    assert float((y - flat).norm() / flat.norm()) < 0.01
    linear = slice(2 * 192, 2 * 192 + 192 * 192)  # blocks of its own magnitude: well under 1%
    assert float((y[linear] - flat[linear]).norm() / flat[linear].norm()) < 0.01
    bias = slice(192, 2 * 192)
    assert float((y[bias] - flat[bias]).norm() / flat[bias].norm()) > 0.05


def test_bad_formats_are_refused_with_the_fix():
    x = torch.randn(10)
    with pytest.raises(ConfigError, match="bits=3"):
        quantize(x, bits=3)
    with pytest.raises(ConfigError, match="block=255"):
        quantize(x, bits=4, block=255)
    with pytest.raises(ConfigError, match="block=0"):
        quantize(x, bits=8, block=0)
    with pytest.raises(ConfigError, match="bits=12"):
        encode(x, bits=12)
    with pytest.raises(ConfigError, match="floating-point"):
        quantize(torch.arange(10), bits=8)
    assert isinstance(quantize(x), Quantized)
