"""MXFP4 expert tensors as gpt-oss stores them, dequantized while reading.

The OCP Microscaling format (docs/formats.md, "MXFP4 experts"): blocks of 32 values share
one E8M0 scale (2**(code - 127)); each value is an FP4 E2M1 code, two to a byte, the low
nibble first. gpt-oss stores an expert weight ``W`` [E, A, B] (transformers' layout: A the
input width) as ``W_blocks`` [E, B, A/32, 16] uint8 and ``W_scales`` [E, B, A/32] uint8,
that is transposed, each output row's inputs in blocks of 32. A value times its scale is
exact in bf16 and fp32 (at most two significant bits), so the dequantized weight is the
one transformers' ``convert_moe_packed_tensors`` builds, bit for bit, in either dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
NAN_SCALE = 0xFF  # E8M0's only NaN


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The blocks' and scales' shapes of an expert weight of ``shape`` [E, A, B]."""
    e, a, b = shape
    return (e, b, a // BLOCK, BLOCK // 2), (e, b, a // BLOCK)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] uint8 codes and [..., G] uint8 scales -> [..., G * 32] float32."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    out = values.reshape(*scales.shape, BLOCK) * scale[..., None]
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def read_slice(blocks: np.ndarray, scales: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    """``W[index]`` of the weight W [E, A, B] that ``blocks``/``scales`` store (memory maps:
    only the requested experts and output rows, and the blocks holding the requested
    inputs, are read). A NaN scale in them is a ValueError (a corrupt file)."""
    es, rows, cols = index
    r0, r1, step = rows.indices(blocks.shape[2] * BLOCK)
    assert step == 1, index
    g0, g1 = r0 // BLOCK, -(-r1 // BLOCK)
    scale = np.asarray(scales[es, cols, g0:g1])
    if (scale == NAN_SCALE).any():
        raise ValueError(f"E8M0's NaN scale ({NAN_SCALE})")
    part = dequantize(np.asarray(blocks[es, cols, g0:g1]), scale)
    return part[..., r0 - g0 * BLOCK : r1 - g0 * BLOCK].transpose(0, 2, 1)
